"""The self-tuning tree in the generation loop: whatever it picks round by round, greedy output is the
verifier's own; it falls back to plain decoding when the cost model says drafting cannot pay, keeps
explicit values, and reads its costs from the keyed cache once measured. (The policy alone, on
synthetic processes: tests/runtime/test_tuner.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import PROMPTS, hf_greedy
from oracle import OracleRunner
from treeflash_runtime import generate
from treeflash_runtime.backends.pytorch import TorchRunner
from treeflash_runtime.tuner.cache import CostCache
from treeflash_runtime.tuner.cost import BucketCosts, CostModel
from treeflash_runtime.tuner.online import TreeTuner, cost_key

from treeflash_export.config import SamplingConfig, TreeConfig


def costs(ar: float, tree_part: float) -> CostModel:
    """A cost model by hand: a plain step of `ar` ms, and every part of a round `tree_part` ms."""
    pts = {4: tree_part, 16: tree_part, 64: tree_part}
    return CostModel({1: BucketCosts(ar=ar, draft=tree_part, verify=pts, tree=pts,
                                     expand={(1, 16): tree_part, (4, 16): tree_part, (16, 16): tree_part,
                                             "chain": tree_part})})


def tuner_for(runner, sources, tmp_path, model: CostModel | None, fixed=None, log=None) -> TreeTuner:
    cache = CostCache(tmp_path / "costs")
    if model is not None:
        cache.save(cost_key(runner, sources, "float32"), model)
    return TreeTuner.for_runner(runner, fixed or {}, sources=sources, dtype="float32", cache=cache, log=log)


def _sources(pair_dirs, name="qwen3"):
    return (str(pair_dirs[name] / "verifier"), str(pair_dirs[name] / "drafter"))


def serve_five(engine, pair, budgets) -> list[tuple]:
    """Five requests (test_slots.prompts_of) through the engine, with these new-token budgets (the slots
    fill, then requests join as others leave) -> (request, prompt ids, budget) for each."""
    from test_slots import prompts_of

    from treeflash_runtime.engine import Request

    prompts = prompts_of(pair)
    requests = [Request(ids, SamplingConfig(max_new_tokens=n)) for ids, n in zip(prompts, budgets)]
    engine.run(requests)
    return list(zip(requests, prompts, budgets))


def test_the_expansions_head_dtype_keys_the_cost_cache(load, pair_dirs):
    """A bf16 expansion head costs less than an fp32 one: a model measured with one is not read back
    for the other."""
    from treeflash_runtime.backends.pytorch import TorchRunner

    pair, sources = load("qwen3"), _sources(pair_dirs)
    keys = [cost_key(TorchRunner(pair.verifier, pair.drafter, capacity=64, draft_head=d), sources, "float32")
            for d in (torch.bfloat16, torch.float32, torch.bfloat16)]
    assert keys[0] == keys[2] and keys[0] != keys[1] and "draft_head=bfloat16" in keys[0].options


@pytest.mark.parametrize("fixed", [{}, {"mode": "marginal"}, {"mode": "treeflash", "tree_size": 8}],
                         ids=["all-auto", "marginal", "treeflash-N8"])
def test_tuned_rounds_are_exact(load, pair_dirs, tmp_path, fixed):
    """Cheap trees (a cost model by hand): the tuner explores each family's largest tree, then chooses
    among many settings round by round, plain decoding among them; an oracle drafter makes rounds
    accept deep paths. Greedy output equals transformers' own throughout."""
    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[0])["input_ids"]
    want = hf_greedy(pair.verifier, ids, 48)
    runner = OracleRunner(pair.verifier, pair.drafter, capacity=256, truth=ids + want, seed=1)
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, costs(ar=10.0, tree_part=1.0), fixed)
    res = generate(runner, ids, TreeConfig(), SamplingConfig(max_new_tokens=48), tuner=tuner)
    assert res.token_ids == want
    used = res.stats.tuning["settings_used"]
    assert sum(used.values()) == res.stats.rounds  # the first round runs the setting begin() prepared
    assert len(used) >= 2 and max(res.stats.accept_lengths) >= 3, used
    for label in used:
        if fixed.get("mode"):
            assert label.startswith(fixed["mode"]), label
        if "tree_size" in fixed:
            assert f"N={fixed['tree_size']} " in label, label


