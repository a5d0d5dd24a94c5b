"""The self-tuning tree on real rounds (tiny pairs): exact output whatever it chooses, the prior timed
once and kept, per-bucket choices in the engine, and the CLI and benchmark rows. The rule itself is
tested without a model in test_rule.py, its adapter in test_tuner.py."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import PROMPTS, hf_greedy
from oracle import OracleRunner
from treeflash_runtime import generate
from treeflash_runtime.backends.pytorch import TorchRunner
from treeflash_runtime.bench.cli import plain_against_itself, slowest_prompt_held_out
from treeflash_runtime.plan import RoundPlan
from treeflash_runtime.tuner import PLAIN, TreeTuner, TunerStore
from treeflash_runtime.tuner.online import runner_modes, tuner_key

from treeflash_export.config import SamplingConfig, TreeConfig


@pytest.fixture(autouse=True)
def steady_machine(monkeypatch):
    """The suite shares the CPU with whatever else runs: the prior's check that the machine kept its
    speed while timing (tested with a fake probe in test_tuner.py) would make these tests depend on it."""
    import treeflash_runtime.tuner.prior as prior

    monkeypatch.setattr(prior, "STEADY_DRIFT", float("inf"))


def costs(ar: float, tree: float):
    """A prior by hand: a plain step of `ar` ms, and every tree's round `tree` ms."""
    return lambda s: ar if s == PLAIN else tree


def tuner_for(runner, sources, tmp_path, prior=None, fixed=None, log=None) -> TreeTuner:
    """The tuner for_runner builds, with its store under tmp_path; prior(setting) -> ms: written to the
    store first, so nothing is timed (None: timed on the runner at the first engine start)."""
    store = TunerStore(tmp_path / "tuner")
    if prior is not None:
        probe = TreeTuner.for_runner(runner, fixed or {}, sources=sources, dtype="float32", store=store)
        table = {s.label(): prior(s) for s in probe.rule.arms}
        store.save(tuner_key(runner, sources, "float32"), {str(b): table for b in runner.buckets}, {})
    return TreeTuner.for_runner(runner, fixed or {}, sources=sources, dtype="float32", store=store, log=log)


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


def test_the_expansions_head_dtype_keys_what_is_kept(load, pair_dirs):
    """A bf16 expansion head costs less than an fp32 one: times measured with one are not read back
    for the other."""
    pair, sources = load("qwen3"), _sources(pair_dirs)
    keys = [tuner_key(TorchRunner(pair.verifier, pair.drafter, capacity=64, draft_head=d), sources, "float32")
            for d in (torch.bfloat16, torch.float32, torch.bfloat16)]
    assert keys[0] == keys[2] and keys[0] != keys[1] and "draft_head=bfloat16" in keys[0].options
    assert keys[0].content  # the checkpoints' content: what the gains depend on


@pytest.mark.parametrize("fixed", [{}, {"mode": "marginal"}, {"mode": "treeflash", "tree_size": 8}],
                         ids=["all-auto", "marginal", "treeflash-N8"])
def test_tuned_rounds_are_exact(load, pair_dirs, tmp_path, fixed):
    """Cheap trees (a prior by hand) and an oracle drafter whose rounds accept deep paths: the tuner
    explores and chooses among settings round by round; greedy output equals transformers' own."""
    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[0])["input_ids"]
    want = hf_greedy(pair.verifier, ids, 48)
    runner = OracleRunner(pair.verifier, pair.drafter, capacity=256, truth=ids + want, seed=1)
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, costs(ar=10.0, tree=11.0), fixed)
    res = generate(runner, ids, TreeConfig(), SamplingConfig(max_new_tokens=48), tuner=tuner)
    assert res.token_ids == want
    used = res.stats.tuning["settings_used"]
    assert sum(used.values()) == res.stats.rounds
    # With the mode and N fixed only one setting is left (M and K are the family's): it always runs.
    assert len(used) >= (1 if {"mode", "tree_size"} <= set(fixed) else 2), used
    assert max(res.stats.accept_lengths) >= 3, res.stats.accept_lengths
    for label in used:
        if fixed.get("mode"):
            assert label.startswith(fixed["mode"]), label
        if "tree_size" in fixed:
            assert f"N={fixed['tree_size']} " in label, label


