"""The self-tuning tree's parts around the rule (tests/runtime/test_rule.py): the prior timed through
the cost probe, what is kept on disk, and the engine's policy (plans out, reports in), without a model."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from treeflash_export.checkpoints import pair_fingerprint
from treeflash_export.config import TreeConfig
from treeflash_runtime.plan import NodeReport, RoundReport
from treeflash_runtime.tuner import PLAIN, CostKey, Rule, Setting, TreeTuner, TunerStore
from treeflash_runtime.tuner.cache import FORMAT
from treeflash_runtime.tuner.online import best_first
from treeflash_runtime.tuner.prior import STEADY_DRIFT, measure_prior
from treeflash_runtime.tuner.rule import FIRST_ROUNDS
from treeflash_runtime.tuner.setting import FAMILY

B = 8
M, K = FAMILY["treeflash"]
TREES = [Setting("treeflash", n, M, K) for n in (4, 8, 16)]
ARMS = [PLAIN, Setting("chain", B, 1, 1)] + TREES


class FakeProbe:
    """Seconds per part: a plain step of 10 ms (slowed by ``drift`` after the first rounds), a round of
    (20 + N) ms. Counts its calls."""

    def __init__(self, drift: float = 1.0):
        self.calls, self.drift = [], drift

    def time_part(self, part, b, **params):
        self.calls.append((part, b, params.get("setting")))
        if part == "ar":
            rounds = sum(1 for p, _, _ in self.calls if p == "round")
            return 0.010 * (self.drift if rounds else 1.0)
        return (20.0 + params["setting"].tree_size) / 1000.0


def key(**kw) -> CostKey:
    base = dict(pair_fingerprint="abc", device_name="cpu x2", dtype="float32", backend="torch", version="0.1",
                content="weights drafter_temperature=1.0")
    base.update(kw)
    return CostKey(**base)


# ---- the prior ------------------------------------------------------------------------------------

def test_the_prior_times_plain_decoding_and_every_trees_whole_round():
    probe, lines = FakeProbe(), []
    prior, steady = measure_prior(probe, 1, ARMS, lines.append)
    assert steady and prior[PLAIN] == pytest.approx(10.0)
    assert {s: round(ms, 6) for s, ms in prior.items() if s != PLAIN} == {s: 20.0 + s.tree_size for s in ARMS[1:]}
    rounds = [c for c in probe.calls if c[0] == "round"]
    assert len(rounds) == (1 + 3) * len(ARMS[1:])  # a warm-up call and three timed, per tree
    assert len(lines) == len(ARMS[1:]) and lines[0].startswith("tuning: timing a round of chain")


class BurstyProbe(FakeProbe):
    """FakeProbe, with the tree rounds' timed calls from the ``start``-th on, ``length`` of them, 3x slow
    (another job's burst); the first call of each tree is its warm-up."""

    def __init__(self, start: int, length: int, trees: int):
        super().__init__()
        self.window, self.trees = range(start, start + length), trees

    def time_part(self, part, b, **params):
        t = super().time_part(part, b, **params)
        timed = sum(1 for p, _, _ in self.calls if p == "round") - self.trees - 1  # this call's index (-1: warm-up)
        return 3.0 * t if part == "round" and timed in self.window else t


@pytest.mark.parametrize("start", range(10))
def test_a_burst_as_long_as_the_repeats_moves_no_trees_time_wherever_it_falls(start):
    """The timed calls take turns, so the burst's three calls fall on three trees, one each: every
    median drops it. (Timed back to back, one tree would take all three and its median with them.)"""
    trees = len(ARMS) - 1
    prior, steady = measure_prior(BurstyProbe(start, 3, trees), 1, ARMS)
    assert steady and {s: round(ms, 6) for s, ms in prior.items() if s != PLAIN} == {
        s: 20.0 + s.tree_size for s in ARMS[1:]}


def test_a_prior_timed_while_the_machine_changed_speed_is_not_steady():
    prior, steady = measure_prior(FakeProbe(drift=STEADY_DRIFT * 1.2), 1, ARMS)
    assert not steady and prior[PLAIN] == pytest.approx(10.0)  # the faster of the two plain timings


# ---- what is kept ---------------------------------------------------------------------------------

def test_the_store_round_trips_is_keyed_and_ignores_damage(tmp_path):
    store = TunerStore(tmp_path)
    store.save(key(), {"1": {"ar": 10.0}}, {"1": {"time": {}}})
    assert store.load(key()) == {"format": FORMAT, "key": key().as_dict(), "prior": {"1": {"ar": 10.0}},
                                 "rates": {"1": {"time": {}}}}
    for other in (key(dtype="bfloat16"), key(device_name="cpu x1"), key(content="other weights"), key(version="0.2")):
        assert store.load(other) is None
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    for damage in ("{not json", "", "[1, 2]", json.dumps({"format": FORMAT, "key": key().as_dict()}),
                   json.dumps({"format": FORMAT - 1, "key": key().as_dict(), "prior": {}, "rates": {}})):
        store.path(key()).write_text(damage)
        notes = []
        assert store.load(key(), notes.append) is None and "measuring again" in notes[0]


def write_safetensors(path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = int(np.prod(shape)) * 4
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))