def test_falls_back_to_plain_decoding_when_drafting_cannot_pay(load, pair_dirs, tmp_path):
    """Plain steps of 1 ms and rounds of 500 ms: no tree can pay, so every round is plain decoding (the
    drafter keeps its context current all the same), and the output is the verifier's."""
    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[1])["input_ids"]
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=256)
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, costs(ar=1.0, tree_part=100.0))
    res = generate(runner, ids, TreeConfig(), SamplingConfig(max_new_tokens=24), tuner=tuner)
    assert res.token_ids == hf_greedy(pair.verifier, ids, 24)
    assert set(res.stats.tuning["settings_used"]) == {"ar"} and res.stats.tuning["choices"]["1"]["mode"] == "ar"
    assert runner.occupied == 0  # the generation's slot is free again


def test_costs_are_measured_once_then_read_from_the_cache(load, pair_dirs, tmp_path):
    pair = load("qwen3")
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=256)
    lines: list[str] = []
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, None, log=lines.append)
    assert not lines  # measured when an engine starts, not before
    tuner.start()
    measured = [line for line in lines if line.startswith("tuning: measuring")]
    assert measured and measured[-1].startswith("tuning: measuring a full round")
    lines.clear()
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, None, log=lines.append)
    tuner.start()
    assert not [line for line in lines if line.startswith("tuning: measuring")]
    c = tuner.auto.cost.buckets[1]
    assert c.ar > 0 and c.draft > 0 and set(c.verify) == {4, 8, 16, 32, 64}
    assert c.expand["marginal"] > 0 and c.expand["chain"] > 0


def test_a_tuned_generation_after_a_plain_one_measures_its_costs_on_the_same_runner(load, pair_dirs, tmp_path):
    """A generation frees its slot when it ends: a tuned generation that follows a plain one on the
    same runner, with no costs cached yet, measures them there (the probe takes the slot over) over
    the whole grid, and gives the verifier's output. Before, the finished generation still held the
    slot and the probe stopped with an internal error; past that, the grid followed the last
    generation's tree (1 node) and the measurement failed."""
    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[2])["input_ids"]
    want = hf_greedy(pair.verifier, ids, 16)
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=256)
    assert generate(runner, ids, TreeConfig(mode="ar"), SamplingConfig(max_new_tokens=16)).token_ids == want
    assert not bool(runner.state.active.any())
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, None)  # nothing cached: measured at first use
    assert generate(runner, ids, TreeConfig(), SamplingConfig(max_new_tokens=16), tuner=tuner).token_ids == want
    # The grid is the one-sequence runner's own (up to 64 nodes), not the last generation's 1-node tree.
    assert set(tuner.auto.cost.buckets[1].verify) == {4, 8, 16, 32, 64}
    assert max(s.tree_size for s in tuner.auto.candidates) == 64