def test_a_generation_starts_one_request_in_the_rule(load, pair_dirs, tmp_path, monkeypatch):
    """generate() is an engine with one request: the rule hears of its start once (as it does of a
    request served alone), so earlier requests' gains weigh the same in both paths."""
    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[1])["input_ids"]
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=256)
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, costs(ar=10.0, tree=11.0))
    starts = []
    start = tuner.rule.new_request
    monkeypatch.setattr(tuner.rule, "new_request", lambda: (starts.append(1), start())[1])
    for n in (1, 2):
        generate(runner, ids, TreeConfig(), SamplingConfig(max_new_tokens=8), tuner=tuner)
        assert len(starts) == n


def test_falls_back_to_plain_decoding_when_drafting_cannot_pay(load, pair_dirs, tmp_path):
    """Plain steps of 1 ms and rounds of 100 ms: after at most a round or two of exploration every round
    is plain decoding (the drafter keeps its context current all the same); the output is the verifier's."""
    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[1])["input_ids"]
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=256)
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, costs(ar=1.0, tree=100.0))
    res = generate(runner, ids, TreeConfig(), SamplingConfig(max_new_tokens=24), tuner=tuner)
    assert res.token_ids == hf_greedy(pair.verifier, ids, 24)
    used = res.stats.tuning["settings_used"]
    assert used.get("ar", 0) >= res.stats.rounds - 2 and res.stats.tuning["choices"]["1"]["mode"] == "ar"
    assert runner.occupied == 0  # the generation's slot is free again


def test_the_prior_is_timed_once_then_read_back(load, pair_dirs, tmp_path, monkeypatch):
    """No prior kept: the first engine start times plain decoding and every candidate's whole round on
    the runner (one line each), keeps it, and the next tuner for the same pair reads it."""
    pair = load("qwen3")
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=256)
    lines: list[str] = []
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, None, log=lines.append)
    assert not lines  # timed when an engine starts, not before
    tuner.start()
    timed = [line for line in lines if line.startswith("tuning: timing a round of")]
    assert len(timed) == len(tuner.rule.arms) - 1  # every tree and the chain; plain decoding besides
    assert all(ms > 0 for ms in tuner._priors[1].values()) and set(tuner._priors[1]) == set(tuner.rule.arms)
    tuner.close()
    lines.clear()
    again = tuner_for(runner, _sources(pair_dirs), tmp_path, None, log=lines.append)
    again.start()
    assert again.resumed and not [line for line in lines if line.startswith("tuning: timing")]
    assert max(s.tree_size for s in again.rule.arms) == 64 and set(runner_modes(runner)) == {
        s.mode for s in again.rule.arms}


def test_a_tuned_generation_after_a_plain_one_times_its_prior_on_the_same_runner(load, pair_dirs, tmp_path):
    """A generation frees its slot when it ends: a tuned generation that follows a plain one on the
    same runner, with nothing kept yet, times its prior there (the probe takes the slot over) and gives
    the verifier's output."""
    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[2])["input_ids"]
    want = hf_greedy(pair.verifier, ids, 16)
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=256)
    assert generate(runner, ids, TreeConfig(mode="ar"), SamplingConfig(max_new_tokens=16)).token_ids == want
    assert not bool(runner.state.active.any())
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, None)
    assert generate(runner, ids, TreeConfig(), SamplingConfig(max_new_tokens=16), tuner=tuner).token_ids == want
    assert set(tuner._priors[1]) == set(tuner.rule.arms)