def test_pair_fingerprint_follows_shapes_and_configs_not_copies(tmp_path):
    def pair(folder, hidden=8, layers=2):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"hidden_size": hidden, "num_hidden_layers": layers}))
        write_safetensors(folder / "model.safetensors", {"w": ("F32", [hidden, hidden])})
        return folder

    a, b = pair(tmp_path / "a"), pair(tmp_path / "b")  # a copy: other mtimes, same content
    assert pair_fingerprint(a) == pair_fingerprint(b)
    assert pair_fingerprint(a) != pair_fingerprint(pair(tmp_path / "c", layers=3))
    assert pair_fingerprint(a) != pair_fingerprint(pair(tmp_path / "d", hidden=16))
    assert pair_fingerprint(a, b) != pair_fingerprint(a)
    sd = {"w": np.zeros((8, 8), np.float32)}
    assert pair_fingerprint(sd) == pair_fingerprint({"w": np.ones((8, 8), np.float32)})
    assert pair_fingerprint(sd) != pair_fingerprint({"w": np.zeros((8, 8), np.float16)})
    assert pair_fingerprint({"hidden_size": 8}) != pair_fingerprint({"hidden_size": 16})
    with pytest.raises(FileNotFoundError):
        pair_fingerprint(tmp_path / "missing")



# ---- the engine's policy --------------------------------------------------------------------------

def tuner(prior=None, measure=None, store=None, k=None) -> TreeTuner:
    prior = prior or {PLAIN: 10.0, ARMS[1]: 30.0, **{t: 12.0 + t.tree_size for t in TREES}}
    t = TreeTuner(Rule(ARMS, lambda b: t._prior(b), B), store=store, key=k, measure=measure)
    if measure is None:
        t._priors = {1: dict(prior)}
    return t


def report(tuner_, plan, gained, nodes=None, seconds=0.01, **kw) -> RoundReport:
    return RoundReport(tree=plan.tree, gained=[[7] * gained], seconds=seconds, nodes=nodes, **kw)


def test_plans_follow_the_rules_choice_and_ask_for_what_it_needs():
    """A tree round reports its nodes (the hindsight of the smaller trees) and keeps the drafter's
    context; an exploration round may not capture a graph; plain decoding reports nothing."""
    t = tuner()
    t.start()
    plan = t.plan(1)
    s, exploring = t._current[1]
    assert plan.tree == TreeConfig(mode=s.mode, tree_size=s.tree_size, top_m=s.top_m, top_k=s.top_k).resolved(B)
    assert plan.report_nodes == (s.mode != "ar") and plan.keep_context and plan.may_capture == (not exploring)


def test_a_tree_rounds_nodes_teach_the_smaller_trees_of_its_family_in_hindsight():
    """A 16-node round whose verified nodes, best first, were accepted at ranks 0 and 2: the 4-node tree
    would have gained 3 tokens, the 8- and 16-node ones 3 too; the chain and plain decoding learn nothing."""
    t = tuner()
    t.start()
    t.rule.decide = lambda b: (TREES[2], True)
    plan = t.plan(1)
    scores = [-0.1 * i for i in range(15)]
    accepted = [1.0, 0.0, 1.0] + [0.0] * 12
    order = list(reversed(range(15)))  # tree order is not score order: best_first sorts
    nodes = NodeReport([scores[i] for i in order], [0.0] * 15, [0.0] * 15, [accepted[i] for i in order])
    assert best_first(nodes) == accepted
    t.learn(report(t, plan, 3, [nodes], seconds=0.03), [(0, "a")])
    k = t.rule.bucket(1)
    assert {s: st.mean for s, st in t.rule.gain.items()} == {TREES[0]: 3.0, TREES[1]: 3.0, TREES[2]: 3.0}
    assert {s: st.mean for s, st in t.rule.step.items()} == {TREES[1]: 0.0, TREES[2]: 0.0}  # each size over the last
    assert t.rule.estimate(1, TREES[2]).ms == pytest.approx(30.0) and TREES[2] in k.resid and ARMS[1] not in t.rule.gain