def test_treeflash_run_with_auto_settings(pair_dirs, tmp_path, monkeypatch):
    """treeflash-run --tree-size auto: the JSON names the settings run and the tuner's choice, the tokens
    equal plain decoding's; auto settings are refused where they cannot apply."""
    from treeflash_runtime.cli import main

    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path / "cache"))
    d = pair_dirs["qwen3"]
    base = ["--model", str(d / "verifier"), "--drafter", str(d / "drafter"), "--prompt", PROMPTS[0],
            "--max-new-tokens", "20", "--ignore-eos", "--json"]
    plain = json.loads(CliRunner().invoke(main, base + ["--mode", "ar"]).stdout)
    r = CliRunner().invoke(main, base + ["--tree-size", "auto", "--top-m", "auto"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["token_ids"] == plain["token_ids"] and out["mode"] == "auto"
    assert sum(out["tuning"]["settings_used"].values()) == out["rounds"] and "1" in out["tuning"]["cost_ms"]
    r = CliRunner().invoke(main, ["--artifacts", str(tmp_path), "--tree-size", "auto", "--prompt", "x"])
    assert r.exit_code != 0 and "an artifact keeps its manifest's tree settings" in r.output


@pytest.mark.parametrize("name", ["qwen3", "qwen3-dflash"])
def test_the_engine_tunes_per_bucket_and_stays_exact(load, pair_dirs, tmp_path, name):
    """Request slots with the self-tuning tree (cheap trees by hand, an oracle-free real drafter):
    five requests through three slots, joining as others leave; each equals its own greedy decoding,
    the tuner chose per batch bucket, and a DFlash drafter (no head) gets no TreeFlash setting."""
    from treeflash_runtime.engine import Engine, Request

    pair = load(name)
    runner = TorchRunner(pair.verifier, pair.drafter, max_batch=3, capacity=128,
                         tree=TreeConfig(mode="treeflash" if pair.drafter.ar_approximation is not None else "marginal",
                                         tree_size=16, top_m=4, top_k=8))
    cheap = CostModel({b: costs(ar=10.0, tree_part=1.0).buckets[1] for b in runner.buckets})
    tuner = tuner_for(runner, _sources(pair_dirs, name), tmp_path, cheap)
    engine = Engine(runner, prefill_chunk=4, policy=tuner)
    served = serve_five(engine, pair, [12, 5, 9, 16, 7])
    for r, ids, n in served:
        assert r.tokens == hf_greedy(pair.verifier, ids, n)
    prompts = [ids for _, ids, _ in served]
    report = tuner.report()
    assert len(report["choices"]) >= 2  # several buckets chose
    assert all(int(b) in runner.buckets for b in report["choices"])
    assert max(s.tree_size for s in tuner.auto.candidates) <= 16  # within the deployment's tree
    if name == "qwen3-dflash":
        assert not any(s.mode == "treeflash" for s in tuner.used)
    assert runner.occupied == 0  # every slot free once the engine is done
    # The same engine serves another batch: the tuner is served again, and keeps learning.
    learnt = tuner.auto.acceptance.rounds
    again = [Request(ids, SamplingConfig(max_new_tokens=8)) for ids in prompts[:3]]
    engine.run(again)
    assert [r.tokens for r in again] == [hf_greedy(pair.verifier, ids, 8) for ids in prompts[:3]]
    assert tuner.auto.acceptance.rounds > learnt
    assert (tmp_path / "acceptance").is_dir() and list((tmp_path / "acceptance").iterdir())  # what it learnt is kept


def test_plain_decoding_by_far_skips_the_drafters_context_until_those_requests_leave(load, pair_dirs, tmp_path):
    """Request slots, trees dear (each part of a round dearer than a plain step): after the seed
    rounds plain decoding wins by far, so its steps skip the drafter's context and the tuner is asked
    once in HOLD rounds. When trees turn cheap, the requests that ran without context still decode
    plainly (their drafter context has gaps) until they leave; a request that arrived later then runs
    trees. Every request equals its own greedy decoding."""
    from treeflash_runtime.engine import Engine, Request
    from treeflash_runtime.tuner.online import HOLD

    pair = load("qwen3")
    runner = TorchRunner(pair.verifier, pair.drafter, max_batch=2, capacity=128,
                         tree=TreeConfig(mode="treeflash", tree_size=16, top_m=4, top_k=8))
    # Each part of a round as dear as 1.5 plain steps: the chain at 45 ms, a tree at 60, against 10 (at
    # half a step each the chain, at 15 ms, came within 75% of plain decoding in one run of the suite).
    dear = CostModel({b: costs(ar=10.0, tree_part=15.0).buckets[1] for b in runner.buckets})
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, dear)
    engine = Engine(runner, prefill_chunk=8, policy=tuner)
    asked, rounds = [], []
    plan, setting = tuner.plan, tuner.auto.setting
    tuner.auto.setting = lambda *a, **k: asked.append(1) or setting(*a, **k)

    def logged(bucket=1, requests=None):
        p = plan(bucket, requests)
        rounds.append((set(requests or ()), p.tree.mode, p.keep_context))
        return p

    tuner.plan = logged
    prompts = [pair.tokenizer(t)["input_ids"] for t in PROMPTS[:2] + ["Once upon a time"]]
    first = [Request(prompts[0], SamplingConfig(max_new_tokens=40)), Request(prompts[1], SamplingConfig(max_new_tokens=48))]
    for r in first:
        engine.submit(r)
    while len(rounds) < 2 * HOLD + 4:
        assert engine.step() and not any(r.done for r in first)
    early = len(rounds)
    skipped = [r for r in rounds if not r[2]]
    assert skipped and all(mode == "ar" for _, mode, _ in skipped), rounds
    assert len(asked) < early - HOLD // 2  # held rounds are not asked
    tuner.auto.cost.model = CostModel({b: costs(ar=10.0, tree_part=0.5).buckets[1] for b in runner.buckets})
    tuner.auto._memo.clear()
    later = Request(prompts[2], SamplingConfig(max_new_tokens=40))
    engine.submit(later)
    engine.drain(first + [later])
    marked = {id(r) for r in first}
    assert all(mode == "ar" for keys, mode, _ in rounds[early:] if keys & marked)
    assert tuner.held_for_context > 0
    assert any(mode != "ar" for keys, mode, _ in rounds[early:] if keys == {id(later)})
    for r, ids in zip(first + [later], prompts):
        assert r.tokens == hf_greedy(pair.verifier, ids, r.sampling.max_new_tokens)
    engine.close()
    report = tuner.report()
    assert report["plain_rounds_without_context"] >= len(skipped) and report["tree_rounds_held_for_context"] > 0


def test_defaults_are_auto_and_a_second_process_starts_calibrated(pair_dirs, tmp_path, monkeypatch):
    """treeflash-run with no tree flag tunes (mode auto in the JSON); the next run reads the acceptance
    model the first one saved; --retune starts afresh; explicit values are used as given."""
    from treeflash_runtime.cli import main

    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path / "cache"))
    d = pair_dirs["qwen3"]
    base = ["--model", str(d / "verifier"), "--drafter", str(d / "drafter"), "--prompt", PROMPTS[0],
            "--max-new-tokens", "16", "--ignore-eos", "--json"]
    plain = json.loads(CliRunner().invoke(main, base + ["--mode", "ar"]).stdout)["token_ids"]
    first = CliRunner().invoke(main, base)
    assert first.exit_code == 0, first.output
    out = json.loads(first.stdout)
    assert out["mode"] == "auto" and out["token_ids"] == plain and not out["tuning"]["resumed_acceptance"]
    again = json.loads(CliRunner().invoke(main, base).stdout)
    assert again["tuning"]["resumed_acceptance"] and again["token_ids"] == plain
    fresh = json.loads(CliRunner().invoke(main, base + ["--retune"]).stdout)
    assert not fresh["tuning"]["resumed_acceptance"]
    fixed = json.loads(CliRunner().invoke(main, base + ["--mode", "treeflash", "--tree-size", "8", "--top-m", "2",
                                                        "--top-k", "4"]).stdout)
    assert fixed["mode"] == "treeflash" and "tuning" not in fixed or fixed.get("tuning") is None


