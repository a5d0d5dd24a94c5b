"""make bench-default's summary (treeflash_runtime.bench.protocol) over a result it did not run: each
demo row the median of its passes, ratios against plain decoding's median; and the rule's replay over
recorded acceptance (treeflash_runtime.bench.replay) on tapes written here."""

from __future__ import annotations

import click
import pytest

from treeflash_export.config import TreeConfig
from treeflash_runtime.bench.protocol import held_out_ratios, median_rows, summary
from treeflash_runtime.bench.replay import (PLAIN, PROFILES, SIZES, TREES, Profile, Recorder, Tape, main,
                                           mean_gains, parse_profile, play, replay, replay_warm, run_spread)
from treeflash_runtime.plan import NodeReport, RoundReport


def test_the_summary_takes_each_rows_median_over_the_passes():
    def row(rate, used=None):
        return {"tokens_per_s": rate, "tuning": {"settings_used": used or {"ar": 3}}}

    passes = [{"auto first contact": row(30.0), "auto again": row(27.0), "ar": row(20.0),
               "treeflash N=16 M=4 K=8": row(33.0)},
              {"auto first contact": row(34.0), "auto again": row(29.0), "ar": row(22.0),
               "treeflash N=16 M=4 K=8": row(29.0)},
              {"auto first contact": row(26.0), "auto again": row(31.0), "ar": row(18.0),
               "treeflash N=16 M=4 K=8": row(31.0)}]
    demo = median_rows(passes)
    assert demo["ar"]["tokens_per_s"] == 20.0 and demo["ar"]["tokens_per_s_by_pass"] == [20.0, 22.0, 18.0]
    text = summary({"one_core": True, "max_new_tokens": 96, "passes": passes, "demo": demo})
    assert "plain 20.0 tok/s; best fixed treeflash N=16 M=4 K=8 31.0 tok/s (1.55x)" in text
    assert "auto first contact: 30.0 tok/s = 1.50x plain, 0.97x the best" in text
    assert "plain decoding by pass: 20.0, 22.0, 18.0" in text and text.startswith("profile: one core")


def test_the_best_fixed_row_is_also_chosen_on_the_other_passes_and_measured_on_its_own():
    """The best of several noisy rows' medians favours the row that drew lucky passes; the summary also
    gives each pass's ratio against the row the other passes rank best."""
    def row(rate):
        return {"tokens_per_s": rate}

    passes = [{"auto": row(30.0), "a": row(40.0), "b": row(30.0)},  # a: one lucky pass
              {"auto": row(30.0), "a": row(25.0), "b": row(31.0)},
              {"auto": row(30.0), "a": row(32.0), "b": row(29.0)}]
    assert max(median_rows(passes)[n]["tokens_per_s"] for n in "ab") == 32.0
    # pass 1: the other two rank b first (median 30.0 against 28.5); pass 2: a (36.0 against 29.5); pass 3:
    # a (32.5 against 30.5)
    assert held_out_ratios(passes, "auto", ["a", "b"]) == [1.0, 30.0 / 25.0, 30.0 / 32.0]
    assert held_out_ratios(passes[:1], "auto", ["a", "b"]) == []


def test_a_replayed_round_gains_what_the_recorded_round_covering_its_position_gained():
    tape = Tape([{"4": 2, "8": 3, "16": 3, "32": 4, "64": 4}, {"4": 1, "8": 1, "16": 2, "32": 2, "64": 2}])
    assert tape.total == 6.0
    assert tape.gains(TREES[1], 0.0, 0) == ({TREES[0]: 2.0, TREES[1]: 3.0}, 0)
    assert tape.gains(TREES[2], 3.0, 0) == ({TREES[0]: 2.0, TREES[1]: 3.0, TREES[2]: 3.0}, 0)  # inside round 0
    assert tape.gains(TREES[0], 4.0, 0) == ({TREES[0]: 1.0}, 1)
    assert tape.gains(PLAIN, 5.0, 1) == ({PLAIN: 1.0}, 1)


