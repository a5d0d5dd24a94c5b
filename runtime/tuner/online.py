"""The self-tuning tree as a generation uses it: the cost model measured through the runner's probe
(or read from the disk cache), the candidates the user's explicit values leave, and, round by round,
the tree to run next and what the last round showed.

The tuner is the engine's policy: it hands out RoundPlans and learns from RoundReports
(treeflash_runtime.plan); it never sets or reads anything on the runner. Only the cost probe, an
adapter that ``for_runner`` closes over, times the runner's parts (``runner.probing``) when the cost
model is first needed. Nothing here imports a backend or holds a tensor of the round.

    tuner = TreeTuner.for_runner(runner, fixed, sources=(verifier_dir, drafter_dir), dtype="float32")
    plan = tuner.plan(bucket, requests)     # before each round: a RoundPlan
    tuner.learn(report, running)            # after it: the runner's RoundReport
"""

from __future__ import annotations

import atexit
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np

from treeflash_export.config import TreeConfig
from treeflash_export.errors import ConfigError

from ..plan import NodeReport, RoundPlan, RoundReport
from .acceptance import AcceptanceModel, Observation, RequestStream
from .auto import UNPREDICTED, AutoTuner
from .cache import AcceptanceStore, CostCache, CostKey, pair_fingerprint
from .cost import CostModel, default_grid, measure
from .setting import FIELDS, PLAIN, Setting, candidate_settings

MAX_TREE = 64  # the largest tree the tuner builds (the runner reports rounds up to this size)
PROBE_PROMPT = 64  # committed tokens while the parts are timed
SAVE_EVERY_S = 30.0  # the acceptance model goes to disk at most this often (and at exit)
# Eagerly (no graphs) reporting a round's nodes costs a few percent of a small model's round on a CPU
# (a second tree build, the paths, a read-back): after OBSERVE_ALL observed rounds only every
# OBSERVE_EVERY-th round of the choice reports them; exploration rounds always do. With CUDA graphs
# every round reports (a report is a few kernels, and each on/off would be another captured graph).
OBSERVE_ALL = 64
OBSERVE_EVERY = 4
# ... except the first REQUEST_OBSERVE tree rounds of each request of one sequence: a request's
# predictions start from the traffic before it, and with a report every fourth round a hard request
# after easy ones ran TreeFlash N=4 predicted at 2.5 tokens a round for ten rounds while each round's
# own nodes said 1.6 (two reports in those ten rounds).
REQUEST_OBSERVE = 16
# Score probes (one sequence, or the engine's request while it runs alone; eagerly). While plain
# decoding runs, its 2nd, 4th, 8th and 16th plain steps also draft and score the best tree of one
# family without verifying it, TreeFlash and the marginal tree in turn (TorchRunner._probe_scores: a
# drafter pass, the expansion and the tree build, about a quarter of a plain step of the demo pair);
# while a tree runs, its 2nd, 4th, 8th and 16th rounds also score the best tree of the other family
# (TreeFlash beside the marginal tree or the chain, and the reverse) from the round's own drafter
# pass. Then every PROBE_EVERY-th such round while the probed tree is predicted at least as fast as
# what runs, the gap doubling up to MAX_PROBE_GAP while it is predicted slower (a request on which
# it cannot pay stops paying for probes). The tokens committed from the probe's root on label its
# nodes in hindsight (a node is accepted exactly when its path is what the verifier committed), so
# the request's own calibration and the averages of its scores cover the trees it does not run: a
# request on which trees pay, or on which the other family pays, is seen as one even after traffic
# on which they did not.
PROBE_EVERY = 16
MAX_PROBE_GAP = 128
# Request slots while plain decoding wins by far (see TreeTuner._context): the choice is asked again
# after HOLD rounds, or at once when the bucket changes or a request arrives while none runs. On the
# tiny pair, whose step takes a millisecond, asking each round cost about 2% of it.
HOLD = 16


def runner_modes(runner) -> tuple[str, ...]:
    """The modes this pair can run."""
    modes = ["ar"]
    if runner.block_size >= 2:
        modes += ["chain", "marginal"] + (["treeflash"] if runner.has_head else [])
    return tuple(modes)