def test_bench_sweep_times_the_grid_beside_auto_and_plots(pair_dirs, tmp_path, monkeypatch):
    from treeflash_runtime.bench.cli import main

    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path / "cache"))
    d = pair_dirs["qwen3"]
    png = tmp_path / "sweep.png"
    r = CliRunner().invoke(main, ["--model", str(d / "verifier"), "--drafter", str(d / "drafter"), "--prompt",
                                  PROMPTS[0], "--max-new-tokens", "12", "--ignore-eos", "--sweep", "--sweep-sizes",
                                  "4,8", "--sweep-top-m", "1,2", "--sweep-top-k", "4", "--plot", str(png), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    settings = [row["setting"] for row in rep["rows"]]
    assert settings[0] == "auto" and settings[-1] == "ar" and "chain" in settings
    assert {"treeflash N=4 M=1 K=4", "treeflash N=8 M=2 K=4", "marginal N=8 K=4"} <= set(settings)
    assert len(settings) == 1 + 4 + 2 + 1 + 1 and rep["identical_outputs"]
    sw = rep["sweep"]
    best = max((row for row in rep["rows"] if row["mode"] != "auto"), key=lambda row: row["tokens_per_s"])
    assert sw["best"] == best["setting"] and sw["auto_vs_best"] == pytest.approx(
        rep["rows"][0]["tokens_per_s"] / best["tokens_per_s"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_runs_every_row_in_turn_prompt_by_prompt(pair_dirs, tmp_path, monkeypatch):
    """After one warm-up per row, each prompt runs every row (auto, the fixed tree, plain decoding)
    before the next prompt: the machine's drift falls on all rows alike and each prompt's ratio
    compares runs close in time."""
    import treeflash_runtime.loop as loop
    from treeflash_runtime.bench.cli import main

    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path / "cache"))
    calls, generate = [], loop.generate

    def recording(runner, prompt_ids, tree, sampling, on_tokens=None, tuner=None):
        calls.append((len(prompt_ids), "auto" if tuner is not None else tree.mode))
        return generate(runner, prompt_ids, tree, sampling, on_tokens, tuner)

    monkeypatch.setattr(loop, "generate", recording)
    d = pair_dirs["qwen3"]
    r = CliRunner().invoke(main, ["--model", str(d / "verifier"), "--drafter", str(d / "drafter"), "--prompt",
                                  PROMPTS[0], "--prompt", PROMPTS[0] + " and more words here", "--max-new-tokens",
                                  "6", "--ignore-eos", "--modes", "auto,treeflash", "--tree-sizes", "4",
                                  "--repeat", "2", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    settings = [row["setting"] for row in rep["rows"]]
    assert len(settings) == 3 and settings[0] == "auto" and settings[1].startswith("treeflash N=4 ") \
        and settings[2] == "ar"
    modes = ["auto", "treeflash", "ar"]
    assert [m for _, m in calls[:3]] == modes  # the warm-ups
    timed = calls[3:]
    assert len(timed) == 2 * 2 * 3 and [m for _, m in timed] == modes * 4
    lengths = [n for n, _ in timed]
    assert lengths[:3] == [lengths[0]] * 3 and lengths[3:6] == [lengths[3]] * 3 and lengths[0] != lengths[3]
    assert lengths[6:] == lengths[:6]  # the second run of both prompts
    assert rep["identical_outputs"] and all(len(row["per_prompt_tokens_per_s"]) == 2 for row in rep["rows"])


def test_with_graphs_the_probe_times_a_replay_of_each_part(load):
    """On CUDA the rounds that serve are graph replays, so the probe captures each part once and times
    its replays (an eager stand-in for the capture here, as the CPU tests of the captured round do):
    one capture per part and parameters, none of them made inside another, the state put back."""
    from test_device_round import captured_form
    from treeflash_runtime.tuner.cost import default_grid, measure

    pair = load("qwen3")
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=256)
    captured = captured_form(runner)
    grid = default_grid(("ar", "chain", "marginal", "treeflash"), runner.block_size, 16)
    with runner.probing(1, 32) as probe:
        before = runner.state.past_len.clone()
        model = measure(probe, [1], grid, repeats=2, part_budget_s=10.0)
        assert torch.equal(runner.state.past_len, before)
        parts = [k for k in probe.memo if isinstance(k, tuple) and k[0] == "probe"]
        probes = [f for f in captured if getattr(f, "__name__", "") == "<lambda>"]  # not the prefill passes
        assert len(probes) == len(parts) == len(set(parts))  # one capture per (part, parameters)
        assert {"z", "tables"} <= set(probe.memo)  # made eagerly, outside every capture
    c = model.buckets[1]
    assert c.ar > 0 and set(c.verify) == set(grid.verify_nodes) and c.expand["chain"] > 0


def test_with_graphs_exploration_rounds_run_eagerly_and_only_choices_are_captured(load, pair_dirs, tmp_path):
    """On a GPU a capture costs tens of rounds (far more where its kernels compile first), and the
    tuner tries many settings once or a few times. So with graphs on, a round whose graph is not
    captured yet runs eagerly when it is an exploration round, and is not timed as the setting's (an
    eager round is not the replay the cost model predicts) but as what exploring costs; the choices
    are captured and replayed. Output stays exact."""
    from test_device_round import captured_form

    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[0])["input_ids"]
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=256)
    captured = captured_form(runner)
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, costs(ar=10.0, tree_part=1.0))
    assert tuner.captures
    rounds, timed = [], []
    step, observe_time = runner.step, tuner.auto.observe_time

    def spy_step(plan):
        before = len(captured)
        report = step(plan)
        exploring = tuner.auto.exploring and tuner.auto.explore_reason != "confirm"  # a confirming tree recurs
        rounds.append((exploring, report.eager, len(captured) > before, plan.tree))
        return report

    def spy_time(s, bucket, ms):
        timed.append(len(rounds))
        observe_time(s, bucket, ms)

    runner.step, tuner.auto.observe_time = spy_step, spy_time
    res = generate(runner, ids, TreeConfig(), SamplingConfig(max_new_tokens=40), tuner=tuner)
    assert res.token_ids == hf_greedy(pair.verifier, ids, 40)
    assert any(eager for _, eager, _, _ in rounds)  # the seeds at least
    assert all(exploring for exploring, eager, _, _ in rounds if eager)
    assert not any(new for exploring, _, new, _ in rounds if exploring)  # no capture for an exploration
    assert any(new for _, _, new, _ in rounds)  # the choice is captured
    eager_rounds = {i + 1 for i, (_, eager, _, _) in enumerate(rounds) if eager}
    capturing = {i + 1 for i, (_, _, new, _) in enumerate(rounds) if new}
    assert timed and not eager_rounds & set(timed) and not capturing & set(timed)  # neither is a replay
    assert tuner.auto.outside_ms[1] > 0  # what those rounds took: the budget of later refreshes