def test_treeflash_run_with_auto_settings(pair_dirs, tmp_path, monkeypatch):
    """treeflash-run --tree-size auto: the JSON names the settings run and every arm's estimate, the
    tokens equal plain decoding's; auto settings are refused where they cannot apply."""
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
    assert sum(out["tuning"]["settings_used"].values()) == out["rounds"] and "ar" in out["tuning"]["arms"]["1"]
    r = CliRunner().invoke(main, ["--artifacts", str(tmp_path), "--tree-size", "auto", "--prompt", "x"])
    assert r.exit_code != 0 and "an artifact keeps its manifest's tree settings" in r.output


@pytest.mark.parametrize("name", ["qwen3", "qwen3-dflash"])
def test_the_engine_tunes_per_bucket_and_stays_exact(load, pair_dirs, tmp_path, name):
    """Request slots with the self-tuning tree (cheap trees by hand): five requests through three slots,
    joining as others leave; each equals its own greedy decoding, several buckets chose, and a DFlash
    drafter (no head) gets no TreeFlash setting; a second batch on the same engine keeps learning."""
    from treeflash_runtime.engine import Engine, Request

    pair = load(name)
    runner = TorchRunner(pair.verifier, pair.drafter, max_batch=3, capacity=128,
                         tree=TreeConfig(mode="treeflash" if pair.drafter.ar_approximation is not None else "marginal",
                                         tree_size=16, top_m=4, top_k=8))
    tuner = tuner_for(runner, _sources(pair_dirs, name), tmp_path, costs(ar=10.0, tree=11.0))
    engine = Engine(runner, prefill_chunk=4, policy=tuner)
    served = serve_five(engine, pair, [12, 5, 9, 16, 7])
    for r, ids, n in served:
        assert r.tokens == hf_greedy(pair.verifier, ids, n)
    report = tuner.report()
    assert len(report["choices"]) >= 2 and all(int(b) in runner.buckets for b in report["choices"])
    assert max(s.tree_size for s in tuner.rule.arms) <= 16  # within the deployment's tree
    if name == "qwen3-dflash":
        assert not any(s.mode == "treeflash" for s in tuner.used)
    assert runner.occupied == 0
    rounds = sum(k.rounds for k in tuner.rule.buckets.values())
    prompts = [ids for _, ids, _ in served]
    again = [Request(ids, SamplingConfig(max_new_tokens=8)) for ids in prompts[:3]]
    engine.run(again)
    assert [r.tokens for r in again] == [hf_greedy(pair.verifier, ids, 8) for ids in prompts[:3]]
    assert sum(k.rounds for k in tuner.rule.buckets.values()) > rounds
    assert list((tmp_path / "tuner").iterdir())  # what it measured is kept


def test_defaults_are_auto_and_a_second_process_starts_where_the_first_ended(pair_dirs, tmp_path, monkeypatch):
    """treeflash-run with no tree flag tunes (mode auto in the JSON); the next run reads what the first
    one kept; --retune starts afresh; explicit values are used as given."""
    from treeflash_runtime.cli import main

    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path / "cache"))
    d = pair_dirs["qwen3"]
    base = ["--model", str(d / "verifier"), "--drafter", str(d / "drafter"), "--prompt", PROMPTS[0],
            "--max-new-tokens", "16", "--ignore-eos", "--json"]
    plain = json.loads(CliRunner().invoke(main, base + ["--mode", "ar"]).stdout)["token_ids"]
    first = CliRunner().invoke(main, base)
    assert first.exit_code == 0, first.output
    out = json.loads(first.stdout)
    assert out["mode"] == "auto" and out["token_ids"] == plain and not out["tuning"]["resumed"]
    again = CliRunner().invoke(main, base)
    assert json.loads(again.stdout)["tuning"]["resumed"] and json.loads(again.stdout)["token_ids"] == plain
    assert "tuning: timing" not in again.stderr
    fresh = json.loads(CliRunner().invoke(main, base + ["--retune"]).stdout)
    assert not fresh["tuning"]["resumed"]
    fixed = json.loads(CliRunner().invoke(main, base + ["--mode", "treeflash", "--tree-size", "8", "--top-m", "2",
                                                        "--top-k", "4"]).stdout)
    assert fixed["mode"] == "treeflash" and fixed.get("tuning") is None


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
    plain = next(row for row in rep["rows"] if row["setting"] == "ar")
    assert rep["plain_vs_itself_worst_prompt"] == {"torch": plain_against_itself(
        plain["per_prompt_tokens_per_s_by_run"])}
    assert 0.0 < rep["plain_vs_itself_worst_prompt"]["torch"] <= 1.0
    for row in rep["rows"]:
        assert row["worst_prompt_vs_ar_held_out"] == pytest.approx(slowest_prompt_held_out(
            row["per_prompt_tokens_per_s_by_run"], plain["per_prompt_tokens_per_s_by_run"]))
    assert plain["worst_prompt_vs_ar_held_out"] == pytest.approx(1.0)