def cost_key(runner, sources, dtype: str) -> CostKey:
    import torch

    from treeflash_export import __version__

    dev = runner.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu x{torch.get_num_threads()}"
    return CostKey(pair_fingerprint(*sources), name, dtype, runner.name, __version__, max_batch=runner.max_batch,
                   capacity=runner.capacity, block_size=runner.block_size,
                   options=f"graphs={runner.use_graphs} kernels={runner.fast_kernels} compiled={runner.compiled} "
                           f"draft_vocab={_draft_vocab(runner)} draft_head={_draft_head(runner)}")


def _draft_head(runner) -> str:
    """The dtype the runner's expansion multiplies its LM head rows in (its expansion's cost)."""
    return str(getattr(runner, "draft_head", "model")).removeprefix("torch.")


def _draft_vocab(runner) -> int:
    """How many tokens the runner's drafter ranks (the whole vocabulary without a draft vocabulary)."""
    return int(getattr(runner, "draft_vocab_size", None) or runner.vocab_size)


def acceptance_key(runner, sources, drafter_temperature: float) -> dict | None:
    """What a learnt acceptance model depends on: the pair's content, B, the draft vocabulary's size
    and the drafter temperature (None when the pair has no folders to name it by, e.g. a pair built in
    memory)."""
    from treeflash_export import __version__
    from treeflash_export.checkpoints import checkpoint_fingerprint

    folders = [s for s in sources if isinstance(s, (str, Path)) and Path(s).is_dir()]
    if len(folders) < 2:
        return None
    return {"pair": [checkpoint_fingerprint(Path(f)) for f in folders], "block_size": runner.block_size,
            "draft_vocab": _draft_vocab(runner), "drafter_temperature": float(drafter_temperature),
            "version": __version__}


def largest_tree(runner) -> int:
    """The largest tree the tuner may pick: MAX_TREE, or less where the runner's deployment tree
    (request slots) sized its caches for less. Not the tree of a one-sequence runner's last
    generation: after a plain one it was 1 node, and the grid measured then held only 1-node trees."""
    if not runner.deployment:
        return MAX_TREE
    return min(MAX_TREE, max(t.tree_size for t in runner.deployment.values()))


def measure_runner(runner, buckets: list[int], log=None) -> CostModel:
    """Times the default grid's parts on the runner, bucket by bucket."""
    grid = default_grid(runner_modes(runner), runner.block_size, largest_tree(runner))
    model = CostModel()
    for b in buckets:
        with runner.probing(b, PROBE_PROMPT) as probe:
            model = model.merged(measure(probe, [b], grid, log))
    return model


class LazyCost:
    """The cost model, measured (or read from the cache) when a round first asks for it, so that a
    request refused by a cheap check never waits for the measurement."""

    def __init__(self, load):
        self._load, self._model = load, None

    def __getattr__(self, name):  # only for what LazyCost itself lacks: the CostModel's attributes
        if self._model is None:
            self._model = self._load()
        return getattr(self._model, name)


class WaitingProbe(NamedTuple):
    """A score probe waiting for the tokens that label it in hindsight (TreeTuner._label_probes)."""

    setting: Setting  # the probed tree
    raw: NodeReport  # the runner's report of its nodes (RoundReport.probe)
    got: list  # the tokens committed from the probe's root on, so far
    predicted: float | None  # the unscaled tokens predicted for the tree (teaches the realised factor)
    request: object  # the engine's key of the request it drafted for (None: one sequence)
    stream: RequestStream | None  # the stream its labels calibrate