def test_a_round_reports_a_tree_twice_its_size_and_labels_only_what_it_verified(load, monkeypatch):
    """With the self-tuning tree observing, a round at N = 8 reports the 16-node tree of the same tables:
    its best 7 nodes are the verified tree's (same scores, same labels from verification, the rest
    unlabelled), so the acceptance model sees the next size up without running it."""
    import numpy as np
    from treeflash_runtime.backends.pytorch import runner as runner_module
    from treeflash_runtime.backends.pytorch import stages
    from treeflash_runtime.plan import RoundPlan
    from treeflash_runtime.tuner.online import observation
    from treeflash_runtime.tuner.setting import Setting

    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[0])["input_ids"]
    want = hf_greedy(pair.verifier, ids, 24)
    tree = TreeConfig(mode="treeflash", tree_size=8, top_m=2, top_k=4)
    real = stages.observed_size

    def one_round(observed_size):
        for module in (stages, runner_module):  # where the round builds the reported tree and reads it back
            monkeypatch.setattr(module, "observed_size", observed_size)
        runner = OracleRunner(pair.verifier, pair.drafter, capacity=256, truth=ids + want, seed=5)
        t = tree.resolved(runner.block_size)
        runner.begin(torch.tensor(ids), t, SamplingConfig())
        report = runner.step(RoundPlan(tree=t, report_nodes=True))
        raw = report.nodes[0]
        return observation(Setting(t.mode, t.tree_size, t.top_m, t.top_k), raw), raw, report.gained[0]

    small, _, gained = one_round(lambda t: t.tree_size)
    big, raw, gained_big = one_round(real)
    assert gained_big == gained and len(gained) >= 3  # the oracle's path: accepted drafts plus the bonus
    assert raw.verified == 7 and len(raw.scores) == 15 and len(big.scores) == 15
    np.testing.assert_allclose(big.scores[:7], small.scores)
    assert big.accepted.tolist() == small.accepted.tolist() and int(small.accepted.sum()) == len(gained) - 1
    assert stages.observed_size(TreeConfig(mode="chain", tree_size=8)) == 8
    assert stages.observed_size(TreeConfig(tree_size=48)) == 64


