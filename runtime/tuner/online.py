"""The self-tuning tree as the engine's policy: it hands out a RoundPlan before each round and learns
from the RoundReport after it (treeflash_runtime.plan); it never sets or reads anything on the
runner. The rule (rule.py) decides; this adapter turns its choice into a plan, a report into what
the rule learns (the round's time, and its gain and the smaller trees' in hindsight), and keeps what
was measured on disk (cache.TunerStore). The cost probe, an adapter that ``for_runner`` closes over,
times whole rounds on the runner (prior.py) once per deployment and machine, before the first
request.

    tuner = TreeTuner.for_runner(runner, fixed, sources=(verifier_dir, drafter_dir), dtype="float32")
    plan = tuner.plan(bucket, requests)     # before each round: a RoundPlan
    tuner.learn(report, running)            # after it: the runner's RoundReport
"""

from __future__ import annotations

import atexit
import time
from collections import Counter
from pathlib import Path

from treeflash_export.config import TreeConfig
from treeflash_export.errors import ConfigError

from ..plan import NodeReport, Policy, RoundPlan, RoundReport
from .cache import CostKey, TunerStore, load_rates, rates_json
from .prior import interpolated_prior, measure_prior
from .rule import Estimate, Rule
from .setting import FIELDS, PLAIN, Setting, candidate_settings, hindsight

MAX_TREE = 64  # the largest tree the tuner builds
PROBE_PROMPT = 64  # committed tokens while the prior is timed
SAVE_EVERY_S = 30.0  # what was learnt goes to disk at most this often (and when the engine closes, and at exit)


def runner_modes(runner) -> tuple[str, ...]:
    """The modes the tuner chooses between for this pair: plain decoding, and TreeFlash trees with an
    AR-approximation head, else marginal trees and the chain. With a head those two are left out (on
    the demo pair they gained fewer tokens a round at each size, docs/tuning.md; first contact then
    explores half as much); they stay available as explicit modes."""
    if runner.block_size < 2:
        return ("ar",)
    return ("ar", "treeflash") if runner.has_head else ("ar", "chain", "marginal")


def largest_tree(runner) -> int:
    """MAX_TREE, or less where the runner's deployment tree (request slots) sized its caches for less."""
    if not runner.deployment:
        return MAX_TREE
    return min(MAX_TREE, max(t.tree_size for t in runner.deployment.values()))


def tuner_key(runner, sources, dtype: str, drafter_temperature: float = 1.0) -> CostKey:
    """What the measured round times and gains depend on: the pair (its shapes; its content for the
    gains, where it has folders), the device, dtype, backend and the options that change the code."""
    import torch

    from treeflash_export import __version__
    from treeflash_export.checkpoints import checkpoint_fingerprint, pair_fingerprint

    dev = runner.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu x{torch.get_num_threads()}"
    folders = [s for s in sources if isinstance(s, (str, Path)) and Path(s).is_dir()]
    content = "" if len(folders) < 2 else (",".join(checkpoint_fingerprint(Path(f)) for f in folders)
                                          + f" drafter_temperature={float(drafter_temperature)}")
    head = str(getattr(runner, "draft_head", "model")).removeprefix("torch.")
    return CostKey(pair_fingerprint(*sources), name, dtype, runner.name, __version__, max_batch=runner.max_batch,
                   capacity=runner.capacity, block_size=runner.block_size,
                   options=f"graphs={runner.use_graphs} kernels={runner.fast_kernels} compiled={runner.compiled} "
                           f"draft_vocab={runner.draft_vocab_size or runner.vocab_size} draft_head={head}",
                   content=content)


