"""The model forms over a batch of slots (the ground of in-flight batching): one pass for the
trees of M slots, each slot attending to its own cache range up to its own length, equals each
slot run alone. fp32 on CPU; with and without the layer kernels (their references here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from treeflash_export.models import TreeVerifier
from treeflash_runtime.sampling import GREEDY, NUCLEUS, SAMPLE

LENGTHS = [5, 0, 17]  # committed tokens per slot: a short one, an empty one, a longer one
S = 40  # cache slots per slot
N = 6  # tree nodes per slot


def random_tree(n: int, gen: torch.Generator):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
    return mask, mask.sum(1) - 1  # ancestor-or-self mask, depths


@pytest.mark.parametrize("fast_kernels", [False, True], ids=["torch-ops", "layer-kernels"])
def test_verifier_over_slots_equals_each_slot_alone(load, fast_kernels):
    pair = load("qwen3")
    verifier = TreeVerifier(pair.verifier, pair.drafter.cfg.target_layer_ids)
    verifier.use_layer_kernels(fast_kernels)
    gen = torch.Generator().manual_seed(0)
    V = verifier.vocab_size
    singles, trees = [], []
    with torch.inference_mode():
        for P in LENGTHS:
            cache = verifier.new_cache(S)
            if P:
                prompt = torch.randint(0, V, (P,), generator=gen)
                causal = torch.ones(P, P, dtype=torch.bool).tril()
                verifier.forward_cached(prompt, torch.arange(P), causal, cache, torch.tensor(0))
            singles.append(cache)
            mask, depths = random_tree(N, gen)
            trees.append((torch.randint(0, V, (N,), generator=gen), P + depths, mask))
        batch_cache = torch.cat(singles, dim=3)  # slot m's range at m * S on the sequence axis
        past = torch.tensor(LENGTHS)
        logits, taps = verifier.forward_cached(torch.stack([t[0] for t in trees]), torch.stack([t[1] for t in trees]),
                                               torch.stack([t[2] for t in trees]), batch_cache, past)
        assert logits.shape == (3, N, V) and taps.shape[:2] == (3, N)
        for m, (P, cache, (tokens, positions, mask)) in enumerate(zip(LENGTHS, singles, trees)):
            want_logits, want_taps = verifier.forward_cached(tokens, positions, mask, cache, torch.tensor(P))
            assert (logits[m] - want_logits).abs().max() < 1e-5, m
            assert (taps[m] - want_taps).abs().max() < 1e-5, m
            assert (batch_cache[:, :, :, m * S : (m + 1) * S] - cache).abs().max() < 1e-5, m  # the new K/V in place
        # Only some rows' logits (a prefill chunk's last real row per slot).
        rows = torch.tensor([[N - 1], [0], [2]])
        picked, _ = verifier.forward_cached(torch.stack([t[0] for t in trees]), torch.stack([t[1] for t in trees]),
                                            torch.stack([t[2] for t in trees]), batch_cache, past, logit_rows=rows)
        assert picked.shape == (3, 1, V)
        assert all((picked[m, 0] - logits[m, int(rows[m, 0])]).abs().max() < 1e-5 for m in range(3))


@pytest.mark.parametrize("fast_kernels", [False, True], ids=["torch-ops", "layer-kernels"])
def test_drafter_over_slots_equals_each_slot_alone(load, fast_kernels):
    """Slots at different context lengths, each with its own count of pending context rows (the rest
    padding), and a block each: one batched pass gives every slot's z and cache as alone."""
    pair = load("qwen3")
    backbone = pair.drafter.model
    backbone.use_layer_kernels(fast_kernels)
    try:
        gen = torch.Generator().manual_seed(1)
        F = backbone.fc.weight.shape[1]
        H, B, C = backbone.cfg.hidden_size, backbone.cfg.block_size, 3
        counts = [2, 3, 1]
        singles, steps = [], []
        with torch.inference_mode():
            for P, count in zip(LENGTHS, counts):
                cache = backbone.new_cache(S)
                if P:  # the prompt's context, ingested
                    backbone.forward_cached(torch.randn(P, F, generator=gen), torch.tensor(0), torch.tensor(P), None,
                                            cache)
                singles.append(cache)
                steps.append((torch.randn(C, F, generator=gen), torch.tensor(P), torch.tensor(count),
                              torch.randn(B, H, generator=gen)))
            batch_cache = torch.cat(singles, dim=3)
            z = backbone.forward_cached(*(torch.stack([s[j] for s in steps]) for j in range(4)), batch_cache)
            assert z.shape == (3, B, H)
            for m, (cache, step) in enumerate(zip(singles, steps)):
                want = backbone.forward_cached(*step, cache)
                assert (z[m] - want).abs().max() < 1e-5, m
                live = LENGTHS[m] + counts[m] + B  # context and block K/V written; the padding rows' land after
                assert (batch_cache[:, :, :, m * S : m * S + live] - cache[:, :, :, :live]).abs().max() < 1e-5, m
    finally:
        backbone.use_layer_kernels(False)