@pytest.mark.parametrize("runs,worst", [([[10.0, 20.0], [10.0, 10.0]], 0.5),  # prompt 2: twice as fast in run 1
                                        ([[10.0], [20.0], [10.0]], 0.5),  # runs 1 and 3 against run 2
                                        ([[12.0, 8.0], [12.0, 8.0]], 1.0)])
def test_plain_decoding_against_itself_is_its_slowest_prompt_between_odd_and_even_runs(runs, worst):
    """The benchmark's noise line: per prompt, plain decoding's odd runs against its even runs (time per
    token), the slowest either way round."""
    assert plain_against_itself(runs) == pytest.approx(worst)


@pytest.mark.parametrize("runs,worst", [
    # prompt 1 is slow against plain decoding in runs 1 and 3 only (noise), prompt 2 in every run: read
    # held out, prompt 1 runs at 1.0x and prompt 2 at 0.8x
    ([[5.0, 8.0], [10.0, 8.0], [5.0, 8.0], [10.0, 8.0]], 0.8),
    # prompt 1 slowest in the odd runs, prompt 2 in the even ones, each at par in the other half
    ([[5.0, 10.0], [10.0, 5.0]], 1.0),
    # one prompt slow everywhere
    ([[9.0], [9.0]], 0.9)])
def test_a_rows_slowest_prompt_held_out_is_chosen_on_half_the_runs_and_read_on_the_other(runs, worst):
    """Against plain decoding at 10 tokens/s on every prompt and run: the lower of the two held-out
    readings, so a prompt that is slow by chance in the runs that chose it reads at what it runs at."""
    plain = [[10.0] * len(runs[0]) for _ in runs]
    assert slowest_prompt_held_out(runs, plain) == pytest.approx(worst)


def test_with_graphs_the_prior_times_a_replay_of_each_round(load):
    """On CUDA the rounds that serve are graph replays, so the cost probe captures each round once and
    times its replays (an eager stand-in for the capture here, as the CPU tests of the captured round
    do); the committed state is put back."""
    from test_device_round import captured_form

    from treeflash_runtime.tuner.prior import measure_prior
    from treeflash_runtime.tuner.setting import candidate_settings

    pair = load("qwen3")
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=256)
    captured = captured_form(runner)
    arms = candidate_settings(runner_modes(runner), runner.block_size, 16)
    with runner.probing(1, 32) as probe:
        before = runner.state.past_len.clone()
        prior, _ = measure_prior(probe, 1, arms, repeats=2)
        assert torch.equal(runner.state.past_len, before)
        rounds = [f for f in captured if getattr(f, "__name__", "") == "<lambda>"]  # not the prefill passes
        assert len(rounds) == len(probe.memo) == len(arms)  # one capture per setting (plain decoding among them)
    assert set(prior) == set(arms) and all(ms > 0 for ms in prior.values())