class TreeTuner(Policy):
    """The engine's policy when tree settings are 'auto': per round, the rule's choice for the bucket
    as a plan; ``used`` counts the settings run, ``report`` is for --json."""

    def __init__(self, rule: Rule, *, drafter_temperature: float = 1.0, context: bool = True, store=None,
                 key: CostKey | None = None, measure=None, log=None, top_bucket: int = 1):
        """measure(bucket) -> ({setting: ms}, steady): the prior of a bucket, timed on the runner
        (None: none can be timed, e.g. in tests, where the rule's prior_ms is given). top_bucket:
        the runner's largest batch bucket, timed too."""
        self.rule, self.log = rule, log
        self.drafter_temperature = drafter_temperature
        self.context = context  # plain steps keep the drafter's context (a tree may follow)
        self.store, self.key, self.measure, self.top_bucket = store, key, measure, top_bucket
        self.fixed_mode: str | None = None
        self.max_tree_size = max(s.tree_size for s in rule.arms)
        self.used: Counter = Counter()  # rounds per Setting
        self.tokens: Counter = Counter()  # tokens gained per Setting
        self.resumed = False
        self._said = False  # whether the first engine start said where the tuner starts from
        self._priors: dict[int, dict] = {}  # bucket -> the prior as measured (kept unless unsteady)
        self._keep_prior = True
        self._configs: dict[Setting, TreeConfig] = {}
        self._current: dict[int, tuple[Setting, bool]] = {}  # bucket -> (setting, exploring) planned
        self._explored: set[tuple[int, Setting]] = set()  # (bucket, setting) explored at least once
        self._bucket = 1
        self._saved_at = -float("inf")
        self._at_exit = False

    @classmethod
    def for_runner(cls, runner, fixed: dict, *, sources, dtype: str, retune: bool = False, log=None,
                   store: TunerStore | None = None, drafter_temperature: float = 1.0) -> "TreeTuner":
        """fixed: the settings the user gave (field -> value); the others are chosen. The prior is timed
        on this runner at the first engine start for this pair, device, dtype and backend, then read
        from ``store`` with what the rounds taught (--retune: timed again and learnt afresh)."""
        fixed = {k: v for k, v in fixed.items() if k in FIELDS and v is not None}
        limit = int(runner.draft_vocab_size or runner.vocab_size)  # no more parents or children than it ranks
        for field in ("top_m", "top_k"):
            if fixed.get(field, 0) > limit:
                flag = "--" + field.replace("_", "-")
                raise ConfigError(f"{flag} {fixed[field]} is out of range: use 1..{limit} (vocabulary {limit})")
        arms = candidate_settings(runner_modes(runner), runner.block_size, largest_tree(runner), fixed=fixed)
        arms = [Setting(s.mode, s.tree_size, min(s.top_m, limit), min(s.top_k, limit)) for s in arms]
        if fixed.get("mode") in (None, "ar") and PLAIN not in arms:
            arms = [PLAIN] + arms  # plain decoding is a candidate unless the user fixed a tree mode
        store = store or TunerStore()
        key = tuner_key(runner, sources, dtype, drafter_temperature)

        def measure(b):
            with runner.probing(b, PROBE_PROMPT) as probe:
                return measure_prior(probe, b, tuner.rule.arms, log, tree=tuner._config)

        tuner = cls(Rule(arms, lambda b: tuner._prior(b), runner.block_size), drafter_temperature=drafter_temperature,
                    context=runner.block_size >= 2, store=store, key=key, measure=measure, log=log,
                    top_bucket=max(getattr(runner, "buckets", (1,))))
        tuner.fixed_mode = fixed.get("mode")
        if not retune:
            tuner._load()
        return tuner

    # ------------------------------------------------------------------ the prior and what was learnt

    def _prior(self, b: int) -> dict[Setting, float]:
        """Bucket b's prior: as measured or loaded, else interpolated between the buckets that were
        (bucket 1 and the largest, both timed when the engine starts)."""
        if b not in self._priors and self.measure is not None and (b == 1 or not self._priors):
            self._time_prior(1)
        if b in self._priors:
            return self._priors[b]
        return interpolated_prior(self._priors or {1: {s: 1.0 for s in self.rule.arms}}, b)

    def _time_prior(self, b: int) -> None:
        self._priors[b], steady = self.measure(b)
        self._keep_prior = self._keep_prior and steady

    def _load(self) -> None:
        if self.store is None or self.key is None:
            return
        saved = self.store.load(self.key, self.log)
        if saved is None:
            return
        by_label = {s.label(): s for s in self.rule.arms}
        try:
            priors = {int(b): {by_label[lab]: float(ms) for lab, ms in p.items() if lab in by_label}
                      for b, p in saved["prior"].items()}
            if not priors or any(set(p) != set(self.rule.arms) for p in priors.values()):
                return  # another candidate set: timed again
            self._priors = priors
            if self.key.content:
                load_rates(self.rule, saved["rates"])
        except (ValueError, KeyError, TypeError) as exc:
            if self.log:
                self.log(f"tuning: ignoring the saved tuning ({type(exc).__name__}: {exc}); measuring again")
            self._priors = {}  # load_rates loads nothing from a bad file
            return
        self.resumed = True  # said at the first engine start (a request refused before then hears nothing of it)

    def save(self, force: bool = False) -> None:
        """Keeps what was measured for the next process (atomic; a failure only logs): at most every
        SAVE_EVERY_S seconds unless forced, and once more when the process exits."""
        if self.store is None or self.key is None or not self._priors or not self._keep_prior:
            return
        now = time.monotonic()
        if not force and now - self._saved_at < SAVE_EVERY_S:
            if not self._at_exit:
                atexit.register(self.save, True)
                self._at_exit = True
            return
        self._saved_at = now
        try:
            prior = {str(b): {s.label(): ms for s, ms in p.items()} for b, p in self._priors.items()}
            self.store.save(self.key, prior, rates_json(self.rule) if self.key.content else {})
        except OSError as exc:
            try:
                if self.log:
                    self.log(f"tuning: could not save what was measured ({exc})")
            except (OSError, ValueError):  # at exit the log's stream may be closed already
                pass

    # ------------------------------------------------------------------ the engine's policy protocol

    def start(self) -> None:
        """Before an engine admits anything (the probe takes slots): bucket 1's and the largest bucket's
        priors are timed now (the buckets between interpolate them and learn from their rounds)."""
        if self.resumed and self.log and not self._said:
            self.log("tuning: starting from what earlier runs with this pair on this machine measured")
        self._said = True
        self.rule.bucket(1)
        if self.top_bucket > 1 and self.top_bucket not in self._priors and self.measure is not None:
            self._time_prior(self.top_bucket)  # many slots' rounds cost another share of a plain step

    def close(self) -> None:
        self.save(force=True)

    def new_generation(self) -> None:
        """One sequence starts (loop.generate): the report counts it alone. (Its request starts in the
        rule when the engine admits it alone, as every request does: ``admitted``.)"""
        self.used.clear()
        self.tokens.clear()

    def admitted(self, key, alone: bool) -> None:
        if alone:
            self.rule.new_request()

    def plan(self, bucket: int = 1, requests=None) -> RoundPlan:
        s, exploring = self.rule.decide(bucket)
        self._current[bucket] = (s, exploring)
        self._bucket = bucket
        self.used[s] += 1
        # Tree rounds report their verified nodes (the smaller trees' gains). On a graph runner an
        # exploration round replays the graph the cost probe kept, else runs eagerly the first time and
        # is captured the next (a setting explored again keeps coming back). Plain steps always capture.
        capture = not exploring or s.mode == "ar" or (bucket, s) in self._explored
        if exploring:
            self._explored.add((bucket, s))
        return RoundPlan(tree=self._config(s), report_nodes=s.mode != "ar", keep_context=self.context,
                         may_capture=capture)

    def learn(self, report: RoundReport, running: list | None = None) -> None:
        b = self._bucket
        s, exploring = self._current.get(b, (None, False))
        if s is None or report.tree != self._config(s):
            return  # not the round this tuner planned
        slots = [slot for slot, _ in running] if running else [0]
        gained = [len(report.gained[i]) for i in slots]
        self.tokens[s] += sum(gained)
        gains: dict[Setting, list[float]] = {s: [float(g) for g in gained]}
        if s.mode != "ar" and report.nodes is not None:
            for i in slots:
                for arm, g in hindsight(s, best_first(report.nodes[i]), self.rule.arms).items():
                    if arm != s:
                        gains.setdefault(arm, []).append(g)
        mean = {arm: sum(v) / len(v) for arm, v in gains.items()}
        timed = not (report.captured or report.eager)
        self.rule.learn(b, s, 1000.0 * report.seconds if timed else None, mean, exploring, 1000.0 * report.seconds,
                        eager=report.eager)
        self.save()

    def _config(self, s: Setting) -> TreeConfig:
        """One TreeConfig per setting (resolved): the runner then sees the same object again."""
        tree = self._configs.get(s)
        if tree is None:
            tree = self._configs[s] = TreeConfig(mode=s.mode, tree_size=s.tree_size, top_m=s.top_m, top_k=s.top_k,
                                                 drafter_temperature=self.drafter_temperature).resolved(
                                                     self.rule.block_size)
        return tree

    def report(self) -> dict:
        """For --json: rounds and realised tokens per setting; per bucket the choice now, every arm's
        estimate, the share of its time exploration took, and what governs exploration now: at first
        contact the share of its recent time it lost (the account), past it the bank (ms)."""
        rep = {"settings_used": {s.label(): n for s, n in self.used.items()},
               "realised_tokens_per_round": {s.label(): self.tokens[s] / n for s, n in self.used.items() if n},
               "resumed": self.resumed, "choices": {}, "arms": {}, "explore_share": {}, "explore_lost_share": {},
               "explore_bank_ms": {}}
        for b, k in self.rule.buckets.items():
            est = self.rule.estimates(b)
            best = self.rule.best(b, est)
            rep["choices"][str(b)] = estimate_json(best)
            rep["arms"][str(b)] = {s.label(): estimate_json(e) for s, e in est.items()}
            rep["explore_share"][str(b)] = k.explore_ms / k.total_ms if k.total_ms else 0.0
            if self.rule.banking(b):
                rep["explore_bank_ms"][str(b)] = k.bank or 0.0
            else:
                rep["explore_lost_share"][str(b)] = self.rule.lost(b, est, best) / k.recent_ms if k.recent_ms else 0.0
        return rep


def estimate_json(e: Estimate) -> dict:
    s = e.setting
    return {"mode": s.mode, "tree_size": s.tree_size, "top_m": s.top_m, "top_k": s.top_k, "tokens_per_round": e.gain,
            "round_ms": e.ms, "tokens_per_s": e.rate, "lower_tokens_per_s": e.lower, "upper_tokens_per_s": e.upper,
            "time_measured": e.measured}


def best_first(nodes: NodeReport) -> list[float]:
    """A round's verified nodes as accepted flags, best first (path score descending; a stable sort
    keeps tree order among ties); padding nodes (score -inf) dropped."""
    pairs = [(sc, a) for sc, a in zip(nodes.scores, nodes.accepted) if sc != float("-inf")]
    return [a for _, a in sorted(pairs, key=lambda p: -p[0])]