# ---------------------------------------------------------------- the engine: slots, scheduler, rounds

BUDGETS = [12, 5, 9, 16, 7]  # requests finish at different rounds: slots free up and are taken again


def engine_for(pair, mode, max_batch=3, capacity=96, tree_size=12, **kw):
    from treeflash_runtime.backends.pytorch import TorchRunner
    from treeflash_runtime.engine import Engine

    tree = TreeConfig(mode=mode, tree_size=tree_size, top_m=3, top_k=3)
    runner = TorchRunner(pair.verifier, pair.drafter, max_batch=max_batch, capacity=capacity, tree=tree, **kw)
    return Engine(runner, prefill_chunk=4)  # prompts go in several chunks, between other slots' rounds


def prompts_of(pair):
    from conftest import PROMPTS

    texts = PROMPTS + ["x = [i * i for i in range(10)]", "Once upon a time"]
    return [pair.tokenizer(t)["input_ids"] for t in texts]


from treeflash_export.config import SamplingConfig, TreeConfig  # noqa: E402


@pytest.mark.parametrize("mode", ["treeflash", "marginal", "chain", "ar"])
def test_every_request_of_a_batch_equals_its_own_greedy_decoding(load, mode):
    """Five requests through three slots, joining as others leave, prompts prefilled in chunks
    between rounds: each one's tokens equal transformers' greedy output for it alone."""
    from conftest import hf_greedy

    from treeflash_runtime.engine import Request

    pair = load("qwen3")
    engine = engine_for(pair, mode)
    prompts = prompts_of(pair)
    requests = [Request(ids, SamplingConfig(max_new_tokens=n, stop_token_ids=())) for ids, n in zip(prompts, BUDGETS)]
    engine.run(requests)
    for r, ids, n in zip(requests, prompts, BUDGETS):
        assert r.state == "finished" and r.stop_reason == "max_new_tokens"
        assert r.tokens == hf_greedy(pair.verifier, ids, n), (mode, ids)
    assert engine.scheduler.idle() and not bool(engine.runner.state.active.any())
    assert max(engine.rounds_by_batch) >= 2  # rounds really served several requests at once
    if mode != "ar":
        assert max(max(r.accept_lengths) for r in requests) >= 1


def test_a_sampled_request_does_not_depend_on_its_neighbours_or_the_tree(load):
    """Keyed sampling: a request's tokens are a function of its prompt, settings and seed; alone,
    among others (greedy and sampled, other seeds), and even in plain decoding, they are the same."""
    from treeflash_runtime.engine import Request

    pair = load("qwen3")
    prompts = prompts_of(pair)
    wanted = SamplingConfig(max_new_tokens=14, temperature=0.9, top_p=0.95, seed=11, stop_token_ids=())

    def tokens_of(mode, neighbours):
        engine = engine_for(pair, mode)
        me = Request(prompts[1], wanted)
        others = [Request(prompts[i], SamplingConfig(max_new_tokens=6 + i, temperature=0.7 * (i % 2), seed=i,
                                                     stop_token_ids=())) for i in (0, 2, 3, 4)][:neighbours]
        engine.run(others[:1] + [me] + others[1:])
        return me.tokens

    alone = tokens_of("treeflash", 0)
    assert len(alone) == 14
    assert tokens_of("treeflash", 4) == alone
    assert tokens_of("marginal", 2) == alone
    assert tokens_of("ar", 3) == alone  # the same noise at the same positions: plain decoding's tokens
    other_seed = SamplingConfig(max_new_tokens=14, temperature=0.9, top_p=0.95, seed=12, stop_token_ids=())
    engine = engine_for(pair, "treeflash")
    assert engine.run([Request(prompts[1], other_seed)])[0].tokens != alone