def test_with_graphs_a_first_exploration_runs_eagerly_and_a_setting_explored_again_is_captured(load, pair_dirs,
                                                                                                tmp_path):
    """On a GPU a capture costs a few eager rounds, and the tuner may try a setting only once. With
    graphs on and no graph of the cost probe's to replay (here the prior is read back, so nothing was
    probed), a setting's first exploration runs eagerly and its time teaches nothing (an eager round is
    not the replay that serves); explored again it is captured (it keeps coming back), and choices are
    captured and replayed. The rule hears which rounds ran eagerly. Output stays exact."""
    from test_device_round import captured_form

    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[0])["input_ids"]
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=256)
    captured = captured_form(runner)
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, costs(ar=10.0, tree=11.0))
    tuner.rule.explore_share = 0.5  # explore often, so that settings come back
    rounds, step, learnt = [], runner.step, []
    rule_learn = tuner.rule.learn

    def spy_step(plan):
        before = len(captured)
        report = step(plan)
        exploring = tuner._current[1][1]
        rounds.append((plan.tree, exploring, report.eager, len(captured) > before, report.captured))
        return report

    def spy_learn(*args, eager=False):
        learnt.append(eager)
        return rule_learn(*args, eager=eager)

    runner.step, tuner.rule.learn = spy_step, spy_learn
    res = generate(runner, ids, TreeConfig(), SamplingConfig(max_new_tokens=40), tuner=tuner)
    assert res.token_ids == hf_greedy(pair.verifier, ids, 40)
    assert learnt == [eager for _, _, eager, _, _ in rounds]
    assert any(new for *_, new, _ in rounds) and all(new == cap for *_, new, cap in rounds)
    explored: dict = {}
    for tree, exploring, eager, new, _ in rounds:
        if exploring and tree.mode != "ar":
            explored[tree] = explored.get(tree, 0) + 1
            first = explored[tree] == 1
            assert not (first and new) and not (eager and not first)  # eagerly once, then from a graph
        elif eager:
            raise AssertionError("a chosen round ran eagerly")
    assert any(eager for _, _, eager, _, _ in rounds) and max(explored.values()) >= 2
    timed = {s for s, st in tuner.rule.bucket(1).resid.items() if st.n > 0}
    assert timed <= set(tuner.used)


def test_with_graphs_the_cost_probes_captures_serve_the_exploration_rounds(load, pair_dirs, tmp_path):
    """The cost probe captures each tree's round in the form the tuner's greedy rounds take and keeps
    it in the runner's graphs: exploring a tree then replays that graph, timed and at a replay's cost,
    instead of running it eagerly (on an H200 several times a replay's time, and untimed: with random
    weights the default lost 13-29% against plain decoding that way). Output stays exact."""
    from test_device_round import captured_form

    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[0])["input_ids"]
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=256)
    captured_form(runner)
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path)  # its prior timed on the runner
    rounds, step = [], runner.step

    def spy_step(plan):
        report = step(plan)
        rounds.append((plan, report))
        return report

    runner.step = spy_step
    res = generate(runner, ids, TreeConfig(), SamplingConfig(max_new_tokens=40), tuner=tuner)
    assert res.token_ids == hf_greedy(pair.verifier, ids, 40)
    explored = [(plan, report) for plan, report in rounds if not plan.may_capture]
    assert explored and all(plan.tree.mode != "ar" for plan, _ in explored)
    assert not any(report.eager or report.captured for _, report in explored)  # replays of the probe's graphs
    timed = {s for s, st in tuner.rule.bucket(1).resid.items() if st.n > 0}
    assert {tuner_setting(plan.tree) for plan, _ in explored} <= timed


def tuner_setting(tree: TreeConfig):
    from treeflash_runtime.tuner.setting import Setting

    return Setting(tree.mode, tree.tree_size, tree.top_m, tree.top_k)


@pytest.mark.parametrize("given,captures", [({}, False), ({"tree_size": 16}, False),
                                             ({"mode": "treeflash", "tree_size": 16, "top_m": 4, "top_k": 8}, True)])