class TreeTuner:
    """Per round, the tree to run (an AutoTuner's choice among the candidates) and the observation of
    the round that ran; ``used`` counts the settings run, ``report`` is for --json."""

    def __init__(self, auto: AutoTuner, drafter_temperature: float = 1.0, store: AcceptanceStore | None = None,
                 store_key: dict | None = None, log=None):
        self.auto = auto
        self.store, self.store_key, self.log = store, store_key, log
        self.resumed = False  # whether the acceptance model was read from an earlier run
        self._note: str | None = None
        self._saved_at = -float("inf")
        self.captures = False  # whether a setting's first round captures a graph (CUDA graphs on)
        self._at_exit = False
        self.fixed_mode: str | None = None  # the mode the user gave (the tuner then chooses only N, M, K)
        self.max_tree_size = max(s.tree_size for s in auto.candidates)  # what the caches must leave room for
        self.drafter_temperature = drafter_temperature
        self.current: Setting | None = None
        self.used: Counter = Counter()  # rounds per Setting
        self.tokens: Counter = Counter()  # tokens gained per Setting
        self._configs: dict[Setting, TreeConfig] = {}
        # While an engine serves (start .. close): whether plans report nodes (eagerly thinned, see
        # OBSERVE_ALL), keep the drafter's context in plain steps, and may capture a new graph; _single:
        # the engine serves one sequence (new_generation); _bucket: the bucket of the round planned.
        self._serving = self._single = False
        self._report = self._keep = self._may_capture = True
        self._bucket = 1
        # One sequence's own acceptance counts, blended with the deployment's (new_generation; until
        # release): a request unlike the traffic so far (code after chat) corrects the calibration
        # within its first rounds instead of after hundreds.
        self.stream: RequestStream | None = None
        # The engine's requests (see admitted): key -> [its own RequestStream, its tree rounds run alone,
        # whether it ran plain steps that skipped the drafter's context (see _context)].
        # Request slots share a bucket's choice, so only a request that runs alone decides on its own
        # counts; the others feed theirs and the deployment's.
        self._requests: dict = {}
        self._rounds = 0  # rounds asked for since serve
        self._request_trees = 0  # tree rounds of this request of one sequence (see REQUEST_OBSERVE)
        # Per kind of probe (plain: during plain decoding; family: during a tree round, of the other
        # family): rounds of that kind since serve, and (the round of the next probe, the gap after it).
        self._restart_probes()
        self._probe: Setting | None = None  # the tree the runner scores after this plain step
        self._probe_request = None  # the engine's key of the request a probe this round drafts for
        self._predicted: float | None = None  # the unscaled tokens predicted for this round's chosen tree
        self._probe_predicted: float | None = None  # ... and for the tree of the last score probe
        self.recorder = None  # a replay.Recording of the rounds, if any (see replay.Recording.attach)
        self._waiting: list[WaitingProbe] = []  # score probes waiting for the tokens that label them
        self.without_context = 0  # engine rounds of plain decoding that skipped the drafter's context
        self.held_for_context = 0  # engine rounds that ran plain decoding, not the tree chosen (see _context)
        self._hold = (None, 0)  # (bucket, engine rounds left) of plain decoding by far without asking again
        self._held_round = False  # whether the last round was one of them
        self._joined = False  # whether a request was admitted during the hold

    @classmethod
    def for_runner(cls, runner, fixed: dict, *, sources, dtype: str, retune: bool = False, log=None,
                   cache: CostCache | None = None, drafter_temperature: float = 1.0,
                   store: AcceptanceStore | None | bool = True) -> "TreeTuner":
        """fixed: the settings the user gave (field -> value); the others are chosen. The cost model is
        measured on first use for this pair, device, dtype and backend, then read from the cache. The
        acceptance model starts from what earlier generations with this pair learnt (``store``; False:
        start afresh and keep nothing) and is saved as it learns (TreeTuner.save)."""
        fixed = {k: v for k, v in fixed.items() if k in FIELDS and v is not None}
        limit = _draft_vocab(runner)  # no more parents or children than the drafter can rank
        for field in ("top_m", "top_k"):
            if fixed.get(field, 0) > limit:
                flag = "--" + field.replace("_", "-")
                raise ConfigError(f"{flag} {fixed[field]} is out of range: use 1..{limit} (vocabulary {limit})")
        modes = runner_modes(runner)
        candidates = candidate_settings(modes, runner.block_size, largest_tree(runner), fixed=fixed)
        candidates = [s for s in candidates if s.top_m <= limit and s.top_k <= limit]
        candidates = [s if s.mode != "chain" else Setting("chain", runner.block_size, 1, 1) for s in candidates]
        key = cost_key(runner, sources, dtype)
        buckets = list(getattr(runner, "buckets", [1]))  # request slots: every batch bucket the runner rounds
        cost = LazyCost(lambda: (cache or CostCache()).get_or_measure(
            key, buckets, lambda todo: measure_runner(runner, todo, log), retune=retune, log=log))
        plain = fixed.get("mode") in (None, "ar")
        # A wider hysteresis than the policy's default: a new setting must promise 10% more (on a GPU each
        # new setting is a graph capture).
        acceptance = AcceptanceModel()
        auto = AutoTuner(cost, acceptance, [s for s in candidates if s.mode != "ar"] or candidates,
                         runner.block_size, hysteresis=0.1, plain=plain)
        if store is True:
            store = AcceptanceStore(cache.root.parent / "acceptance") if cache is not None else AcceptanceStore()
        skey = acceptance_key(runner, sources, drafter_temperature) if store else None
        tuner = cls(auto, drafter_temperature, store or None, skey, log)
        tuner.fixed_mode = fixed.get("mode")
        tuner.captures = bool(getattr(runner, "use_graphs", False))
        if skey is not None and not retune:
            tuner.resumed = store.load_into(skey, acceptance, log)
            tuner._note = (f"tuning: the acceptance model starts from {acceptance.rounds} earlier rounds with this pair"
                           if tuner.resumed else None)
        return tuner

    def save(self, force: bool = False) -> None:
        """Keeps what this deployment learnt for the next process (atomic; a failure only logs): at most
        every SAVE_EVERY_S seconds unless forced, and once more when the process exits."""
        if self.store is None or self.store_key is None:
            return
        now = time.monotonic()
        if not force and now - self._saved_at < SAVE_EVERY_S:
            if not self._at_exit:
                atexit.register(self.save, True)
                self._at_exit = True
            return
        self._saved_at = now
        try:
            self.store.save(self.store_key, self.auto.acceptance)
        except OSError as exc:
            try:
                if self.log:
                    self.log(f"tuning: could not save the acceptance model ({exc})")
            except (OSError, ValueError):  # at exit the log's stream may be closed already
                pass

    def new_generation(self) -> None:
        """One sequence (treeflash_runtime.loop.generate: an engine with one request) starts: the report
        counts one generation from here (what was learnt stays), and the generation's rounds calibrate
        its own stream too. Its plain steps always keep the drafter's context (its score probes draft
        from it)."""
        self._single = True
        self.used.clear()
        self.tokens.clear()
        self.stream = RequestStream()
        self._request_trees = 0
        self._waiting = []
        self.auto.acceptance.restart_averages()
        self.auto.new_request()

    def admitted(self, key, alone: bool) -> None:
        if self._single:
            return  # one sequence: new_generation started it
        self._admitted(key, alone)

    def _admitted(self, key, alone: bool) -> None:
        """The engine admitted a request (key: any hashable id of it): its rounds calibrate a stream of
        its own, which decides while it runs alone, and its first REQUEST_OBSERVE tree rounds alone
        report their nodes. A request admitted while no other runs is a new request as one sequence's
        is: the averages restart. Without this the engine, one request at a time, ran TreeFlash at 1.84
        tokens a round on requests where every fixed tree lost (0.89x plain decoding)."""
        self._requests[key] = [RequestStream(), 0, False]  # stream, tree rounds alone, without context
        if alone:
            self._hold = (None, 0)
            self.auto.acceptance.restart_averages()
            self.auto.new_request()
            self._restart_probes()
        elif self._hold[1]:
            self._joined = True  # marked by its first held round (see _choose)

    def retired(self, key) -> None:
        """The engine's request ``key`` left its slot (with the score probes that waited for its tokens)."""
        self._requests.pop(key, None)
        self._waiting = [w for w in self._waiting if w.request != key]

    def start(self) -> None:
        """Before an engine admits anything: the cost model is measured now (the probe takes slots over,
        so never while requests hold them); the runs' counters start again."""
        self.auto.cost.buckets  # noqa: B018 (measures or reads the cache now)
        self._serving = True
        self._report = self._keep = self._may_capture = True
        self._rounds = 0
        self._restart_probes()
        self._hold, self._joined = (None, 0), False

    def _restart_probes(self) -> None:
        """The score probes' schedule starts again (a generation, or a request that runs alone)."""
        self._probe_rounds = {"plain": 0, "family": 0}
        self._probe_next = {"plain": (2, 2), "family": (2, 2)}
        self._plain_probes = 0

    def close(self) -> None:
        """The engine stops: what was learnt is kept (saved), the runs' state is dropped."""
        self._serving = self._single = False
        self.stream = None
        self._requests = {}
        self._probe = None
        self._waiting = []
        self._hold, self._joined = (None, 0), False
        self.save()

    def plan(self, bucket: int = 1, requests: list | None = None) -> RoundPlan:
        """The next round's plan at this bucket; requests: the engine's running requests' keys (see
        admitted; ignored for one sequence)."""
        self._bucket = bucket
        tree = self._choose(bucket, None if self._single else requests)
        if not self._serving:
            return RoundPlan(tree=tree)
        probe = None if self._probe is None else self._config(self._probe)
        return RoundPlan(tree=tree, report_nodes=self._report or probe is not None, probe=probe,
                         keep_context=self._keep, may_capture=self._may_capture)

    def _choose(self, bucket: int, requests: list | None) -> TreeConfig:
        """The tree of the next round (None: one sequence), setting what the plan reports and keeps."""
        if self._note and self.log:  # said at first use, with the cost model's lines
            self.log(self._note)
        self._note = None
        held, left = self._hold
        self._held_round = bool(left) and held == bucket
        if self._held_round:  # plain decoding by far (see _context): not asked again yet
            self._hold = (bucket, left - 1)
            if self._joined:  # a request joined: it runs without context from now on too
                self._joined = False
                for k in requests or ():
                    if k in self._requests:
                        self._requests[k][2] = True
            self.without_context += 1
            self.used[PLAIN] += 1
            self._predicted = self._probe = None
            self._may_capture = True
            return self._config(PLAIN)
        alone = self._requests.get(requests[0]) if requests is not None and len(requests) == 1 else None
        if requests is None:
            stream = self.stream
        else:  # the engine's: a request running alone decides on its own counts
            stream = alone[0] if alone is not None else None
        s = self.auto.setting(bucket, stream)
        if requests is not None and self._serving:
            s = self._context(s, bucket, requests)
        self.current = s
        self._probe = None
        # A round of the chosen tree, or of a tree run because it was predicted best of its kind (a
        # confirming round, a refresh): what it gains against its unscaled prediction teaches the
        # realised factor (_after_round). Seeds and growth run on the prior or an optimistic guess.
        chosen = s.mode != "ar" and self.auto.explore_reason not in UNPREDICTED
        self._predicted = (self.auto.acceptance.expected(s, stream, self.auto.block_size, raw=True)
                           if chosen else None)
        if self.recorder is not None and s.mode != "ar":
            self.recorder.round(s, self.auto.explore_reason, stream)
        self._may_capture = self._worth_capturing()
        if self._serving and not self.captures:
            self._rounds += 1
            if alone is not None:
                young = s.mode != "ar" and alone[1] < REQUEST_OBSERVE
                alone[1] += young
            else:
                young = self.stream is not None and s.mode != "ar" and self._request_trees < REQUEST_OBSERVE
                self._request_trees += young
            self._report = (self.auto.exploring or self.auto.acceptance.rounds < OBSERVE_ALL
                            or self._rounds % OBSERVE_EVERY == 0 or young)
            # Score probes: one sequence, or the engine's request while it runs alone (as one sequence
            # would; its plain steps keep the drafter's context unless plain decoding wins by far).
            if not self.auto.exploring and stream is not None and self._keep:
                self._probe = self._probe_due(s, bucket, stream)
                self._probe_request = None if requests is None else requests[0]
        self.used[s] += 1
        return self._config(s)

    def _worth_capturing(self) -> bool:
        """With graphs, whether the round just chosen is captured if its graph is not yet. An exploration
        round (a seed, a refresh, a neighbour tried once) runs eagerly instead: on a GPU a capture costs
        tens of rounds (and far more where its kernels compile first), which a setting tried once never
        pays back. The choice is captured, and so is a confirming round's tree (it recurs, and is
        predicted to beat plain decoding)."""
        return not (self.captures and self.auto.exploring and self.auto.explore_reason != "confirm")

    def _context(self, s: Setting, bucket: int, requests: list) -> Setting:
        """Request slots: while plain decoding wins by far at this bucket (AutoTuner.plain_by_far),
        plain steps skip the drafter's context (on a model whose step is a millisecond, keeping it
        cost 2-3% of the step; on CUDA it is a drafter pass a step), and the requests that ran them
        are marked: a tree round drafts from that context, so while a marked request runs the bucket
        decodes plainly (exact either way) until it leaves. Nothing is learnt meanwhile, since the
        choice while plain decoding wins by far runs no tree round (refreshes below `refresh_floor`
        are skipped, confirming rounds need a tree predicted faster); so the next HOLD - 1 rounds of
        the bucket run plain decoding without asking (see _choose). One sequence keeps its
        context: its score probes draft from it."""
        entries = [e for e in (self._requests.get(k) for k in requests) if e is not None]
        skip = s == PLAIN and self.auto.plain_by_far(bucket)
        self._keep = not skip
        if skip:
            self.without_context += 1
            for e in entries:
                e[2] = True
            self._hold = (bucket, HOLD - 1)
        elif s != PLAIN and any(e[2] for e in entries):
            self.held_for_context += 1
            return PLAIN
        return s

    def _probe_due(self, s: Setting, bucket: int, stream: RequestStream) -> Setting | None:
        """The tree to score-probe in this round of the choice s, if one is due: while plain decoding
        runs, the best tree of each family in turn (TreeFlash first); while a tree runs, the best tree
        of the other family (TreeFlash for the marginal tree and the chain, and the reverse), whose
        prediction the request's own rounds otherwise never inform. Each kind keeps its own schedule
        (see PROBE_EVERY)."""
        kind = "plain" if s.mode == "ar" else "family"
        n = self._probe_rounds[kind] = self._probe_rounds[kind] + 1
        nxt, gap = self._probe_next[kind]
        if n < nxt:
            return None
        choice = self.auto.choices.get(bucket)
        if choice is None:
            return None
        if kind == "plain":
            self._plain_probes += 1
            want = ("treeflash", "marginal")[(self._plain_probes - 1) % 2]
            best = self.auto.best_of_mode(bucket, want) or choice.runner_up
            ref = choice.plain_tokens_per_s
        else:
            best = self.auto.best_of_mode(bucket, "marginal" if s.mode == "treeflash" else "treeflash")
            ref = choice.tokens_per_s
        if best is None or best.mode not in ("treeflash", "marginal"):
            return None
        hopeful = (self.auto.predicted_rate(best, bucket, stream) or 0.0) >= (ref or float("inf"))
        self._probe_next[kind] = (n + gap, min(2 * gap, PROBE_EVERY if hopeful else MAX_PROBE_GAP))
        # The probed tree is its family's best prediction, as a chosen tree is the best of all: what
        # it would have gained, known in hindsight, teaches the realised factor too (_label_probes),
        # also while plain decoding runs, where no chosen tree would.
        self._probe_predicted = self.auto.acceptance.expected(best, stream, self.auto.block_size, raw=True)
        return best

    def _config(self, s: Setting) -> TreeConfig:
        """One TreeConfig per setting: the runner then sees the same object again."""
        tree = self._configs.get(s)
        if tree is None:
            tree = self._configs[s] = TreeConfig(mode=s.mode, tree_size=s.tree_size, top_m=s.top_m, top_k=s.top_k,
                                                 drafter_temperature=self.drafter_temperature).resolved(
                                                     self.auto.block_size)
        return tree

    def learn(self, report: RoundReport, running: list | None = None) -> None:
        """The round that just ran: its time corrects the cost model's predictions, and each running
        request's tokens and reported nodes feed the acceptance model. running: [(slot, key)] of the
        requests that ran (None: one sequence in slot 0)."""
        self._round_took(report)
        for slot, key in running or [(0, None)]:
            tokens = report.gained[slot]
            self._after_round(report, slot, len(tokens), tokens, None if self._single else key)

    def _round_took(self, report: RoundReport) -> None:
        """With CUDA graphs a round that captured its graph is left out (a setting's first round, or a
        plain step's second form), and so is an exploration round run eagerly (see _choose); a round
        that also ran a score probe is left out too."""
        if self._probe is not None or self._held_round:  # the probe's work is not the setting's; held: no need
            return
        if report.captured:
            return  # not a replay's time
        if report.eager:
            # An exploration round run eagerly on a graph runner: not the replay's time, but what
            # exploring costs here (refreshes budget their share of time with it).
            self.auto.observe_outside_time(self._bucket, 1000.0 * report.seconds)
            return
        if self.current is not None:
            self.auto.observe_time(self.current, self._bucket, 1000.0 * report.seconds)

    def _after_round(self, report: RoundReport, slot: int, gained: int, tokens: list[int], request) -> None:
        """One request's part of the round: gained, the tokens it gave (for the report of realised
        tokens per setting; they label earlier score probes in hindsight); request: the engine's key
        of the slot's request (see admitted; None: one sequence)."""
        s = self.current
        if s is not None:
            self.tokens[s] += gained
            if self.recorder is not None and s.mode != "ar":
                self.recorder.gained(gained)
            if self._predicted is not None:
                self.auto.acceptance.observe_gain(self._predicted, gained)
        own = self._requests.get(request) if request is not None else None
        stream = self.stream if own is None else own[0]
        family_probe = s is not None and s.mode != "ar" and self._probe is not None
        if family_probe:  # drafted from this round's root: its own tokens are the first labels
            self._wait_for_labels(report, slot, tokens, request, stream)
        if self._waiting:  # earlier score probes: these tokens may label them now
            self._label_probes(tokens, request)
        if s is not None and s.mode == "ar" and self._probe is not None:  # a plain step with a score probe
            self._wait_for_labels(report, slot, tokens, request, stream)
        # A round with a family probe reported the probe's nodes instead of its own.
        raw = None if s is None or s.mode == "ar" or family_probe or report.nodes is None else report.nodes[slot]
        self.auto.observe(None if raw is None else observation(s, raw), stream)

    def _wait_for_labels(self, report: RoundReport, slot: int, tokens: list[int], request, stream) -> None:
        """The probe of this round waits for the tokens that label it: the tokens of the request it
        drafted for (one sequence: request None), whose stream its labels calibrate."""
        if report.probe is not None and request == self._probe_request:
            self._waiting.append(WaitingProbe(self._probe, report.probe[slot], [], self._probe_predicted, request,
                                              stream))

    def _label_probes(self, tokens: list[int], request=None) -> None:
        """The tokens a round committed for a request extend the continuation of every probe waiting for
        that request's tokens; a probe whose every node can now be told accepted or not feeds the
        acceptance model."""
        still = []
        for w in self._waiting:
            if w.request != request:
                still.append(w)
                continue
            w.got.extend(tokens)
            labels = hindsight_labels(w.raw.tokens, w.raw.parents, w.got)
            if labels is None:
                still.append(w)
                continue
            s = w.setting
            obs = observation(s, w.raw.labelled(labels))
            if w.predicted is not None:  # the probed tree's own nodes: its best N - 1 (the report holds more)
                self.auto.acceptance.observe_gain(w.predicted, 1.0 + float(obs.accepted[: s.tree_size - 1].sum()))
            self.auto.acceptance.observe(obs, w.stream, deployment=False)
        self._waiting = still

    def report(self) -> dict:
        rep = self.auto.report()
        rep["settings_used"] = {s.label(): n for s, n in self.used.items()}
        rep["realised_tokens_per_round"] = {s.label(): self.tokens[s] / n for s, n in self.used.items()
                                            if s in self.tokens}
        rep["cost_ms"] = {str(b): c.to_json() for b, c in self.auto.cost.buckets.items()}
        rep["resumed_acceptance"] = self.resumed
        # what trees predicted best gained over their predictions (it scales every tree's gain)
        rep["realised_factor"] = self.auto.acceptance.realised_factor()
        rep["plain_rounds_without_context"] = self.without_context
        rep["tree_rounds_held_for_context"] = self.held_for_context
        return rep