def test_replay_times_name_every_arm_and_where_no_tree_pays_plain_decoding_is_the_best_fixed_arm():
    for spec in PROFILES.values():
        prof = parse_profile(spec)
        assert set(prof.times) == {PLAIN, *TREES} and prof.prefill_ms > 0
    assert parse_profile("ar=1,4=2,8=3,16=4,32=5,64=6").prefill_ms == 0.0  # the prefill may be left out
    for bad in ("ar=10,4=20", "ar=1,4=2,8=3,16=4,32=5,64=6,prefill=-1", "ar=1,4=2,8=3,16=4,32=5,64=6,7=1",
                "ar=1,4=2,8=3,16=4,32=5,64=x"):
        with pytest.raises(click.BadParameter):
            parse_profile(bad)
    never = {"no tree pays": [Tape([{str(n): 1.0 for n in SIZES}] * 40)]}
    res = replay(never, parse_profile(PROFILES["two cores"]), seeds=2, again=False)["no tree pays"]
    assert res["x_best"] == pytest.approx(res["x_plain"]) and 0.0 < res["x_plain"] <= 1.0


def test_the_warm_replay_runs_one_rule_over_a_sets_prompts_and_finds_the_slowest():
    """Prompts where the 16-node tree gains 6 tokens a round and one where no tree gains: a rule warmed
    on the first is faster than plain decoding summed, and the prompt where nothing pays is the slowest,
    at most as fast as plain decoding (every tree round there is a loss)."""
    rich = Tape([{"4": 3.0, "8": 5.0, "16": 6.0, "32": 6.0, "64": 6.0}] * 30)
    never = Tape([{str(n): 1.0 for n in SIZES}] * 40)
    res = replay_warm({"set": [rich, rich, never]}, parse_profile(PROFILES["two cores"]), seeds=3)["set"]
    assert res["x_plain"] > 1.2 and res["slowest_prompt"] <= res["slowest_prompt_median"] <= 1.0


def test_a_replayed_reply_pays_its_prefill_once_whatever_the_setting():
    """The prefill every setting shares adds the same time to a reply: a fixed arm's rate is its tokens
    over the rounds' time plus the prefill, and a ratio of two settings moves towards 1."""
    tape = Tape([{"4": 3.0, "8": 4.0, "16": 4.0, "32": 4.0, "64": 4.0}] * 5)  # 20 tokens
    times = {PLAIN: 10.0, **{t: 20.0 for t in TREES}}
    bare = {s: play(tape, Profile(times), 0, fixed=s) for s in (PLAIN, TREES[1])}
    paid = {s: play(tape, Profile(times, prefill_ms=100.0), 0, fixed=s) for s in (PLAIN, TREES[1])}
    for s in bare:  # the same seed draws the same round times: the prefill adds exactly 100 ms
        assert 1000.0 * 20.0 / paid[s] == pytest.approx(1000.0 * 20.0 / bare[s] + 100.0)
    assert bare[TREES[1]] / bare[PLAIN] > paid[TREES[1]] / paid[PLAIN] > 1.0


def test_the_recorder_keeps_each_rounds_gain_at_every_size_of_the_family_and_starts_afresh_per_generation():
    rec = Recorder(TreeConfig(mode="treeflash", tree_size=64, top_m=4, top_k=8).resolved(16))
    assert rec.plan(1).report_nodes and rec.plan(1).tree.tree_size == 64 and rec.fixed_mode == "treeflash"
    # best first (scores descending): nodes 1, 2 and 9 accepted: the 4-node tree holds 2 of them (3 tokens
    # with the bonus), the 8-node tree too, the 16-node tree all three
    accepted = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0] + [0.0] * 54
    scores = [float(-i) for i in range(63)]
    nodes = NodeReport(scores, [0.0] * 63, [0.0] * 63, accepted)
    rec.new_generation()
    rec.learn(RoundReport(tree=rec.plan(1).tree, gained=[[1, 2, 3, 4]], nodes=[nodes], seconds=0.1))
    assert rec.rounds == [{"4": 3.0, "8": 3.0, "16": 4.0, "32": 4.0, "64": 4.0}]
    rec.new_generation()
    assert rec.rounds == []


