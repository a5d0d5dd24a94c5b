"""The self-tuning tree's rule: decide from measured throughput, predict only to order exploration.

Per batch bucket, an arm's (candidate setting's) round time is the prior (prior.py) at the machine's
speed now (what every real round says of the prior), times the arm's own residual (plain decoding,
timed first, is the residuals' zero; a tree not yet run takes the trees'). Tokens per round per slot
are shared by the buckets: a family's smallest tree's plus each larger size's step over the next
smaller one, from the rounds that told both (exactly, in hindsight: best-first trees are
prefix-closed); until rounds tell it, an optimistic guess. Plain decoding gains one token a round.

One rule: run the arm with the best mean rate among those rounds told of (a tree once its lower bound
beats plain decoding); while other arms' upper bounds beat it, explore the one that surely loses least
(or the largest tree of its family within WIDER of its time) where a bank holds what that round is
expected to lose: every round adds ``explore_share`` of its time, an exploration pays what it lost, so
exploration loses that share of the time whatever one round costs. At first contact (its first
FIRST_ROUNDS rounds) the account is instead what exploration lost, valued with the estimates now, under
that share of the recent time plus a credit. Every estimate is discounted a round, so a request that
changes character is followed.

Pure: no runner, no tensors, no clock; ``learn`` takes what a round measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .setting import PLAIN, Setting, covers

Z = 1.0  # upper confidence bounds at one standard error
LOWER_Z = 0.5  # lower ones at half of that (the choice follows a well-supported mean, not the worst case)
EXPLORE_SHARE = 0.015  # the share of a bucket's time exploration may lose
CREDIT_PLAIN_STEPS = 1.25  # exploration's credit at first contact, in plain steps
FREE_PASS = 3.0  # an arm whose mean loses nothing may be explored while the losses stay under this x the budget
DISCOUNT = 0.98  # per round: the arms' residual times follow about the last 50 rounds
SPEED_DISCOUNT = 0.9  # ... and the machine's speed about the last 10 (another job starts or stops)
GAIN_PACE = 2.0  # ... and the gains about the last 25 (the discount squared)
PRIOR_SPREAD = 0.2  # relative standard error of a round time not yet measured (the prior's) ...
FITTED_SPREAD = 0.1  # ... once two rounds have told the machine's speed
TIME_FLOOR = 0.05  # relative standard deviation a round time is assumed to have at least
SHRINK = 0.25  # rounds: n rounds' mean residual weighs n / (n + SHRINK) against its kind's ((0.1 / PRIOR_SPREAD)^2)
GAIN_FLOOR = 0.25  # tokens: the standard deviation a tree's gain is assumed to have at least ...
STEP_FLOOR = 0.1  # ... and a size's step over the next smaller one
STEP_PRIOR = 0.5  # tokens: the spread of a step pooled (as one round) with the rounds that told it
WIDER = 0.1  # exploration takes a larger tree of a family while its round costs at most this much more
GROWTH = 0.25  # an unseen tree's guess: this share of a seen one's extra tokens more per doubling of N
SEEN = 0.1  # an arm's gain rests on rounds while their discounted weight is at least this (then: explored again)
BURST = 1.5  # an exploration round counts for at most this many times the arm's mean in the budget ...
OUTLIER_Z = 3.0  # ... and in the estimates for at most this many standard deviations over it
PLAIN_CHECK = 2.0  # rounds: plain decoding's time resting on fewer is checked against a tree that looks cheaper
NEW_REQUEST_CAP = 4.0  # gains of earlier requests weigh at most this many rounds when a request starts alone
FIRST_ROUNDS = 100  # first contact's account holds for this many rounds (its credit has faded to an eighth) ...
BANK_ROUNDS = 8.0  # ... then a bank's: explore_share of every round's time, holding at most this many choice rounds
PAST_DISCOUNT = 0.9  # per request: a request starts from the mean of about the last ten requests' gains


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
        self.n, self.m2 = self.n * g, self.m2 * g

    def cap(self, most: float) -> None:
        if self.n > most:
            self.m2 *= most / self.n
            self.n = most

    def se(self, floor_sd: float, prior_sd: float = 0.0) -> float:
        """Standard error of the mean, with a floor on the standard deviation, and the rounds' variance
        pooled with one round of prior_sd's (a few rounds that happen to agree say little)."""
        var = self.m2 / self.n if self.n > 0 else 0.0
        var = max(var, floor_sd * floor_sd, (self.m2 + prior_sd * prior_sd) / (self.n + 1.0))
        return math.sqrt(var / max(self.n, 1e-9))


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
    sure: float = 1.0  # tokens per round it gains at least (the most a tree it covers gained)
    fast_ms: float = 0.0  # its round time's lower bound (the upper bound's)