def test_cancelled_and_refused_requests_free_their_slots(load):
    from treeflash_export.errors import ConfigError
    from treeflash_runtime.engine import Request

    pair = load("qwen3")
    engine = engine_for(pair, "treeflash", max_batch=2, capacity=64)
    prompts = prompts_of(pair)
    with pytest.raises(ConfigError, match="ask for at most"):
        engine.submit(Request(prompts[0], SamplingConfig(max_new_tokens=200)))
    seen = []

    def stop_after_two(tokens, seen=seen):
        seen.extend(tokens)
        return len(seen) >= 2  # as a stop word or a closed stream does

    short = Request(prompts[0], SamplingConfig(max_new_tokens=10, stop_token_ids=()), on_tokens=stop_after_two)
    cancelled = Request(prompts[2], SamplingConfig(max_new_tokens=10, stop_token_ids=()))
    later = Request(prompts[3], SamplingConfig(max_new_tokens=6, stop_token_ids=()))
    engine.cancel(cancelled)
    engine.run([short, cancelled, later])
    assert short.stop_reason == "stopped" and len(short.tokens) >= 2
    assert cancelled.state == "cancelled" and cancelled.tokens == []
    assert later.state == "finished" and len(later.tokens) == 6
    assert engine.scheduler.idle()


# ---------------------------------------------------------------- treeflash-run --prompts-file


def _run_cli(args):
    from click.testing import CliRunner

    from treeflash_runtime.cli import main

    return CliRunner().invoke(main, args)


def test_prompts_file_serves_every_line_in_order_equal_to_single_runs(pair_dirs, tmp_path):
    import json

    from conftest import PROMPTS

    d = pair_dirs["qwen3"]
    lines = [{"prompt": PROMPTS[0], "max_new_tokens": 9}, {"prompt": PROMPTS[1]},
             {"prompt": PROMPTS[2], "max_new_tokens": 5, "temperature": 0.8, "seed": 3}]
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")  # a blank line is skipped
    base = ["--model", str(d / "verifier"), "--drafter", str(d / "drafter"), "--tree-size", "12", "--top-m", "3",
            "--top-k", "3", "--max-seq-len", "96", "--max-new-tokens", "7", "--ignore-eos", "--json"]
    r = _run_cli(base + ["--prompts-file", str(f), "--max-batch", "2", "--tree-size-by-batch", "2:8"])
    assert r.exit_code == 0, r.output
    out = [json.loads(x) for x in r.stdout.splitlines()]
    assert [o["line"] for o in out] == [1, 2, 3] and [o["new_tokens"] for o in out] == [9, 7, 5]
    for o, line in zip(out[:2], lines[:2]):  # greedy lines equal a single treeflash-run of that prompt
        single = _run_cli(base + ["--prompt", line["prompt"], "--max-new-tokens", str(line.get("max_new_tokens", 7))])
        assert single.exit_code == 0, single.output
        want = json.loads(single.stdout)
        assert o["token_ids"] == want["token_ids"] and o["text"] == want["text"]
        assert {"rounds", "accept_lengths", "tokens_per_s", "prefill_s", "first_token_s", "stop_reason"} <= set(o)
    assert out[2]["temperature"] == 0.8 and out[2]["seed"] == 3