def test_plain_decoding_probes_the_best_tree_and_labels_it_in_hindsight(load, pair_dirs, tmp_path):
    """Trees that could pay but are predicted slower (a random drafter): plain decoding runs, and after
    some plain steps the best tree is drafted and scored without being verified; the tokens committed
    next label it. The output is the verifier's all the same, and the probe is off after the generation."""
    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[2])["input_ids"]
    want = hf_greedy(pair.verifier, ids, 40)
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=256)
    model = costs(ar=10.0, tree_part=6.0)
    model.buckets[1].expand["chain"] = 1000.0  # the chain cannot pay: the best tree is one to probe
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, model)
    labelled = []
    real = tuner._label_probes

    gains, from_probes = [], []

    def spy(tokens, request=None):
        waiting, taught = len(tuner._waiting), len(gains)
        real(tokens, request)
        labelled.append(waiting - len(tuner._waiting))
        from_probes.append(len(gains) - taught)

    tuner._label_probes = spy
    real_gain = tuner.auto.acceptance.observe_gain
    tuner.auto.acceptance.observe_gain = lambda predicted, gained: gains.append((predicted, gained)) or \
        real_gain(predicted, gained)
    res = generate(runner, ids, TreeConfig(), SamplingConfig(max_new_tokens=40), tuner=tuner)
    assert res.token_ids == want
    assert res.stats.tuning["settings_used"].get("ar", 0) >= 30
    assert sum(labelled) >= 3  # the probes after plain steps 2, 4, 8 and 16 at least, once labelled
    assert not tuner._waiting
    # Each labelled probe taught the realised factor what its tree would have gained, against its
    # unscaled prediction (plain decoding ran: no chosen tree would have).
    assert sum(from_probes) == sum(labelled)
    assert all(p >= 1.0 and 1.0 <= g <= 64 for p, g in gains), gains