def hindsight_labels(tokens: list, parents: list, committed: list[int]) -> list[float] | None:
    """Whether each node of a tree drafted but not verified (tree order, root excluded; parents: 0 =
    the root, i = node i) lies on the path the verifier committed next, or None while ``committed`` is
    too short to tell for some node. A node at depth d is accepted exactly when its path equals the
    first d committed tokens: greedy decoding and keyed sampling pick, at a context, the token they
    would pick for any tree holding it."""
    depth, ok = [0], [True]  # index 0: the root
    for token, parent in zip(tokens, parents):
        p = int(parent)
        d = depth[p] + 1
        if ok[p] and d > len(committed):
            return None
        depth.append(d)
        ok.append(ok[p] and int(token) == committed[d - 1])
    return [float(a) for a in ok[1:]]


def observation(s: Setting, raw: NodeReport) -> Observation:
    """The runner's report of one round's nodes (tree order) -> an Observation in best-first order
    (score descending; padding nodes, score -inf, dropped). Of a report over a larger tree than the
    round verified (``verified`` nodes), only the verified best are labelled: the rest predict."""
    scores = np.asarray(raw.scores, dtype=float)
    keep = np.isfinite(scores)
    order = np.argsort(-scores[keep], kind="stable")

    def pick(values, dtype):
        return np.asarray(values, dtype=dtype)[keep][order]

    return Observation(mode=s.mode, scores=scores[keep][order], accepted=pick(raw.accepted, float)[: raw.verified] > 0.5,
                       top_m=s.top_m, top_k=s.top_k, m_rank=pick(raw.m_rank, float).astype(int),
                       k_rank=pick(raw.k_rank, float).astype(int))