def test_record_ends_each_reply_where_the_benchmark_does_at_the_pairs_stop_tokens(tmp_path, monkeypatch):
    """The tapes hold the replies the benchmark's held-out rows time: a reply that ends at its
    end-of-turn token ends there on the tape too (not max_new_tokens later)."""
    import json
    from types import SimpleNamespace

    from click.testing import CliRunner

    import treeflash_runtime.bench.cli as bench_cli
    import treeflash_runtime.cli as run_cli
    import treeflash_runtime.engine as engine
    import treeflash_runtime.loop as loop
    import treeflash_runtime.options as options

    sess = SimpleNamespace(runner=object(), tokenizer=None, stop_token_ids={7, 3})
    seen = []

    def generate(runner, ids, tree, sampling, tuner=None):
        seen.append(sampling)
        tuner.new_generation()

    monkeypatch.setattr(options, "load_session", lambda **kw: sess)
    monkeypatch.setattr(engine, "fixed_plans", lambda runner, tree: SimpleNamespace(trees={1: tree.resolved(16)}))
    monkeypatch.setattr(loop, "generate", generate)
    monkeypatch.setattr(run_cli, "_encode", lambda tok, text, chat: [1, 2])
    monkeypatch.setattr(bench_cli, "_prompt_ids", lambda source, tok: [[1, 2]] * source[1])
    out = CliRunner().invoke(main, ["record", "--out", str(tmp_path / "g.json"), "--heldout", "2",
                                    "--max-new-tokens", "40"])
    assert out.exit_code == 0, out.output
    assert len(seen) == 7  # the demo prompt and two of each set
    assert all(s.stop_token_ids == (3, 7) and s.max_new_tokens == 40 and s.temperature == 0.0 for s in seen)
    assert sorted(json.loads((tmp_path / "g.json").read_text())) == ["chat-self", "chat-stdlib", "code", "demo"]
    assert bench_cli.reply_sampling(sess, 40, ignore_eos=True).stop_token_ids == ()


def test_a_smaller_trees_tape_advances_by_its_own_gain_and_sets_beside_a_larger_ones_in_gains(tmp_path):
    """`record --tree-size 16` keeps the 16-node tree's own rounds: its tape moves by what that tree
    gained; `gains` prints each size's tokens per round by each tape; `run` refuses such a tape (it
    replays every size, so it needs the largest tree's rounds)."""
    import json

    from click.testing import CliRunner

    own = [{"4": 2.0, "8": 3.0, "16": 4.0}, {"4": 1.0, "8": 1.0, "16": 2.0}]
    big = [{"4": 3.0, "8": 3.0, "16": 3.0, "32": 5.0, "64": 5.0}]
    assert Tape(own).top == 16 and Tape(own).total == 6.0 and Tape(big).total == 5.0
    assert mean_gains([Tape(own), Tape(own)]) == {4: 1.5, 8: 2.0, 16: 3.0}
    (tmp_path / "16.json").write_text(json.dumps({"demo": [own]}))
    (tmp_path / "64.json").write_text(json.dumps({"demo": [big, big]}))
    out = CliRunner().invoke(main, ["gains", str(tmp_path / "16.json"), str(tmp_path / "64.json")])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[1].split() == ["size", "N=16", "N=64"]
    assert lines[2].split() == ["4", "1.500", "3.000"] and lines[4].split() == ["16", "3.000", "3.000"]
    assert lines[5].split() == ["32", "5.000"]
    refused = CliRunner().invoke(main, ["run", str(tmp_path / "16.json"), "--seeds", "1"])
    assert refused.exit_code != 0 and "smaller tree" in refused.output


# The demo rows a summary needs, when a test is about the others.
DEMO_ROWS = {k: {"tokens_per_s": 20.0, "tuning": {"settings_used": {"ar": 1}}}
             for k in ("ar", "auto first contact", "auto again")}


