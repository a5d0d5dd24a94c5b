"""The tuner the runner asks each round: which setting to run, and what the round showed.

It ties the three parts together and adds exploration, because the acceptance model can only
predict a setting from a round whose tree held that setting's nodes (best-first trees are
prefix-closed, so a round predicts every smaller N, M and K of its family). Exploration is paid in
rounds that may be slower than the best known one, so it is kept cheap and stops once it cannot pay:

- seed: a family nothing has informed yet runs one round at its seed setting, the candidate with
  the best prior rate, prior tokens / predicted round ms, where the prior gains PRIOR_GAIN tokens
  per doubling of N (and a quarter of that per doubling of M), at the largest K (K barely changes
  a round's cost and the round then informs every smaller K). On a GPU at batch 1, where a large
  tree costs little more than a plain step, that is a large tree; on a small CPU a small one.
  A tree family then runs its best-predicted setting again, families in turn, until that
  prediction rests on `seed_rounds` rounds (3; at most that many seed rounds per family): one
  unlucky round (a drafter that misses the first tokens of an answer) would otherwise rule a
  family out for a whole generation, since refreshes come only every `explore_every` rounds. A
  deployment that resumes a learnt acceptance model has that support already and seeds nothing.
- growing: after each choice, the neighbours one step up (2N, 2M, 2K) that no round has fully
  observed get an optimistic estimate, the chosen point's tokens plus the larger of the last
  step's measured gain and the prior's gain (the expected tokens are concave in each field); a
  neighbour whose optimistic rate beats the choice by the hysteresis runs once. Once observed it
  is known, so growth stops where the gains stop paying.
- refreshing: every `explore_every` rounds of a bucket one round runs, in turn, the challenger
  (the best tree before the margins below, which one more round supports better) or the best
  setting of another family (or, while plain decoding is chosen, the best tree), so estimates of
  what is not being run stay current; the interval doubles (up to `max_explore_every`) while
  refreshing changes nothing, and a refresh waits until its round costs at most `explore_share`
  (5%) of the time spent since the last one (a tree round of 8 slots may cost several plain ones;
  with CUDA graphs an exploration round runs eagerly, outside the graphs, and costs what such rounds
  were seen to take: on an H200 at Qwen3-8B's shapes far more than a replay), and it is skipped
  when its setting is predicted below `refresh_floor` (75%) of the choice's rate (which doubles the
  interval too, as a refresh that changed nothing would).
- choosing seldom: the choice is made again only when a round has been observed, the current
  setting changed, the request changed or the cost corrections moved (5%); while plain decoding
  wins by far (its best tree predicted below `wide`, 75%, of its rate, corrections included) not
  for the corrections either, nor for a request that has not run a tree round yet.
- margin: a tree is chosen over plain decoding only when predicted `margin` faster (5%), and by
  more while few rounds support a setting's prediction (`required_margin`): the predictions err,
  most of all early, and the promise is never to be slower than plain decoding.
- confirming: while plain decoding is chosen only because few rounds support the best tree's
  prediction (the tree is predicted at least `margin` faster, but not by the doubt on top), that tree
  runs every `confirm_every`-th round: each such round is predicted faster than plain decoding, so
  it costs nothing expected, and it supports the prediction, which either holds (and the tree is
  chosen once its doubt is small enough) or falls below the margin (and the confirming stops).
- a new request (one sequence; `new_request`): refreshes start again at `explore_every`. (The
  request's own calibration follows the families it does not run through score probes, see
  online.TreeTuner.)
- settling: after `settle_after` choices in a bucket, TreeFlash's M and K stay at those chosen
  most, and only N (and the mode) is chosen per round: few settings per bucket (on a GPU each is
  a captured graph). A refresh round lets them move again.

    tuner = AutoTuner(cost, AcceptanceModel(), candidates, block_size=16)
    s = tuner.setting(bucket)            # the Setting to run this round
    tuner.observe(Observation(...))      # after verification
"""

from __future__ import annotations

import math
from collections import Counter

from treeflash_export.errors import ConfigError

from .acceptance import AcceptanceModel, Observation, RequestStream
from .cost import CostModel
from .policy import Choice, can_pay, choose
from .setting import PLAIN, Setting

PRIOR_GAIN = 0.75  # tokens gained per doubling of the tree before any round says otherwise
FAMILIES = ("treeflash", "marginal", "chain")
# Exploration rounds that run on the prior or an optimistic guess, not because their tree was predicted
# best of its kind (as the choice, a confirming round and a refresh are): what they gain says nothing of
# how far the predictions the tuner acts on are off (AcceptanceModel.realised_factor).
UNPREDICTED = ("seed", "grow")