def test_a_tuned_session_does_not_capture_the_deployment_trees_rounds_at_start(monkeypatch, given, captures):
    """With request slots and CUDA graphs a runner captures its deployment tree's rounds for every
    bucket and sampling kind at start-up (16 graphs on an H200 at 8 slots). The self-tuning tree plans
    every round itself and never replays them, so a session it tunes skips that capture."""
    import treeflash_runtime.factory as factory
    from types import SimpleNamespace

    from treeflash_runtime.options import load_session

    seen = {}

    def fake_session(*args, **kwargs):
        seen.update(kwargs)
        return SimpleNamespace(tuner=None)

    monkeypatch.setattr(factory, "session_from_checkpoints", fake_session)
    monkeypatch.setattr(factory, "build_tuner", lambda sess, fixed, **kwargs: "tuner")
    options = {**dict(mode=None, tree_size=None, top_m=None, top_k=None), **given}
    sess = load_session(model="verifier", drafter="drafter", artifacts=None, verify_checksums=True,
                        drafter_temperature=None, max_seq_len=128, device="cpu", dtype="auto", cuda_graphs=True,
                        fast_kernels="auto", max_batch=8, **options)
    assert seen["capture_at_start"] is captures and (sess.tuner == "tuner") is not captures


def test_a_round_reports_its_verified_nodes(load):
    """A round asked for its nodes reports the verified tree's: one per node but the root, their path
    scores best first and the accepted ones exactly the path the round committed (so a smaller tree's
    gain can be read off in hindsight)."""
    from treeflash_runtime.tuner.online import best_first

    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[0])["input_ids"]
    want = hf_greedy(pair.verifier, ids, 24)
    runner = OracleRunner(pair.verifier, pair.drafter, capacity=256, truth=ids + want, seed=5)
    tree = TreeConfig(mode="treeflash", tree_size=8, top_m=2, top_k=4).resolved(runner.block_size)
    runner.begin(torch.tensor(ids), tree, SamplingConfig())
    report = runner.step(RoundPlan(tree=tree, report_nodes=True))
    nodes, gained = report.nodes[0], report.gained[0]
    assert len(nodes.scores) == len(nodes.accepted) == 7 and len(gained) >= 3
    assert sum(nodes.accepted) == len(gained) - 1 and sum(best_first(nodes)[:3]) >= 1
    assert runner.step(RoundPlan(tree=tree)).nodes is None


class SealedRunner:
    """A runner seen from outside: every attribute can be read, none assigned (the runner's own methods
    still set its state, on the runner itself)."""

    def __init__(self, runner):
        object.__setattr__(self, "_inner", runner)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        raise AssertionError(f"runner.{name} was set from outside the runner")


def test_the_engine_and_the_tuner_reach_the_runner_through_plans_and_reports_only(load, pair_dirs, tmp_path):
    """The self-tuning tree explores trees, reports nodes, probes and keeps the drafter's context, all
    through the RoundPlan it hands out and the RoundReport it gets back: with a runner nobody may assign
    to, five requests through three slots and one sequence still equal their greedy decoding."""
    from treeflash_runtime.engine import Engine

    pair = load("qwen3")
    runner = TorchRunner(pair.verifier, pair.drafter, max_batch=3, capacity=128,
                         tree=TreeConfig(mode="treeflash", tree_size=16, top_m=4, top_k=8))
    tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, costs(ar=10.0, tree=11.0))
    sealed = SealedRunner(runner)
    for r, ids, n in serve_five(Engine(sealed, policy=tuner), pair, [12, 5, 9, 16, 7]):
        assert r.tokens == hf_greedy(pair.verifier, ids, n)
    ids = pair.tokenizer(PROMPTS[1])["input_ids"]
    res = generate(sealed, ids, TreeConfig(), SamplingConfig(max_new_tokens=24), tuner=tuner)
    assert res.token_ids == hf_greedy(pair.verifier, ids, 24)
    learnt = [s for s, st in tuner.rule.gain.items() if st.n > 0]
    assert learnt, "no tree ran"  # a tree's gain is learnt from tree rounds only (its own or a larger one's)