def test_the_held_out_rows_say_what_plain_decoding_does_against_itself():
    plain = {"setting": "ar", "speedup_vs_ar": 1.0, "worst_prompt_vs_ar": 1.0}
    auto = {"setting": "auto", "speedup_vs_ar": 1.1, "worst_prompt_vs_ar": 0.85, "worst_prompt_vs_ar_held_out": 0.93}
    rows = {"rows": [auto, plain], "identical_outputs": True}
    text = summary({"one_core": False, "max_new_tokens": 96, "demo": DEMO_ROWS,
                    "heldout": {"code": {**rows, "plain_vs_itself_worst_prompt": {"torch": 0.875}}}})
    assert "held-out code: auto 1.10x plain (worst prompt 0.85x)" in text
    assert "plain decoding against itself (odd runs against even ones): the slowest prompt 0.88x" in text
    assert "auto's slowest prompt read held out (chosen on odd runs, read on even ones, and the reverse): 0.93x" in text
    text = summary({"one_core": False, "max_new_tokens": 96, "demo": DEMO_ROWS, "heldout": {"code": rows}})
    assert "against itself" not in text  # one run: nothing to say


def test_the_slot_rows_give_each_row_against_plain_decoding_with_its_runs_spread():
    text = summary({"one_core": False, "max_new_tokens": 96, "demo": DEMO_ROWS, "slots": {"rows": [
        {"variant": "auto", "concurrency": 8, "tokens_per_s": 98.0, "ratio_to_ar": 0.98,
         "ratio_to_ar_runs": [0.97, 1.02, 0.98]},
        {"variant": "ar", "concurrency": 8, "tokens_per_s": 100.0, "ratio_to_ar": 1.0,
         "ratio_to_ar_runs": [1.0, 1.0, 1.0]}], "requests": 16, "max_new_tokens": 64, "repeat": 3,
        "identical_outputs": True}})
    assert "request slots: 16 requests of 64 tokens, the median of 3 runs; outputs identical True" in text
    assert "c=8: 98.0 tok/s, 0.98x plain (run by run 0.97x to 1.02x)" in text
    assert "c=8: 100.0 tok/s, 1.00x plain\n" in text + "\n"


@pytest.mark.parametrize("ratios, worst, tenth, short", [
    ([1.0] * 20, 1.0, 1.0, 0.0),
    ([0.7, 0.85] + [1.0] * 18, 0.7, 0.85, 0.1),  # a tenth of 20 runs: the second worst
    ([0.95, 0.89, 0.9, 1.1], 0.89, 0.89, 0.25),  # under ten runs: the worst; 0.9 itself is not short
    ([0.8] * 5 + [1.0] * 95, 0.8, 1.0, 0.05),  # of a hundred runs: the tenth worst
    ([0.8] * 9 + [1.0] * 91, 0.8, 1.0, 0.09),
    ([0.8] * 10 + [0.95] + [1.0] * 89, 0.8, 0.8, 0.1),
    ([0.8] * 9 + [0.95] + [1.0] * 90, 0.8, 0.95, 0.09),
])
def test_the_replay_reports_how_runs_spread_the_worst_the_tenth_and_the_share_that_fell_short(ratios, worst,
                                                                                              tenth, short):
    assert run_spread(ratios) == {"worst_x_best": worst, "tenth_x_best": tenth, "short_share": pytest.approx(short)}


def test_a_set_of_one_prompt_runs_as_often_as_the_largest_set():
    """Seeds are per prompt: the demo prompt alone would count 20 runs where a set of ten counts 200, and a
    lock-in on a fifth of runs would hang on four seeds."""
    rich = Tape([{"4": 3.0, "8": 5.0, "16": 6.0, "32": 6.0, "64": 6.0}] * 10)
    seen = []

    class Counting(Tape):
        def gains(self, s, pos, j):
            if pos == 0.0:
                seen.append(id(self))
            return super().gains(s, pos, j)

    one, three = Counting(rich.rounds), [Counting(rich.rounds) for _ in range(3)]
    replay({"one": [one], "three": three}, parse_profile(PROFILES["two cores"]), seeds=2, again=False)
    runs = {t: seen.count(id(t)) for t in (one, *three)}  # each run starts once per setting played
    assert runs[one] == 3 * runs[three[0]] == 3 * runs[three[2]]