class Realised:
    """The measured cost model, corrected by what rounds really take on the way (Python, read-backs,
    caches warmer or colder than the probe's): per bucket, a moving average of measured over predicted
    round time, one for plain decoding and one for trees, each kept within [0.5, 2]: the plain mean
    of the first observations (with the probe's 1.0 as one of them), then a moving average."""

    def __init__(self, model: CostModel, ema: float = 0.1):
        self.model, self.ema = model, ema
        self.ratio: dict[tuple[int, bool], float] = {}
        self.seen: dict[tuple[int, bool], int] = {}
        self._steps: dict[tuple[int, bool], tuple[float, int]] = {}  # key -> (ratio at the last step, steps)

    def round_ms(self, s: Setting, b: int = 1) -> float:
        return self.model.round_ms(s, b) * self.ratio.get((b, s.mode == "ar"), 1.0)

    def observe(self, s: Setting, b: int, ms: float) -> None:
        predicted = self.model.round_ms(s, b)
        if predicted <= 0 or ms <= 0:
            return
        key = (b, s.mode == "ar")
        r = min(2.0, max(0.5, ms / predicted))
        n = self.seen[key] = self.seen.get(key, 0) + 1
        # The plain mean with the probe's 1.0 as one observation at first (a few tree rounds already
        # correct it), then a moving average.
        a = max(self.ema, 1.0 / (n + 1))
        self.ratio[key] = (1 - a) * self.ratio.get(key, 1.0) + a * r

    def corrections(self, b: int) -> tuple[float, float]:
        """The corrections (plain decoding's, the trees') that scale bucket b's predicted rounds now."""
        return self.ratio.get((b, True), 1.0), self.ratio.get((b, False), 1.0)

    def version(self, b: int) -> tuple:
        """What the corrections are now: a count per ratio that steps when the ratio has moved 5% since
        its last step (a choice made under them is reused while it holds: the choice costs far more
        than a round of a small model, and a ratio hovering at a fixed boundary would step every few
        rounds)."""
        out = []
        for key in ((b, True), (b, False)):
            r = self.ratio.get(key, 1.0)
            at, steps = self._steps.get(key, (r, 0))
            if abs(math.log(r / at)) > 0.05:
                at, steps = r, steps + 1
            self._steps[key] = (at, steps)
            out.append(steps)
        return tuple(out)

    def __getattr__(self, name):  # everything else: the measured model's
        return getattr(self.model, name)