@dataclass
class Bucket:
    """One batch bucket's estimates and time accounts."""

    prior_ms: dict[Setting, float]
    # Round times: log(measured / prior) = the machine's speed now (every timed round's, so that an arm
    # not run lately follows the machine) + the arm's own residual.
    speed: Stat = field(default_factory=Stat)
    resid: dict[Setting, Stat] = field(default_factory=dict)
    total_ms: float = 0.0  # time of all rounds
    explore_ms: float = 0.0  # ... of exploration rounds
    recent_ms: float = 0.0  # time of all rounds, discounted as the estimates are (the budget's base)
    explored: dict[Setting, list[float]] = field(default_factory=dict)  # per arm, [ms, rounds] explored
    lost_ms: float | None = 0.0  # what they lost (Rule.lost), valued as of the last round (None: not yet)
    untimed_ms: dict[Setting, float] = field(default_factory=dict)  # an arm's last eager (untimed) round
    decided: dict | None = None  # the estimates of the last decision, for the round that follows
    rounds: int = 0
    bank: float | None = None  # ms exploration may still lose (after first contact; None: not yet)
    first_contact: bool | None = None  # nothing was known of the gains when this one first decided


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
        # Tokens per round per slot, shared by the buckets: each tree's, and each size's step (_family_gains).
        self.gain: dict[Setting, Stat] = {}
        self.step: dict[Setting, Stat] = {}
        self.past: dict[tuple[str, Setting], Stat] = {}  # ("gain" or "step", arm): earlier requests' means
        trees = [s for s in self.arms if s.mode != "ar"]
        # Per tree, the arms of its family no larger than it, smallest first (it last): a round of it tells
        # all of their gains; tops: the largest tree of each family.
        self.family = {s: sorted((o for o in trees if covers(s, o)), key=lambda o: o.tree_size) for s in trees}
        self.tops = [s for s in trees if not any(o != s and covers(o, s) for o in trees)]

    def bucket(self, b: int) -> Bucket:
        """Bucket b's estimates (round times; the gains are the requests' and the drafter's, shared)."""
        if b not in self.buckets:
            self.buckets[b] = Bucket(prior_ms=dict(self.prior_ms(b)))
        return self.buckets[b]

    # ------------------------------------------------------------------ estimates

    def estimate(self, b: int, s: Setting) -> Estimate:
        return self.estimates(b)[s]

    def estimates(self, b: int) -> dict[Setting, Estimate]:
        """Every arm's rate and bounds: tokens per round within [1, min(N, B)] (a round always gains its
        bonus token; an arm never seen is bounded below by that alone), over its round time give or
        take z standard errors (each family's gains walked once: this runs every round)."""
        k = self.bucket(b)
        gains = {PLAIN: (1.0, 0.0, True, 1.0)}
        for top in self.tops:
            gains.update(self._family_gains(top))
        return {s: self._estimate(k, s, gains[s]) for s in self.arms}

    def _estimate(self, k: Bucket, s: Setting, gain_of: tuple[float, float, bool, float]) -> Estimate:
        gain, gain_se, seen, sure = gain_of
        ms, rel_se, measured = self._time(k, s)
        ms_se = rel_se * ms
        most = 1.0 if s.mode == "ar" else float(min(s.tree_size, self.block_size))
        zl, zu = self.z * LOWER_Z, self.z
        lo = max(sure, gain - zl * gain_se) if seen else sure
        hi = min(most, gain + zu * gain_se) if seen else most  # never run: it may gain all it can
        fast, slow = max(ms - zu * ms_se, 1e-6), ms + zl * ms_se
        return Estimate(s, gain, ms, 1000.0 * gain / ms, 1000.0 * lo / slow, 1000.0 * hi / fast, measured, seen,
                        sure, fast)

    def _time(self, k: Bucket, s: Setting) -> tuple[float, float, bool]:
        """Milliseconds per round, its relative standard error, and whether the arm's own rounds told
        it: the prior at the machine's speed now, times the arm's residual."""
        r = k.resid.get(s)
        log_ms = math.log(k.prior_ms[s]) + (k.speed.mean if k.speed.n else 0.0) + self._resid(k, s)
        if r is not None and r.n >= 0.5:
            return math.exp(log_ms), r.se(TIME_FLOOR), True
        return math.exp(log_ms), PRIOR_SPREAD if k.speed.n < 2 else FITTED_SPREAD, False

    @staticmethod
    def _resid(k: Bucket, s: Setting) -> float:
        """The arm's residual: its rounds' mean, shrunk towards its kind's: none for plain decoding (the
        zero), the trees' rounds together for a tree (a tree not run lately follows those that did)."""
        kind = 0.0
        if s.mode != "ar":
            trees = [st for o, st in k.resid.items() if o.mode != "ar"]
            n = sum(st.n for st in trees)
            kind = sum(st.mean * st.n for st in trees) / n if n > 0 else 0.0
        r = k.resid.get(s)
        return kind if r is None or r.n <= 0 else kind + (r.mean - kind) * r.n / (r.n + SHRINK)

    def _family_gains(self, top: Setting) -> dict[Setting, tuple[float, float, bool, float]]:
        """(tokens per round, its standard error, whether rounds told it, what it gains at least) of
        every arm of top's family up to top. A tree's gain is its family's smallest tree's plus the
        steps between each size and the next, each a mean over the rounds that told both sizes (the
        same rounds: a step is never negative and is known far better than two separate means)."""
        out = {}
        mean = var = 0.0
        known = None  # (the largest tree of the chain that rounds told of, its gain)
        told = True  # every smaller tree of the family was told of
        for i, o in enumerate(self.family[top]):
            st = self.gain.get(o) if i == 0 else self.step.get(o)
            told = told and st is not None and st.n >= SEEN
            if told:
                if i == 0:
                    mean, var = st.mean, self._gain_se(st, o) ** 2
                else:
                    mean, var = mean + max(st.mean, 0.0), var + st.se(STEP_FLOOR, STEP_PRIOR) ** 2
                mean = min(mean, float(min(o.tree_size, self.block_size)))  # a round gains at most min(N, B)
                known = (o, mean)
                out[o] = (mean, math.sqrt(var), True, mean)
            else:
                out[o] = self._unseen_gain(o, known)
        return out

    def _unseen_gain(self, s: Setting, known) -> tuple[float, float, bool, float]:
        """The gain of a tree past the part of its family that rounds told of (known: the largest tree
        of that part and its gain, or None): an optimistic guess, GROWTH of that tree's extra tokens more
        per doubling of the size (else half the most a round can gain), with an error of _spread's."""
        sure = known[1] if known else 1.0
        own = self.gain.get(s)  # rounds that told its gain alone (a runner that reports no nodes)
        if own is not None and own.n >= SEEN:
            return max(own.mean, sure), self._gain_se(own, s), True, sure
        most = float(min(s.tree_size, self.block_size))
        guess = (sure + GROWTH * (sure - 1.0) * math.log2(s.tree_size / known[0].tree_size) if known
                 else self._first_guess(s))
        guess = min(max(guess, sure), most)
        return guess, _spread(guess), False, sure

    def _first_guess(self, s: Setting) -> float:
        """A tree's gain before any round told its family: half the most a round of it can gain."""
        return 1.0 + 0.5 * (min(s.tree_size, self.block_size) - 1.0)

    def _gain_se(self, st: Stat, s: Setting) -> float:
        """A tree's mean gain's standard error: its rounds' spread, pooled with one of its first guess's."""
        return st.se(_spread(st.mean), _spread(self._first_guess(s)))

    # ------------------------------------------------------------------ the rule

    def _started(self, b: int) -> Bucket:
        """Bucket b, marked at its first decision or round as first contact or not: no bucket had run a
        round and no tree's gain was known (a process resumed from an earlier one's is not one)."""
        k = self.bucket(b)
        if k.first_contact is None:
            k.first_contact = not any(o.rounds for o in self.buckets.values()) and not any(
                st.n >= SEEN for st in self.gain.values())
        return k

    def decide(self, b: int) -> tuple[Setting, bool]:
        """(the setting of bucket b's next round, whether it is an exploration round)."""
        est = self.estimates(b)
        best = self.best(b, est)
        k = self._started(b)
        k.decided = est  # what the round's learn needs (nothing changes in between)
        plain = est.get(PLAIN)
        # The reference first (its rate is known once its time is; the trees' times are told against
        # it), and again while the choice is a tree whose round looks cheaper than a plain step (a burst).
        if plain is not None and (not plain.measured or (best.setting != PLAIN and best.ms < plain.ms
                                                         and k.resid[PLAIN].n < PLAIN_CHECK)):
            return PLAIN, best.setting != PLAIN
        hopeful = [e for e in est.values() if e.setting != best.setting and self._hopes(e, best)]
        if not hopeful:
            return best.setting, False

        def cost(e):  # what a round of it takes, in ms
            return k.untimed_ms.get(e.setting, e.ms)

        def loss(e):  # what a round of it is expected to lose against the choice, in ms
            return cost(e) - _choice_ms(e, best)

        pick = min(hopeful, key=lambda e: (loss(e), -e.upper))
        if pick.setting.mode != "ar":  # the largest hopeful tree of its family within WIDER of its time
            near = [e for e in hopeful if covers(e.setting, pick.setting) and cost(e) <= (1.0 + WIDER) * cost(pick)]
            pick = max(near, key=lambda e: e.setting.tree_size)
        expected = loss(pick)
        if self.banking(b):  # the bank pays each round's expected loss
            k.bank = min(k.bank or 0.0, BANK_ROUNDS * best.ms)
            return (pick.setting, True) if k.bank >= max(expected, 0.0) else (best.setting, False)
        # First contact: the losses valued now within the share of the recent time plus a credit that fades
        # as the losses it paid for do (an arm whose mean loses nothing: up to FREE_PASS times that); a
        # round known to cost far more than a replay (untimed before) needs room in the account.
        credit = CREDIT_PLAIN_STEPS * (plain.ms if plain is not None else best.ms) * self.discount ** k.rounds
        allowed = self.explore_share * k.recent_ms + credit
        room = max(expected, 0.0) if pick.setting in k.untimed_ms else 0.0
        lost = self.lost(b, est, best)
        if lost + room <= allowed or (pick.seen and expected <= 0.0 and lost <= FREE_PASS * allowed):
            return pick.setting, True
        return best.setting, False

    def banking(self, b: int) -> bool:
        """Whether bucket b's exploration is paid from its bank (past first contact), not the account (a
        bucket that has not decided yet: neither; asking marks nothing)."""
        k = self.bucket(b)
        return k.first_contact is not None and (not k.first_contact or k.rounds >= FIRST_ROUNDS)

    @staticmethod
    def _hopes(e: Estimate, best: Estimate) -> bool:
        """Whether e's upper bound beats the choice (for a tree the choice covers, its time's bound only:
        the choice's rounds tell its gain anyway)."""
        if e.seen and e.measured and covers(best.setting, e.setting):
            return 1000.0 * e.gain / e.fast_ms > best.rate
        return e.upper > best.rate

    def best(self, b: int, est: dict[Setting, Estimate] | None = None) -> Estimate:
        """Bucket b's choice (est: its estimates, if the caller has them): the arm with the best mean
        rate among those rounds told of, a tree only once its lower bound beats plain decoding's rate:
        the choice follows the means (covered trees share their rounds, so their differences are known
        better than their bounds say) and leaves plain decoding only on evidence."""
        est = est or self.estimates(b)
        plain = est.get(PLAIN)
        ok = [e for e in est.values() if e.seen and (plain is None or e is plain or e.lower >= plain.rate)]
        return max(ok or est.values(), key=lambda e: (e.rate, -e.ms))

    def learn(self, b: int, ran: Setting, ms: float | None, gains: dict[Setting, float], explored: bool,
              wall_ms: float, eager: bool = False) -> None:
        """A round of ``ran`` at bucket b: ms, its time as a replay of the code that serves (None when it
        captured a graph or ran eagerly on a graph runner: ``eager``); gains: tokens per slot for ``ran``
        and, in hindsight, the smaller trees it covers; wall_ms: what it took (the budget counts it)."""
        k = self._started(b)
        decided, k.decided = k.decided, None
        k.recent_ms *= self.discount
        for v in k.explored.values():
            v[:] = [x * self.discount for x in v]
        if explored:
            est = decided if decided is not None else self.estimates(b)  # no decision (tests): as they stand
            k.explore_ms += wall_ms
            # A burst counts as the arm's usual time; an untimed round (eager on a graph runner) all it took.
            usual = est[ran].ms
            took = min(wall_ms, BURST * usual) if usual > 0 and ms is not None else wall_ms
            if eager:
                k.untimed_ms[ran] = wall_ms
            if k.bank is not None:  # what it lost by the estimates it was decided on (a better arm pays in)
                k.bank -= took - _choice_ms(est[ran], self.best(b, est))
            v = k.explored.setdefault(ran, [0.0, 0.0])
            v[0] += took
            v[1] += 1.0
        k.total_ms += wall_ms
        k.recent_ms += wall_ms
        if k.bank is not None:
            k.bank += self.explore_share * wall_ms
        k.rounds += 1
        for st in k.resid.values():
            st.decay(self.discount)
        for st in (*self.gain.values(), *self.step.values()):  # what a request accepts changes faster than
            st.decay(self.discount ** GAIN_PACE)  # what a round costs
        k.speed.decay(SPEED_DISCOUNT)
        prior = k.prior_ms.get(ran)
        if not eager:
            k.untimed_ms.pop(ran, None)  # it runs from a graph now
        if ms is not None and ms > 0 and prior:
            # A burst (another job, a page fault) counts as a round OUTLIER_Z standard deviations slow.
            usual, se, _ = self._time(k, ran)
            x = math.log(min(ms, usual * math.exp(OUTLIER_Z * math.hypot(se, TIME_FLOOR))) / prior)
            r = k.resid.setdefault(ran, Stat())
            own = self._resid(k, ran)
            speed = k.speed.mean if k.speed.n else x - own
            if r.n > 0 or not k.speed.n:  # an arm's first round here tells its residual, not the speed
                k.speed.add(x - own)
            r.add(x - speed)
        # Per family, the smallest tree's gain and each size's step over the next smaller one, from the
        # sizes this round told (hindsight tells a prefix of the family: every size up to the one run).
        told = {s: g for s, g in gains.items() if s in self.arms and s.mode != "ar"}
        for s, g in told.items():
            self.gain.setdefault(s, Stat()).add(g)
            below = self.family[s][:-1]
            if below and below[-1] in told:
                self.step.setdefault(s, Stat()).add(g - told[below[-1]])
        if k.explored:
            k.lost_ms = None  # valued at the next decision, with its estimates (they run every round)

    def lost(self, b: int, est: dict[Setting, Estimate] | None = None, best: Estimate | None = None) -> float:
        """What bucket b's exploration rounds lost, valued with the estimates now (est, best: if the
        caller has them): their time less the time the choice now takes for the tokens each arm gains by
        its estimate (by the rounds' draws, the budget would stop on bad luck). An arm that gains more
        than the choice for its time pays back what others lost."""
        k = self.bucket(b)
        if k.lost_ms is None:
            est = est or self.estimates(b)
            best = best or self.best(b, est)
            lost = 0.0
            for s, (took, n) in k.explored.items():
                lost += took - n * _choice_ms(est[s], best)
            k.lost_ms = max(lost, 0.0)
        return k.lost_ms

    def new_request(self) -> None:
        """A request starts alone: each gain starts from the mean of earlier requests' means (not from
        the last request's end), weighing at most NEW_REQUEST_CAP rounds."""
        for name, stats in (("gain", self.gain), ("step", self.step)):
            for s, st in stats.items():
                past = self.past.setdefault((name, s), Stat())
                if st.n >= SEEN:
                    past.decay(PAST_DISCOUNT)
                    past.add(st.mean)
                    st.mean = past.mean
                st.cap(NEW_REQUEST_CAP)


def _choice_ms(e: Estimate, best: Estimate) -> float:
    """The time the choice (best) takes for the tokens a round of e gains by its estimate (an arm not
    seen: what it surely gains; its guess is optimistic, the trees it covers gain at least that)."""
    return 1000.0 * (e.gain if e.seen else e.sure) / best.rate if best.rate > 0 else 0.0


def _spread(gain: float) -> float:
    """The least standard deviation a tree's gain of this mean has: GAIN_FLOOR and half its extra tokens."""
    return GAIN_FLOOR + 0.5 * (gain - 1.0)
