"""The self-tuning tree's rule: decide from measured throughput, predict only to order exploration.

Per batch bucket, each candidate setting (an arm) has two running estimates (the tokens shared by the
buckets: they are the requests' and the drafter's, not the batch's):
- its round time, from the wall time of its own real rounds (everything the runner does in a round,
  read-back included); until it has run, the prior (a full round timed on a dummy prompt, see
  prior.py) scaled by how far the prior was off for the arms that did run;
- its tokens per round (per slot), from its own rounds and, exactly, in hindsight from larger trees
  of its family (same mode, M and K: best-first trees are prefix-closed, so a smaller tree's accepted
  path is the part of the larger one's it contains); until then an optimistic guess.
Plain decoding gains exactly one token a round, so its rate is known once its time is.

One rule: run the arm with the highest lower confidence bound on tokens per second; while other arms'
upper bounds beat it, explore the one cheapest to try (least expected loss) as long as exploration
has lost less
than ``explore_share`` of the bucket's recent time (plus a small credit at first contact). An exploration
round loses the time it took beyond what the best arm would have taken for the tokens it gained:
trying a tree that costs little more than the choice costs little. Plain decoding's time is measured
first (its gain is known, so its rate is once its time is). Every estimate is discounted by
``discount`` a round, so a request that changes character is followed.

Pure: no runner, no tensors, no clock; ``learn`` takes what a round measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .setting import PLAIN, Setting

Z = 1.0  # upper confidence bounds at one standard error
LOWER_Z = 0.5  # lower ones at half of that (the choice follows a well-supported mean, not the worst case)
EXPLORE_SHARE = 0.015  # the share of a bucket's time exploration may lose
CREDIT_PLAIN_STEPS = 1.25  # exploration's credit at first contact, in plain steps
DISCOUNT = 0.98  # per round: the time estimates follow about the last 50 rounds
GAIN_PACE = 2.0  # ... and the gains about the last 25 (the discount squared)
PRIOR_SPREAD = 0.2  # relative standard error of a round time not yet measured (the prior's)
TIME_FLOOR = 0.05  # relative standard deviation a round time is assumed to have at least
GAIN_FLOOR = 0.5  # tokens: the standard deviation a tree's gain is assumed to have at least
STALE = 4.0  # plain decoding's time, weighing fewer rounds than this, is measured again first when it may win
BURST = 1.5  # a round time counts for at most this many times the arm's mean
LOAD_CAP = 8.0  # a persisted estimate weighs at most this many rounds: new rounds override it fast
NEW_REQUEST_CAP = 4.0  # gains of earlier requests weigh at most this many rounds when a request starts alone


@dataclass
class Stat:
    """A discounted mean and variance (weights decay by the rule's discount each round)."""

    n: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1.0
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    def decay(self, g: float) -> None:
        self.n *= g
        self.m2 *= g

    def cap(self, most: float) -> None:
        if self.n > most:
            self.m2 *= most / self.n
            self.n = most

    def se(self, floor_sd: float) -> float:
        """Standard error of the mean, with a floor on the standard deviation (few rounds say little)."""
        var = self.m2 / self.n if self.n > 0 else 0.0
        return math.sqrt(max(var, floor_sd * floor_sd) / max(self.n, 1e-9))

    def to_json(self) -> list:
        return [self.n, self.mean, self.m2]

    @classmethod
    def from_json(cls, v) -> "Stat":
        n, mean, m2 = (float(x) for x in v)
        if not (n >= 0 and m2 >= 0 and math.isfinite(mean)):
            raise ValueError("a bad estimate")
        return cls(n, mean, m2)


@dataclass(frozen=True)
class Estimate:
    """An arm's tokens per second per slot (rate) with its confidence bounds, and what they rest on."""

    setting: Setting
    gain: float  # tokens per round
    ms: float  # milliseconds per round
    rate: float
    lower: float
    upper: float
    measured: bool  # its round time comes from its own rounds
    seen: bool = True  # its gain comes from rounds (its own or, in hindsight, a larger tree's)

    def to_json(self) -> dict:
        s = self.setting
        return {"mode": s.mode, "tree_size": s.tree_size, "top_m": s.top_m, "top_k": s.top_k,
                "tokens_per_round": self.gain, "round_ms": self.ms, "tokens_per_s": self.rate,
                "lower_tokens_per_s": self.lower, "upper_tokens_per_s": self.upper, "time_measured": self.measured}


@dataclass
class Bucket:
    """One batch bucket's estimates and time accounts."""

    prior_ms: dict[Setting, float]
    time: dict[Setting, Stat] = field(default_factory=dict)
    gain: dict[Setting, Stat] = field(default_factory=dict)
    bias: Stat = field(default_factory=Stat)  # log(measured / prior round time), over the arms that ran
    total_ms: float = 0.0  # time of all rounds
    explore_ms: float = 0.0  # ... of exploration rounds
    recent_ms: float = 0.0  # time of all rounds, discounted as the estimates are (the budget's base)
    lost_ms: float = 0.0  # what exploration lost (beyond the best arm's time for its tokens), discounted
    rounds: int = 0


class Rule:
    """The choice among ``arms`` (plain decoding among them unless the user fixed a mode), per bucket.

    prior_ms(bucket) -> {setting: ms}: the prior round times of a bucket, asked once per bucket.
    block_size: B, the most tokens a round can gain."""

    def __init__(self, arms: list[Setting], prior_ms, block_size: int, *, explore_share: float = EXPLORE_SHARE,
                 discount: float = DISCOUNT, z: float = Z):
        self.arms = list(dict.fromkeys(arms))
        self.prior_ms, self.block_size = prior_ms, block_size
        self.explore_share, self.discount, self.z = explore_share, discount, z
        self.buckets: dict[int, Bucket] = {}
        self.gain: dict[Setting, Stat] = {}  # tokens per round per slot, shared by the buckets

    def bucket(self, b: int) -> Bucket:
        """Bucket b's estimates. Round times are the bucket's own; tokens per round per slot are one
        estimate for all buckets (they are the requests' and the drafter's, not the batch's), so a
        larger bucket starts from what the smaller ones learnt."""
        if b not in self.buckets:
            self.buckets[b] = Bucket(prior_ms=dict(self.prior_ms(b)), gain=self.gain)
        return self.buckets[b]

    # ------------------------------------------------------------------ estimates

    def estimate(self, b: int, s: Setting) -> Estimate:
        """The arm's rate and bounds: tokens per round within [1, min(N, B)] (a round always gains its
        bonus token; an arm never seen is bounded below by that alone), over its round time give or
        take z standard errors."""
        k = self.bucket(b)
        gain, gain_se, seen = self._gain(k, s)
        t = k.time.get(s)
        if t is not None and t.n >= 0.5:
            ms, ms_se, measured = t.mean, t.se(TIME_FLOOR * t.mean), True
        else:
            ms = k.prior_ms[s] * math.exp(k.bias.mean if k.bias.n else 0.0)
            ms_se, measured = PRIOR_SPREAD * ms, False
        most = 1.0 if s.mode == "ar" else float(min(s.tree_size, self.block_size))
        zl, zu = self.z * LOWER_Z, self.z
        lo = max(1.0, gain - zl * gain_se) if seen else 1.0
        hi = min(most, gain + zu * gain_se) if seen else most  # never run: it may gain all it can
        fast, slow = max(ms - zu * ms_se, 1e-6), ms + zl * ms_se
        return Estimate(s, gain, ms, 1000.0 * gain / ms, 1000.0 * lo / slow, 1000.0 * hi / fast, measured, seen)

    def _gain(self, k: Bucket, s: Setting) -> tuple[float, float, bool]:
        """Tokens per round, its standard error, and whether rounds told it. Unseen trees: an optimistic
        guess, from the largest tree of the family seen (half its extra tokens again per doubling of
        the size), else half the most a round can gain, with an error as large as half of it."""
        if s.mode == "ar":
            return 1.0, 0.0, True
        g = k.gain.get(s)
        if g is not None and g.n >= 0.5:  # a few rounds say little: gains spread about as far as they reach
            return g.mean, g.se(GAIN_FLOOR + 0.5 * (g.mean - 1.0)), True
        most = float(min(s.tree_size, self.block_size))
        seen = [(o.tree_size, st.mean) for o, st in k.gain.items() if family(o) == family(s) and st.n >= 0.5]
        if seen:
            n, mean = max(seen)
            guess = mean + 0.5 * (mean - 1.0) * math.log2(max(s.tree_size / n, 1.0))
        else:
            guess = 1.0 + 0.5 * (most - 1.0)
        guess = min(max(guess, 1.0), most)
        return guess, 0.5 * guess, False

    # ------------------------------------------------------------------ the rule

    def decide(self, b: int) -> tuple[Setting, bool]:
        """(the setting of bucket b's next round, whether it is an exploration round)."""
        est = {s: self.estimate(b, s) for s in self.arms}
        best = max(est.values(), key=lambda e: (e.lower, -e.ms))
        k = self.bucket(b)
        plain = est.get(PLAIN)
        if plain is not None and not plain.measured and best.setting != PLAIN:
            # The reference first: its rate is known once its time is, and its rounds are the cheapest.
            return PLAIN, True
        hopeful = [e for e in est.values() if e.setting != best.setting and e.upper > best.lower]
        if not hopeful:
            return best.setting, False
        if plain in hopeful and k.time[PLAIN].n < STALE:
            return PLAIN, True  # the reference again, before its time is forgotten

        def loss(e):  # what a round of it is expected to lose against the choice, in ms
            return e.ms - 1000.0 * e.gain / best.rate if best.rate > 0 else e.ms

        cheapest = min(hopeful, key=lambda e: (loss(e), -e.upper))
        # The credit lets first contact explore; it fades as the losses it paid for do. An arm
        # whose rounds say it loses nothing (its mean as good as the choice's) is tried whatever the account.
        credit = CREDIT_PLAIN_STEPS * (plain.ms if plain is not None else best.ms) * self.discount ** k.rounds
        if (cheapest.seen and loss(cheapest) <= 0.0) or k.lost_ms <= self.explore_share * k.recent_ms + credit:
            return cheapest.setting, True
        return best.setting, False

    def learn(self, b: int, ran: Setting, ms: float | None, gains: dict[Setting, float], explored: bool,
              wall_ms: float) -> None:
        """A round of ``ran`` at bucket b: ms, its time when it was a replay of the code that serves
        (None for a round that captured a graph or ran eagerly on a graph runner); gains: tokens per
        slot for ``ran`` and, in hindsight, for the smaller trees of its family; wall_ms: what it took
        anyway (the exploration budget counts it)."""
        k = self.bucket(b)
        k.recent_ms *= self.discount
        k.lost_ms *= self.discount
        if explored:  # what the round lost against the best arm as it stood
            best = self.best(b)
            k.explore_ms += wall_ms
            # An exploration that beat the best arm pays back what earlier ones lost; a burst (another
            # job) counts as the arm's usual time, as in its estimate.
            usual = self.estimate(b, ran).ms
            took = min(wall_ms, BURST * usual) if usual > 0 else wall_ms
            delta = took - 1000.0 * gains.get(ran, 1.0) / best.rate if best.rate > 0 else took
            k.lost_ms = max(0.0, k.lost_ms + delta)
        k.total_ms += wall_ms
        k.recent_ms += wall_ms
        k.rounds += 1
        for st in k.time.values():
            st.decay(self.discount)
        for st in k.gain.values():  # what a request accepts changes faster than what a round costs
            st.decay(self.discount ** GAIN_PACE)
        k.bias.decay(self.discount)
        if ms is not None and ms > 0:
            t = k.time.setdefault(ran, Stat())
            # A burst (another job, a page fault) moves the mean by at most half of it again.
            t.add(min(ms, BURST * t.mean) if t.n >= 1 else ms)
            prior = k.prior_ms.get(ran)
            if prior:
                k.bias.add(math.log(ms / prior))
        for s, g in gains.items():
            if s in self.arms and s.mode != "ar":
                k.gain.setdefault(s, Stat()).add(g)

    def new_request(self, b: int) -> None:
        """A request starts alone: earlier requests' gains weigh at most NEW_REQUEST_CAP rounds."""
        for st in self.gain.values():
            st.cap(NEW_REQUEST_CAP)

    def best(self, b: int) -> Estimate:
        return max((self.estimate(b, s) for s in self.arms), key=lambda e: (e.lower, -e.ms))

    # ------------------------------------------------------------------ persistence

    def to_json(self) -> dict:
        """What was measured, per bucket: each arm's time and gain estimates and the prior's bias."""
        out = {}
        for b, k in self.buckets.items():
            out[str(b)] = {"prior_ms": {s.label(): ms for s, ms in k.prior_ms.items()},
                           "time": {s.label(): st.to_json() for s, st in k.time.items()},
                           "gain": {s.label(): st.to_json() for s, st in k.gain.items()},
                           "bias": k.bias.to_json()}
        return out

    def load_json(self, d: dict) -> None:
        """Estimates of an earlier process (arms unknown here are skipped), each capped at LOAD_CAP
        rounds so that this process's rounds override them fast; a bad entry raises ValueError."""
        by_label = {s.label(): s for s in self.arms}
        for key, v in d.items():
            k = self.bucket(int(key))
            for name, target in (("time", k.time), ("gain", k.gain)):
                for label, raw in v.get(name, {}).items():
                    if label in by_label:
                        st = Stat.from_json(raw)
                        st.cap(LOAD_CAP)
                        target[by_label[label]] = st
            if "bias" in v:
                k.bias = Stat.from_json(v["bias"])
                k.bias.cap(LOAD_CAP)


def family(s: Setting) -> tuple:
    """Trees that are prefixes of one another: the same mode, M and K (the chain is its own)."""
    return (s.mode, s.top_m, s.top_k) if s.mode in ("treeflash", "marginal") else (s.mode, s.tree_size)


def hindsight(ran: Setting, accepted: list[float], arms: list[Setting]) -> dict[Setting, float]:
    """Tokens each arm of ran's family no larger than it would have gained this round: ``accepted`` is
    the verified tree's nodes best first (root excluded), 1.0 where accepted. The tree of n nodes is
    the first n of them (prefix-closed), so its accepted path is what they hold of this one's."""
    out = {}
    for s in arms:
        if family(s) == family(ran) and s.tree_size <= ran.tree_size:
            out[s] = 1.0 + float(sum(accepted[: s.tree_size - 1]))
    return out