def test_rounds_that_captured_or_ran_eagerly_teach_gains_but_not_times():
    t = tuner()
    t.start()
    t.rule.decide = lambda b: (TREES[0], False)
    for flags in ({"captured": True}, {"eager": True}):
        plan = t.plan(1)
        t.learn(report(t, plan, 2, seconds=0.5, **flags))
    k = t.rule.bucket(1)
    assert TREES[0] not in k.resid and not k.speed.n
    assert t.rule.gain[TREES[0]].n > 1.5 and k.total_ms == pytest.approx(1000.0)


def test_the_second_process_starts_where_the_first_ended(tmp_path):
    """The prior is timed once (the cost probe) and kept with what the rounds taught; a new tuner for
    the same key reads both and times nothing; --retune (no load) times again."""
    measured = []

    def measure(b):
        measured.append(b)
        return {PLAIN: 10.0, ARMS[1]: 30.0, **{s: 12.0 + s.tree_size for s in TREES}}, True

    store = TunerStore(tmp_path)
    first = tuner(measure=measure, store=store, k=key())
    first.start()
    first.rule.decide = lambda b: (TREES[1], False)
    for _ in range(10):
        first.learn(report(first, first.plan(1), 3, seconds=0.02))
    first.close()
    assert measured == [1]
    second = tuner(measure=measure, store=store, k=key())
    second._load()
    second.start()
    assert measured == [1] and second.resumed
    assert second.rule.estimate(1, TREES[1]).ms == pytest.approx(20.0)
    assert second.rule.estimate(1, TREES[1]).gain == pytest.approx(3.0)
    fresh = tuner(measure=measure, store=store, k=key())  # as --retune: nothing loaded
    fresh.start()
    assert measured == [1, 1] and not fresh.resumed


def test_a_prior_timed_while_the_machine_changed_serves_this_process_only(tmp_path):
    store = TunerStore(tmp_path)
    t = tuner(measure=lambda b: ({s: 10.0 for s in ARMS}, False), store=store, k=key())
    t.start()
    t.close()
    assert store.load(key()) is None


def test_other_buckets_start_from_bucket_ones_prior_scaled():
    t = tuner()
    assert t._prior(4)[PLAIN] == pytest.approx(10.0 * 1.3)
    assert t._prior(1)[PLAIN] == pytest.approx(10.0)


def test_report_says_what_ran_what_it_gained_and_what_each_arm_is_estimated_at():
    t = tuner()
    t.start()
    for _ in range(3):
        plan = t.plan(1)
        t.learn(report(t, plan, 1, seconds=0.01))
    rep = t.report()
    assert sum(rep["settings_used"].values()) == 3
    assert set(rep["arms"]["1"]) == {s.label() for s in ARMS} and rep["choices"]["1"]["mode"] in ("ar", "chain",
                                                                                                  "treeflash")
    assert 0.0 <= rep["explore_share"]["1"] <= 1.0
    k = t.rule.buckets[1]
    assert rep["explore_lost_share"]["1"] == pytest.approx(t.rule.lost(1) / k.recent_ms) and k.recent_ms > 0
    assert "1" not in rep["explore_bank_ms"]  # first contact: the account, not the bank
    k.rounds, k.bank = FIRST_ROUNDS, 12.5
    t.rule.bucket(4)  # known, not decided yet: the report neither says a budget nor marks its first contact
    rep = t.report()
    assert rep["explore_bank_ms"]["1"] == 12.5 and "1" not in rep["explore_lost_share"]
    assert "4" not in rep["explore_bank_ms"] and t.rule.buckets[4].first_contact is None


def test_start_times_bucket_one_and_the_largest_and_the_buckets_between_take_both():
    """Before anything is admitted the prior of bucket 1 and of the runner's largest bucket is timed;
    a bucket between takes each arm's time interpolated on log scales (here 10 ms x b for trees:
    bucket 4 of 1..8 gets 40 ms), and nothing more is timed once requests hold slots."""
    measured = []

    def measure(b):
        measured.append(b)
        return {s: (5.0 if s == PLAIN else 10.0) * b for s in ARMS}, True

    t = TreeTuner(Rule(ARMS, lambda b: t._prior(b), B), measure=measure, top_bucket=8)
    t.start()
    assert measured == [1, 8]
    assert t.rule.bucket(4).prior_ms[TREES[0]] == pytest.approx(40.0)
    assert t.rule.bucket(2).prior_ms[PLAIN] == pytest.approx(10.0) and measured == [1, 8]