class AutoTuner:
    def __init__(self, cost: CostModel, acceptance: AcceptanceModel, candidates: list[Setting], block_size: int,
                 hysteresis: float = 0.03, explore_every: int = 32, plain: bool = True, settle_after: int = 16,
                 max_explore_every: int = 512, margin: float = 0.05, doubt: float = 0.2,
                 explore_share: float = 0.05, confirm_every: int = 4, seed_rounds: int = 3,
                 refresh_floor: float = 0.75, wide: float = 0.75):
        self.cost, self.acceptance, self.block_size = Realised(cost), acceptance, block_size
        self.candidates = list(candidates)
        self.hysteresis, self.plain, self.margin, self.doubt = hysteresis, plain, margin, doubt
        self.explore_share, self.confirm_every, self.seed_rounds = explore_share, confirm_every, seed_rounds
        self.refresh_floor, self.wide = refresh_floor, wide
        self._seeds: Counter = Counter()  # family -> seed rounds run
        self._seeded: set[str] = set()  # the families seeded enough
        self._grown: set[Setting] = set()  # the settings growth has run
        self._plain_since: Counter = Counter()  # bucket -> plain rounds since the last confirming one
        self.explore_every, self.max_explore_every, self.settle_after = explore_every, max_explore_every, settle_after
        self.current: dict[int, Setting] = {}
        self.choices: dict[int, Choice] = {}
        self.rounds = 0
        self.explored: Counter = Counter()  # why exploration rounds ran: seed, grow, refresh
        self.explore_reason: str | None = None  # why the last setting() explored (None: the choice)
        # bucket -> wall ms of an exploration round run outside the captured graphs (observed; see
        # observe_outside_time), which refreshes budget their share of time at
        self.outside_ms: dict[int, float] = {}
        self._gap: dict[int, int] = {}  # bucket -> rounds between refreshes
        self._since: Counter = Counter()  # bucket -> rounds since the last refresh
        self._refreshed: dict[int, Setting] = {}  # bucket -> the choice when a refresh ran
        self._due: dict[int, Setting | None] = {}  # bucket -> the refresh that waits for its time budget
        self._next_family = 0
        self._picked: dict[int, Counter] = {}  # bucket -> (M, K) of TreeFlash choices so far
        self.settled: dict[int, tuple[int, int]] = {}  # bucket -> TreeFlash's (M, K)
        # bucket -> (what the choice depended on, the choice, the cost corrections it was made under)
        self._memo: dict[int, tuple] = {}
        self._informed: set[str] = set()  # the families some round has informed
        self.exploring = False  # whether the last setting() was an exploration round
        self._families = [m for m in FAMILIES if any(s.mode == m for s in self.candidates)]

    # ------------------------------------------------------------------ what to explore
    def families(self) -> list[str]:
        return self._families

    def prior_tokens(self, s: Setting) -> float:
        if s.mode == "ar":
            return 1.0
        gain = PRIOR_GAIN * math.log2(max(s.tree_size, 1))
        if s.mode == "treeflash":
            gain += PRIOR_GAIN / 4 * math.log2(max(s.top_m, 1))
        return min(1.0 + gain, float(min(s.tree_size, self.block_size)))

    def seed_setting(self, family: str, bucket: int) -> Setting | None:
        """The family's first round: the candidate with the best prior rate among those at the family's
        largest K that could pay at all (None: none can)."""
        fam = [s for s in self.candidates if s.mode == family and can_pay(self.cost, s, bucket, self.block_size)]
        if not fam:
            return None
        k = max(s.top_k for s in fam)
        return max((s for s in fam if s.top_k == k),
                   key=lambda s: (self.prior_tokens(s) / max(self.cost.round_ms(s, bucket), 1e-9), -s.tree_size))

    def _known(self, family: str) -> bool:
        """Whether a round has informed the family (once it has, it stays informed)."""
        if family not in self._informed and any(self.acceptance.expected(s, None, self.block_size) is not None
                                                for s in self.candidates if s.mode == family):
            self._informed.add(family)
        return family in self._informed

    def _rate(self, s: Setting, tokens: float, bucket: int) -> float:
        return tokens / max(self.cost.round_ms(s, bucket), 1e-9)

    def _along(self, s: Setting, i: int) -> list:
        """The values of field i (1: N, 2: M, 3: K) among the candidates of s's mode that equal s in
        the other two fields, ascending."""
        return sorted({c[i] for c in self.candidates if c.mode == s.mode
                       and all(c[j] == s[j] for j in (1, 2, 3) if j != i)})

    def _up(self, s: Setting) -> list[Setting]:
        """s's candidates one step up in each field (same mode), the next larger value present."""
        out = []
        for i in (1, 2, 3):
            larger = [v for v in self._along(s, i) if v > s[i]]
            if larger:
                out.append(s._replace(**{s._fields[i]: larger[0]}))
        return out

    def _down(self, s: Setting, up: Setting) -> Setting | None:
        """The point as far below s as `up` is above it, in the field they differ in (when a candidate)."""
        i = next(j for j in (1, 2, 3) if s[j] != up[j])
        below = [v for v in self._along(s, i) if v < s[i]]
        return s._replace(**{s._fields[i]: below[-1]}) if below else None

    def grow_setting(self, choice: Choice, bucket: int) -> Setting | None:
        """A neighbour one step above the choice that no round has fully observed and whose optimistic
        rate beats the choice's by the hysteresis (the most promising one), else None."""
        s = choice.setting
        if s.mode not in ("treeflash", "marginal"):
            return None
        best, best_rate = None, self._rate(s, choice.tokens_per_round, bucket) * (1.0 + self.hysteresis)
        settled = self.settled.get(bucket)
        for up in self._up(s):
            if self.acceptance.observed(up) or up in self._grown or (settled and up.mode == "treeflash"
                                                                      and (up.top_m, up.top_k) != settled):
                continue
            down = self._down(s, up)
            measured = choice.tokens_per_round - (self.acceptance.expected(down, None, self.block_size) or 0.0) \
                if down is not None and self.acceptance.observed(down) else 0.0
            prior = self.prior_tokens(up) - self.prior_tokens(s)
            optimistic = min(choice.tokens_per_round + max(measured, prior), float(min(up.tree_size, self.block_size)))
            rate = self._rate(up, optimistic, bucket)
            if rate > best_rate and can_pay(self.cost, up, bucket, self.block_size):
                best, best_rate = up, rate
        return best

    # ------------------------------------------------------------------ the round's setting
    def _candidates(self, bucket: int) -> list[Setting]:
        settled = self.settled.get(bucket)
        if settled is None:
            return self.candidates
        return [s for s in self.candidates if s.mode != "treeflash" or (s.top_m, s.top_k) == settled]

    def _choose(self, bucket: int, stream: RequestStream | None) -> Choice | None:
        """The best tree (rates discounted by `tree_margin`), then that tree or plain decoding (the
        tree's rate discounted by `required_margin`)."""
        current = self.current.get(bucket)
        key = (self.acceptance.rounds, current, id(stream), self.cost.version(bucket))
        memo = self._memo.get(bucket)
        if memo is not None and (memo[0] == key or self._still_wide(bucket, memo, key, stream)):
            return memo[1]  # nothing observed since (plain rounds teach nothing)
        choice = self._choose_now(bucket, stream, current)
        self._memo[bucket] = (key, choice, self.cost.corrections(bucket))
        return choice

    def _still_wide(self, bucket: int, memo: tuple, key: tuple, stream: RequestStream | None) -> bool:
        """Whether a plain decoding choice made under other cost corrections (or for another request
        that has run no tree round yet) still stands, because plain decoding won by far: its best tree
        was predicted below `wide` of plain decoding's rate, and stays so once the corrections that
        moved since are applied (they scale all tree rounds of the bucket alike, and plain decoding's,
        so the best tree is the same one). On a small model whose round is a millisecond, choosing
        again each time a correction moves cost more than the tuner's whole budget."""
        (rounds, current, _, _), choice, then = memo
        return (rounds == key[0] and current == key[1] and not (stream is not None and stream.rounds)
                and self._wide(bucket, choice, then))

    def _wide(self, bucket: int, choice: Choice, then: tuple[float, float]) -> bool:
        """Whether this plain decoding choice, made under the corrections `then`, wins by far now: its
        best tree predicted below `wide` of plain decoding's rate with today's corrections."""
        if (choice is None or choice.setting != PLAIN or choice.runner_up_tokens_per_s is None
                or not choice.plain_tokens_per_s):
            return False
        (plain_then, tree_then), (plain_now, tree_now) = then, self.cost.corrections(bucket)
        moved = (tree_then / tree_now) * (plain_now / plain_then)
        return choice.runner_up_tokens_per_s * moved < self.wide * choice.plain_tokens_per_s

    def plain_by_far(self, bucket: int) -> bool:
        """Whether the bucket's latest choice is plain decoding by far (see _wide)."""
        memo = self._memo.get(bucket)
        return memo is not None and self._wide(bucket, memo[1], memo[2])

    def _choose_now(self, bucket: int, stream: RequestStream | None, current: Setting | None) -> Choice | None:
        try:
            best = choose(self.cost, self.acceptance, bucket, self._candidates(bucket), current, self.hysteresis,
                          stream, self.block_size, plain=False, margin=self.tree_margin)
        except ConfigError:  # no tree predictable yet (none could pay, so none was explored)
            return choose(self.cost, self.acceptance, bucket, [], None, 0.0, stream, self.block_size) \
                if self.plain else None
        if not self.plain:
            return best
        # Leaving plain decoding is gated by the margin alone (it already asks for more than the
        # hysteresis would); a running tree is kept within the hysteresis while it stays predicted
        # faster than plain decoding.
        return choose(self.cost, self.acceptance, bucket, [best.setting], current if current in (PLAIN, best.setting)
                      else None, 0.0 if current == PLAIN else self.hysteresis, stream, self.block_size, plain=True,
                      margin=self.required_margin)

    def _doubt(self, s: Setting) -> float:
        return self.doubt / (1.0 + self.acceptance.support(s)) ** 0.5

    def tree_margin(self, s: Setting) -> float:
        """The discount trees compete on among themselves: a little while few rounds support s."""
        return self._doubt(s) / 5

    def required_margin(self, s: Setting) -> float:
        """How much faster than plain decoding a tree must be predicted: `margin`, plus `doubt` while
        few rounds support the prediction of s (doubt / sqrt(1 + rounds); with the default 0.2: +14%
        after one round, +4% after 24, +2% after 99, beside the 5%). Among themselves trees compete
        with a fifth of that doubt (`tree_margin`), so a setting seen in one lucky round does not win
        over one seen in many (the largest of many noisy estimates is biased upwards) but a better
        one soon does."""
        return self.margin + self._doubt(s)

    def _best_tree(self, bucket: int, cands: list[Setting]) -> Setting | None:
        """The best-predicted of these settings that could pay, before any margin (None: none predictable)."""
        cands = [s for s in cands if s.mode != "ar" and can_pay(self.cost, s, bucket, self.block_size)]
        try:
            return choose(self.cost, self.acceptance, bucket, cands, None, 0.0, None, self.block_size,
                          plain=False).setting
        except ConfigError:
            return None

    def _refresh_setting(self, bucket: int, current: Setting | None) -> Setting | None:
        """The setting a refresh round runs, in turn: the challenger (the tree setting other than the
        current one with the best rate before the margins: the one the margins may be wrongly holding
        back, which one more round supports better), or the best-predicted setting of the next family
        other than the current one (any family while plain decoding runs), over all M and K."""
        self._next_family += 1
        if self._next_family % 2:
            challenger = self._best_tree(bucket, [s for s in self.candidates if s != current])
            if challenger is not None:
                return challenger
        fams = [f for f in self.families() if current is None or f != current.mode]
        for i in range(len(fams)):
            f = fams[(self._next_family // 2 + i) % len(fams)]
            best = self.best_of_mode(bucket, f)
            if best is not None:
                return best
        return None

    def setting(self, bucket: int = 1, stream: RequestStream | None = None) -> Setting:
        """The setting to run next at this batch bucket (``exploring`` says whether it is an exploration
        round rather than the choice)."""
        self.exploring, self.explore_reason = False, None
        seed = self._seed_round(bucket)
        if seed is not None:
            return self._explore("seed", seed)
        choice = self._choose(bucket, stream)
        if choice is None:
            return PLAIN if self.plain else self.candidates[0]
        previous = self._refreshed.pop(bucket, None)
        if previous is not None:  # the round after a refresh: did it change the choice?
            gap = self._gap.get(bucket, self.explore_every)
            self._gap[bucket] = self.explore_every if choice.setting != previous else min(2 * gap,
                                                                                           self.max_explore_every)
        self.choices[bucket] = choice
        self.current[bucket] = choice.setting
        self._settle(bucket, choice.setting)
        self._since[bucket] += 1
        if self.explore_every and self._since[bucket] >= self._gap.get(bucket, self.explore_every):
            # The refresh is picked once when it falls due, then waits: a refresh round may cost several
            # of the chosen ones, so it runs once it is at most `explore_share` of the time spent since
            # the last one.
            if bucket not in self._due:
                # While plain decoding wins by far every tree is predicted below the floor: no search.
                far = self.wide <= self.refresh_floor and self.plain_by_far(bucket)
                due = None if far else self._refresh_setting(bucket, choice.setting)
                rate = None if due is None else self.predicted_rate(due, bucket)
                # Not for a setting predicted far slower than the choice: its round would cost much
                # and could hardly change the choice (score probes follow it instead, where they run).
                if rate is None or rate < self.refresh_floor * choice.tokens_per_s:
                    # Skipped, as a refresh that changed nothing: the next one comes later.
                    due = None
                    self._gap[bucket] = min(2 * self._gap.get(bucket, self.explore_every), self.max_explore_every)
                self._due[bucket] = due
            refresh = self._due[bucket]
            spent = self._since[bucket] * self.cost.round_ms(choice.setting, bucket)
            if refresh is not None and self.exploration_ms(refresh, bucket) > self.explore_share * spent:
                refresh = None
            else:
                self._since[bucket] = 0
                del self._due[bucket]
            if refresh is not None:
                self._refreshed[bucket] = choice.setting
                self.settled.pop(bucket, None)
                self._picked.pop(bucket, None)
                self._memo.pop(bucket, None)
                return self._explore("refresh", refresh)
        confirm = self._confirm_setting(choice, bucket)
        if confirm is not None:
            return self._explore("confirm", confirm)
        grow = self.grow_setting(choice, bucket)
        if grow is not None:
            self._grown.add(grow)  # once: a tree whose drafts run out short of N is never seen whole
            return self._explore("grow", grow)
        return choice.setting

    def new_request(self) -> None:
        """One sequence's new request begins: refreshes start again at `explore_every` (a request unlike
        the last may change the choice)."""
        self._gap.clear()

    def best_of_mode(self, bucket: int, mode: str) -> Setting | None:
        """The best-predicted candidate of this mode that could pay, before any margin (None: none)."""
        return self._best_tree(bucket, [s for s in self.candidates if s.mode == mode])

    def predicted_rate(self, s: Setting, bucket: int, stream: RequestStream | None = None) -> float | None:
        """Expected tokens per second at s (None: no prediction)."""
        tokens = self.acceptance.expected(s, stream, self.block_size)
        return None if tokens is None else 1000.0 * self._rate(s, tokens, bucket)

    def _trusted(self, s: Setting) -> bool:
        """Whether about `seed_rounds` rounds support the prediction of s (the counts fade slowly)."""
        return self.acceptance.support(s) > self.seed_rounds - 0.5

    def _seed_round(self, bucket: int) -> Setting | None:
        """The seed round due now (see the module's notes): of the families that need one, the one
        seeded least so far (in FAMILIES order on a tie), else None."""
        due = []
        for f in self.families():
            if f in self._seeded:
                continue
            if not self._known(f):
                s = self.seed_setting(f, bucket)
            elif f == "chain" or self._seeds[f] >= self.seed_rounds:
                s = None
            else:
                s = self.best_of_mode(bucket, f)
                if s is not None and self._trusted(s):
                    s = None
            if s is None:
                if self._known(f):
                    self._seeded.add(f)
                continue
            due.append((self._seeds[f], s))
        if not due:
            return None
        s = min(due, key=lambda x: x[0])[1]
        self._seeds[s.mode] += 1
        return s

    def _explore(self, reason: str, s: Setting) -> Setting:
        self.explored[reason] += 1
        self.exploring, self.explore_reason = True, reason
        return s

    def exploration_ms(self, s: Setting, bucket: int) -> float:
        """What an exploration round at s costs: its predicted round, or, where such rounds run outside
        the captured graphs, what they were seen to take, whichever is more."""
        return max(self.cost.round_ms(s, bucket), self.outside_ms.get(bucket, 0.0))

    def observe_outside_time(self, bucket: int, ms: float) -> None:
        """How long an exploration round run outside the captured graphs took (on a GPU an eager round
        of a large model costs tens of replays): later refreshes at this bucket wait until that cost is
        at most `explore_share` of the time since the last one."""
        old = self.outside_ms.get(bucket)
        self.outside_ms[bucket] = ms if old is None else 0.7 * old + 0.3 * ms

    def _confirm_setting(self, choice: Choice, bucket: int) -> Setting | None:
        """The tree that a confirming round runs now (see the module's notes), else None."""
        tree = choice.runner_up
        if (not self.confirm_every or choice.setting != PLAIN or tree is None or tree.mode == "ar"
                or choice.runner_up_tokens_per_s < choice.plain_tokens_per_s * (1.0 + self.margin)):
            self._plain_since.pop(bucket, None)
            return None
        self._plain_since[bucket] += 1
        if self._plain_since[bucket] < self.confirm_every:
            return None
        self._plain_since[bucket] = 0
        return tree

    def _settle(self, bucket: int, s: Setting) -> None:
        if s.mode != "treeflash" or bucket in self.settled or not self.settle_after:
            return
        picked = self._picked.setdefault(bucket, Counter())
        picked[(s.top_m, s.top_k)] += 1
        if sum(picked.values()) >= self.settle_after:
            self.settled[bucket] = picked.most_common(1)[0][0]
            self._memo.pop(bucket, None)

    def observe_time(self, s: Setting, bucket: int, ms: float) -> None:
        """How long a round at s really took (wall clock, the whole round as the caller sees it)."""
        self.cost.observe(s, bucket, ms)

    def observe(self, obs: Observation | None, stream: RequestStream | None = None) -> None:
        """After a round: its observation (None for a plain decoding round, which teaches nothing)."""
        self.rounds += 1
        if obs is not None:
            self.acceptance.observe(obs, stream)

    def report(self) -> dict:
        """For --json: the latest choice per bucket, the rounds seen, exploration rounds by reason and
        TreeFlash's settled (M, K) per bucket."""
        return {"rounds": self.rounds, "choices": {str(b): c.to_json() for b, c in sorted(self.choices.items())},
                "exploration_rounds": dict(self.explored),
                "settled_top_m_top_k": {str(b): list(mk) for b, mk in sorted(self.settled.items())},
                "measured_over_predicted_ms": {f"{b} {'plain' if plain else 'tree'}": r
                                               for (b, plain), r in sorted(self.cost.ratio.items())}}