@pytest.mark.parametrize("content,message", [
    ('{"prompt": "a"}\n{"prompt": "b", "max_new_tokens": 0}\n', ":2: --max-new-tokens must be >= 1"),
    ('{"prompt": "a"}\nnot json\n', ":2: not JSON"),
    ('["a"]\n', ":1: a line must be a JSON object"),
    ('{"prompt": "a", "temp": 1}\n', ":1: unknown field 'temp'"),
    ('{"max_new_tokens": 4}\n', ':1: no "prompt"'),
    ('{"prompt": "a", "seed": "x"}\n', ":1: 'seed' must be a number"),
    ("\n", "holds no prompt"),
])
def test_a_malformed_prompts_file_is_one_line_naming_file_and_line(tmp_path, content, message):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    r = _run_cli(["--model", str(tmp_path / "never-loaded"), "--drafter", str(tmp_path), "--prompts-file", str(f)])
    assert r.exit_code == 2
    assert r.stderr.startswith("error: ") and message in r.stderr and str(f) in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_null_field_in_a_prompts_file_takes_the_command_line_value(tmp_path):
    from treeflash_export.config import SamplingConfig
    from treeflash_runtime.offline import read_prompts_file

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "seed": null, "temperature": null, "max_new_tokens": 5}\n')
    (line,) = read_prompts_file(f, SamplingConfig(temperature=0.5, seed=7, max_new_tokens=9))
    assert (line.sampling.seed, line.sampling.temperature, line.sampling.max_new_tokens) == (7, 0.5, 5)