def test_tree_rounds_probe_the_other_family_and_its_labels_stay_with_the_request(load, pair_dirs, tmp_path):
    """While a tree runs, some rounds also score the best tree of the other family (TreeFlash beside
    the marginal tree and the reverse) from the round's own drafter pass; this round's tokens and the
    next label it in hindsight, for the request's own calibration only. Output stays the verifier's."""
    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[0])["input_ids"]
    want = hf_greedy(pair.verifier, ids, 128)
    runner = OracleRunner(pair.verifier, pair.drafter, capacity=256, truth=ids + want, seed=1)
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, costs(ar=10.0, tree_part=1.0))
    probes, calls = [], []
    real_due, real_observe = tuner._probe_due, tuner.auto.acceptance.observe

    def due(s, bucket, stream):
        p = real_due(s, bucket, stream)
        if p is not None and s.mode != "ar":
            probes.append((s.mode, p.mode))
        return p

    def observe(obs, stream=None, deployment=True):
        calls.append(deployment)
        return real_observe(obs, stream, deployment)

    tuner._probe_due, tuner.auto.acceptance.observe = due, observe
    res = generate(runner, ids, TreeConfig(), SamplingConfig(max_new_tokens=128), tuner=tuner)
    assert res.token_ids == want
    assert len(probes) >= 2, probes  # after the 2nd and 4th tree rounds of the choice at least
    assert all((a == "treeflash") != (b == "treeflash") for a, b in probes), probes
    assert calls.count(False) >= 2  # labelled probes, kept from the deployment's calibration
    assert not tuner._waiting


def test_a_request_alone_in_the_engine_is_probed_as_one_sequence_is(load, pair_dirs, tmp_path):
    """Request slots: while a request runs alone, its rounds get the score probes of one sequence, and
    the tokens it commits label them for its own calibration; while two requests share the rounds no
    probe runs, a request's probes are never labelled by another's tokens, and none waits once the
    requests are gone. Every request equals its own greedy decoding."""
    from test_slots import prompts_of

    from treeflash_runtime.engine import Engine, Request

    pair = load("qwen3")
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=256, max_batch=2,
                         tree=TreeConfig(mode="treeflash", tree_size=16, top_m=4, top_k=8))
    model = CostModel({b: costs(ar=10.0, tree_part=3.0).buckets[1] for b in runner.buckets})
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, model)
    probed, labelled = [], []
    real_plan, real_observe = tuner.plan, tuner.auto.acceptance.observe

    def plan(bucket=1, requests=None):
        p = real_plan(bucket, requests)
        if p.probe is not None:
            probed.append(tuple(requests))
        return p

    def observe(obs, stream=None, deployment=True):
        if not deployment:
            labelled.append(stream)
        return real_observe(obs, stream, deployment)

    tuner.plan, tuner.auto.acceptance.observe = plan, observe
    engine = Engine(runner, prefill_chunk=8, policy=tuner)
    prompts = prompts_of(pair)
    alone = Request(prompts[2], SamplingConfig(max_new_tokens=40))
    engine.run([alone])
    assert alone.tokens == hf_greedy(pair.verifier, prompts[2], 40)
    assert len(probed) >= 3 and {len(k) for k in probed} == {1}
    assert len(labelled) >= 2 and all(s is not None for s in labelled)  # the request's own stream
    probed.clear()
    two = [Request(prompts[i], SamplingConfig(max_new_tokens=n)) for i, n in ((0, 48), (1, 12))]
    engine.run(two)
    for r, i, n in zip(two, (0, 1), (48, 12)):
        assert r.tokens == hf_greedy(pair.verifier, prompts[i], n)
    assert probed and all(k == (id(two[0]),) for k in probed)  # only once the shorter one had left
    assert not tuner._waiting