def test_bench_concurrency_rows_report_latency_and_identical_outputs(pair_dirs):
    import json

    from click.testing import CliRunner

    from treeflash_runtime.bench.cli import main

    d = pair_dirs["qwen3"]
    r = CliRunner().invoke(main, ["--model", str(d / "verifier"), "--drafter", str(d / "drafter"), "--concurrency",
                                  "1,3", "--requests", "5", "--max-new-tokens", "6", "--tree-sizes", "8", "--top-m", "2",
                                  "--top-k", "2", "--ignore-eos", "--max-seq-len", "64", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    # The default: the self-tuning tree, then plain decoding, at each concurrency.
    assert [(row["variant"], row["concurrency"], row["requests"], row["tokens"]) for row in report["rows"]] == [
        ("auto", 1, 5, 30), ("auto", 3, 5, 30), ("ar", 1, 5, 30), ("ar", 3, 5, 30)]
    for row in report["rows"]:
        assert row["tokens_per_s"] > 0 and row["identical_outputs"] is True and row["tokens_per_round"] >= 1
        assert set(row["ttft_ms"]) == set(row["itl_ms"]) == {"mean", "p50", "p90"}
        assert row["ratio_to_ar"] == pytest.approx(row["tokens_per_s"] / report["rows"][2 + (row["concurrency"] == 3)]
                                                   ["tokens_per_s"])
    assert report["identical_outputs"] is True and report["max_batch"] == 3 and report["dtype"] == "float32"
    # Outputs that differ are reported as such; in 16-bit the table says why that may be (near-ties).
    from treeflash_runtime.bench.batching import format_batching_report

    assert "near-tied" not in format_batching_report(report)
    differ = {**report, "identical_outputs": False}
    assert "near-tied" not in format_batching_report(differ)
    assert "near-tied" in format_batching_report({**differ, "dtype": "bfloat16"})
    from treeflash_runtime.bench.cli import format_report

    single = {"rows": [{"backend": "torch", "setting": "ar", "mean_accepted": 1.0, "tokens_per_s": 9.0,
                        "speedup_vs_ar": 1.0, "worst_prompt_vs_ar": 1.0, "ratio_vs_torch": 1.0}],
              "identical_outputs": False, "prompts": 1, "repeat": 1, "max_new_tokens": 4, "dtype": "float32"}
    assert "near-tied" not in format_report(single) and "near-tied" in format_report({**single, "dtype": "float16"})
    # Hand-written tables beside it: one variant each.
    r = CliRunner().invoke(main, ["--model", str(d / "verifier"), "--drafter", str(d / "drafter"), "--concurrency",
                                  "1,3", "--requests", "3", "--max-new-tokens", "4", "--tree-sizes", "8", "--modes",
                                  "treeflash", "--tree-size-by-batch", "1:8,2:4;1:4", "--ignore-eos",
                                  "--max-seq-len", "64", "--json"])
    assert r.exit_code == 0, r.output
    assert [row["variant"] for row in json.loads(r.stdout)["rows"]] == [
        "treeflash 1:8,2:4", "treeflash 1:8,2:4", "treeflash 1:4", "treeflash 1:4", "ar", "ar"]
    # --repeat: each row is the median of its runs (the variants taking turns), every run listed.
    r = CliRunner().invoke(main, ["--model", str(d / "verifier"), "--drafter", str(d / "drafter"), "--concurrency",
                                  "1,3", "--requests", "3", "--max-new-tokens", "4", "--tree-sizes", "8", "--modes",
                                  "chain", "--ignore-eos", "--max-seq-len", "64", "--repeat", "3", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["repeat"] == 3 and report["identical_outputs"] is True
    assert [(row["variant"], row["concurrency"]) for row in report["rows"]] == [
        ("chain", 1), ("chain", 3), ("ar", 1), ("ar", 3)]
    for row in report["rows"]:
        assert len(row["tokens_per_s_runs"]) == 3 and row["tokens_per_s"] == sorted(row["tokens_per_s_runs"])[1]
        plain = next(r for r in report["rows"] if r["variant"] == "ar" and r["concurrency"] == row["concurrency"])
        assert row["ratio_to_ar_runs"] == pytest.approx(
            [a / p for a, p in zip(row["tokens_per_s_runs"], plain["tokens_per_s_runs"])])


# ---------------------------------------------------------------- what CUDA captures, on the CPU


@pytest.mark.parametrize("mode", ["treeflash", "chain", "ar"])
def test_captured_slot_rounds_run_eagerly_are_exact_and_make_no_host_tensor(load, mode):
    """The round per bucket that CUDA captures (with every slot inactive during capture, then replayed)
    run through an eager stand-in: outputs still equal greedy decoding, and the round function uses
    only device state and its own results (the dispatch-mode spy of test_device_round)."""
    from conftest import hf_greedy
    from test_device_round import HostTensorSpy, _device_tensors, captured_form

    from treeflash_runtime.engine import Request

    pair = load("qwen3")
    engine = engine_for(pair, mode)
    runner = engine.runner
    captured, lines = captured_form(runner), []
    runner.log = lines.append
    runner.capture_all()  # what a CUDA runner with a deployment tree does at start-up
    assert set(runner.graphs) == {("prefill", 1), ("prefill", 2)} | {
        ("round", b, runner.deployment[b], kind, False, None) for b in (1, 2, 3) for kind in (GREEDY, SAMPLE, NUCLEUS)}
    assert lines[0] == "capturing CUDA graphs 1/11" and lines[-1].startswith("captured 11 CUDA graphs in")
    at_start = len(captured)
    prompts = prompts_of(pair)
    requests = [Request(ids, SamplingConfig(max_new_tokens=n, stop_token_ids=())) for ids, n in zip(prompts, BUDGETS)]
    engine.run(requests)
    for r, ids, n in zip(requests, prompts, BUDGETS):
        assert r.tokens == hf_greedy(pair.verifier, ids, n), (mode, ids)
    assert len(captured) == at_start == len(runner.graphs)  # serving captured nothing more
    known = _device_tensors(runner)
    args = (torch.zeros(2, 8, dtype=torch.long), torch.arange(2), torch.tensor([3, 8]), torch.tensor([False, True]))
    with torch.inference_mode(), HostTensorSpy(known + list(args)) as spy:  # args: a replay's static inputs
        runner.stages.run(3, runner.deployment[3], NUCLEUS)
        runner._prefill_pass(*args)
    assert spy.host_made == []


def test_slot_caches_that_do_not_fit_are_one_line_naming_max_batch(load):
    from treeflash_export.errors import ConfigError
    from treeflash_runtime.backends.pytorch import TorchRunner

    pair = load("qwen3")
    with pytest.raises(ConfigError, match=r"caches for --max-seq-len 100000000 x --max-batch 64 need [\d.]+ GiB .* "
                                          r"is free on cpu: lower --max-seq-len or --max-batch"):
        TorchRunner(pair.verifier, pair.drafter, max_batch=64, capacity=10**8, tree=TreeConfig(tree_size=8))


def test_random_weights_bench_times_rounds_by_batch_size():
    from treeflash_runtime.bench.random_weights import format_random_report, run_random_bench

    rep = run_random_bench("tiny", modes=["treeflash"], tree_sizes=[8], prompt_lengths=[16], rounds=2, warmup=1,
                           top_m=2, top_k=2, tokens_per_round=2.0, device="cpu", dtype="auto", cuda_graphs=True,
                           stages=False, batch_sizes=(1, 3))
    assert [(r["batch"], r["mode"], r["tree_size"], r["nodes"]) for r in rep["batch_rows"]] == [
        (1, "ar", 1, 1), (3, "ar", 1, 3), (1, "treeflash", 8, 8), (3, "treeflash", 8, 24)]
    assert all(r["ms_per_round"] > 0 for r in rep["batch_rows"]) and not rep["failed"]
    assert "request slots (in-flight batching)" in format_random_report(rep)


@pytest.mark.parametrize("mode", ["treeflash", "marginal"])
def test_the_expansion_stops_at_the_deepest_node_a_tree_can_hold(load, mode):
    """A tree of n nodes (the root among them) is at most n - 1 deep, so a round expands only the
    drafter's first n block positions: the trees built from those tables equal the trees built from the
    whole block's, node for node, in both slots, and so do the smaller trees of the same tables."""
    from treeflash_runtime.backends.pytorch import TorchRunner, expansion_depth
    from treeflash_runtime.backends.pytorch.stages import _fields

    pair = load("qwen3")
    runner = TorchRunner(pair.verifier, pair.drafter, max_batch=2, capacity=96,
                         tree=TreeConfig(mode=mode, tree_size=16, top_m=3, top_k=3))
    B = runner.block_size
    with torch.inference_mode():
        for slot, ids in enumerate(prompts_of(pair)[:2]):
            runner.admit(slot, SamplingConfig())
            runner.prefill_many([(slot, torch.tensor(ids), True)])
        z = runner.stages.draft(2, 0)
        root = runner.state.root[:2]
        checked = 0
        for n in (2, 3, B // 2, B - 1, B + 4):
            tree = TreeConfig(mode=mode, tree_size=n, top_m=3, top_k=3)
            depth = expansion_depth(tree, B)
            assert depth == min(B, n)
            full = runner.stages.expand(2, root, z, tree)
            cut = runner.stages.expand(2, root, z[:, :depth], tree)
            assert cut.tokens.shape[1] == depth - 1  # one row per depth
            for size in sorted({2, n // 2, n} - {0, 1}):
                build = runner.stages.build_tree
                want, got = _fields(build(full, root, size)), _fields(build(cut, root, size))
                for a, b in zip(want, got):
                    assert torch.equal(a, b), (n, size)
                checked += 1
        assert checked >= 8


def test_captured_plain_steps_keep_each_slots_context_lazily(load):
    """Three slots in the CUDA form (graphs on, B pending rows): plain steps with the drafter's context
    append each slot's features, the drafter runs when the rows may be full, and tree rounds in
    between leave each slot a different pending count. Each slot's tokens still equal its own greedy
    decoding, and both plain-step graphs (append, flush) were captured."""
    from conftest import hf_greedy
    from test_device_round import captured_form

    from treeflash_runtime.backends.pytorch import TorchRunner
    from treeflash_runtime.plan import RoundPlan

    pair = load("qwen3")
    tree = TreeConfig(mode="treeflash", tree_size=8, top_m=2, top_k=4)
    runner = TorchRunner(pair.verifier, pair.drafter, max_batch=3, capacity=128, tree=tree)
    captured_form(runner)
    B = runner.block_size
    runner.state.pending = runner.state.pending[:, :B].clone()  # the CUDA form's B rows
    prompts = prompts_of(pair)[:3]
    outs = []
    for slot, ids in enumerate(prompts):
        runner.admit(slot, SamplingConfig())
        outs.append([runner.prefill(slot, torch.tensor(ids), last=True)])
    plain = TreeConfig(mode="ar")
    schedule = [plain] * (B + 2) + [tree] * 2 + [plain] * 5 + [tree] * 3 + [plain] * (2 * B) + [tree] * 40
    for t in schedule:
        if min(len(o) for o in outs) >= 36:
            break
        for o, gained in zip(outs, runner.step(RoundPlan(tree=t.resolved(B), keep_context=True)).gained):
            o += gained
    for o, ids in zip(outs, prompts):
        assert o[:36] == hf_greedy(pair.verifier, ids, 36)
    plain_keys = {k for k in runner.graphs if k[0] == "round" and k[2].mode == "ar"}
    assert {k[5] for k in plain_keys} == {"append", "flush"}, plain_keys