def test_a_waiting_probe_is_labelled_by_its_own_requests_tokens_only(pair_dirs, tmp_path):
    """The engine's probes wait keyed by request: another request's tokens leave them as they are, and
    a request that leaves takes its waiting probes with it."""
    from treeflash_runtime.tuner.acceptance import AcceptanceModel, RequestStream
    from treeflash_runtime.tuner.auto import AutoTuner
    from treeflash_runtime.plan import NodeReport
    from treeflash_runtime.tuner.online import WaitingProbe
    from treeflash_runtime.tuner.setting import Setting

    tuner = TreeTuner(AutoTuner(costs(ar=10.0, tree_part=1.0), AcceptanceModel(), [Setting("marginal", 4, 1, 4)], 8))
    # a chain of two nodes: labelled once two tokens are known
    raw = NodeReport(scores=[-0.1, -0.2], m_rank=[0, 0], k_rank=[0, 0], accepted=[0.0, 0.0], verified=0,
                     tokens=[5, 6], parents=[0, 1])
    for key in ("a", "b"):
        tuner._waiting.append(WaitingProbe(Setting("marginal", 4, 1, 4), raw, [], None, key, RequestStream()))
    tuner._label_probes([5], "b")
    assert [w.got for w in tuner._waiting] == [[], [5]]
    tuner.retired("b")
    assert [w.request for w in tuner._waiting] == ["a"]
    tuner._label_probes([7, 8], "c")
    assert [w.got for w in tuner._waiting] == [[]]


def test_a_recorded_generation_replays_to_the_predictions_it_ran_on(load, pair_dirs, tmp_path, capsys):
    """A tuned generation recorded (tuner.replay) and replayed through a fresh acceptance model gives,
    for every tree round it could predict, exactly the unscaled prediction the live tuner had before
    that round, and the tokens the round gained; the file round-trips and the summary reads it."""
    from treeflash_runtime.tuner.acceptance import AcceptanceModel
    from treeflash_runtime.tuner.replay import Recording, main, replay, summary

    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[0])["input_ids"]
    want = hf_greedy(pair.verifier, ids, 96)
    runner = OracleRunner(pair.verifier, pair.drafter, capacity=256, truth=ids + want, seed=1)
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, costs(ar=10.0, tree_part=1.0))
    recording = Recording().attach(tuner)
    live, real_plan, real_learn = [], tuner.plan, tuner.learn

    def plan(*a, **k):
        p = real_plan(*a, **k)
        s = tuner.current
        if s.mode != "ar":
            live.append([tuner.auto.acceptance.expected(s, tuner.stream, runner.block_size, raw=True),
                         tuner.auto.explore_reason, None])
        return p

    def learn(report, running=None):
        if tuner.current.mode != "ar":
            live[-1][2] = len(report.gained[0])
        return real_learn(report, running)

    tuner.plan, tuner.learn = plan, learn
    recording.request("the prompt")
    res = generate(runner, ids, TreeConfig(), SamplingConfig(max_new_tokens=96), tuner=tuner)
    assert res.token_ids == want
    path = recording.save(tmp_path / "rounds.json")
    rows = replay(Recording.load(path), AcceptanceModel())
    expect = [(p, reason, g) for p, reason, g in live if p is not None]
    assert len(expect) >= 10 and any(reason is None for _, reason, _ in expect)  # the choice ran trees
    assert [(r.predicted, r.reason, r.gained) for r in rows] == expect
    assert {r.label for r in rows} == {"the prompt"}
    chosen = [r for r in rows if r.reason in (None, "confirm", "refresh")]
    s = summary(rows)
    assert s["rounds"] == len(chosen)
    assert s["bias"] == pytest.approx(sum(r.predicted - r.gained for r in chosen) / len(chosen))
    assert main([str(path)]) == 0
    assert f"{len(chosen)} rounds" in capsys.readouterr().out
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="not a recording"):
        Recording.load(tmp_path / "other.json")


def test_bench_records_only_the_one_sequence_rows(tmp_path):
    from treeflash_runtime.bench.cli import main

    out = CliRunner().invoke(main, ["--record", str(tmp_path / "r.json"), "--concurrency", "1,4"])
    assert out.exit_code == 2 and "--record records the one-sequence rows" in out.output
    assert not (tmp_path / "r.json").exists()
