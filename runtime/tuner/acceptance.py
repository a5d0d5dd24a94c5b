"""The acceptance model: expected tokens per round for every candidate setting, from the rounds.

TreeFlash's best-first trees are prefix-closed: the tree of n nodes is the first n nodes (in
best-first order) of a larger one, and restricting the tables to top-M' parents and top-K' children
keeps the nodes whose path has parent ranks < M' and child ranks < K'. Every node carries a path
score (the sum of the drafter's log-probabilities along its path). Tokens gained by a round =
1 + the number of accepted nodes, so

    E[tokens | tree] = 1 + sum over the tree's nodes of P(accepted | score).

P(accepted | score) is calibrated online: counts of accepted / seen nodes in log-prob bins, with a
Beta prior of `prior_strength` pseudo-observations centred on r * exp(score), the drafter's own
probability of the path scaled by its measured overconfidence r (Calibrator). Before any round it
predicts exp(score); with data it converges to the observed rates. Per node:
p = (acc[bin] + s * r * exp(score)) / (seen[bin] + s).

The decision uses many rounds, not one: for each tracked point (family, M, K, n) the model keeps an
exponential moving average over rounds of, per bin, the node count and the sum of exp(score) of the
first n-1 eligible nodes. Expected tokens are linear in those two statistics, so the average
expectation curve is recomputed under the *current* calibration at no cost:
    E(point) = 1 + sum_b count_b * acc_b / (seen_b + s) + sum_b expsum_b * s / (seen_b + s).
A point is 'fully observed' by a round when the round's tree held at least n-1 eligible nodes and
was built with M >= M', K >= K'; points never fully observed use the average of the partial sums,
a lower bound (a bigger tree only adds nodes).

Points are seen whole by different rounds (a large tree only in the rounds that built one), and a
point seen in a few lucky rounds would look better than one seen in many. So each point's gain is
scaled by a ratio: the reference point's (smallest N, M, K, which every tree holds) average gain
over all recent rounds, over its gain in the rounds that saw the point whole.

Families: 'treeflash' (head-conditional scores) and 'marginal' (marginal scores; chain rounds feed
its calibration too, their path is the marginal argmax). The chain keeps its own estimate: per-depth
acceptance given the parent was accepted, each with the same Beta prior centred on the drafter's
mean step probability at that depth; E = 1 + sum_d prod_{j<=d} q_j. Marginal rounds feed it too
(their rank-0 path is the chain).

A `RequestStream` holds one request's counts; its probabilities blend with the global ones
(the global calibration is the prior of the request's own counts), still linear in the statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .setting import TOP_KS, TOP_MS, TREE_SIZES, Setting

# Inner edges of the log-prob bins (path scores are <= 0): finer near 0, where most accepted nodes are.
BIN_EDGES = np.array([-12.0, -8.0, -6.0, -5.0, -4.0, -3.5, -3.0, -2.5, -2.0, -1.75, -1.5, -1.25, -1.0, -0.8, -0.6,
                      -0.45, -0.3, -0.2, -0.1, -0.05])
NBINS = len(BIN_EDGES) + 1
# A score within each bin, where a request's prior strength reads the deployment's probability (see
# Calibrator.coefficients): the middle of each inner bin, a point inside each outer one.
BIN_MIDS = np.concatenate([[BIN_EDGES[0] - 1.0], (BIN_EDGES[:-1] + BIN_EDGES[1:]) / 2, [BIN_EDGES[-1] / 2]])
_EXP_BIN_MIDS = np.exp(BIN_MIDS)
PRIOR_ACCEPTED = 2.0  # a request's prior in a bin is worth at least this many accepted nodes
MAX_BLEND = 2000.0  # ... and at most this many nodes (a bin almost never accepted)
PRIOR_FIT_BELOW = -0.5  # the nodes the prior's scale is fitted on (near-certain ones say little)
PRIOR_FIT_STRENGTH = 8.0  # pseudo-nodes' worth of expected acceptance at r = 1 (one unlucky round moves it little)
PRIOR_RANGE = (0.2, 1.5)
# The realised factor (AcceptanceModel.realised_factor): the weight of the newest round of a chosen tree
# in its moving sums, the tokens on both sides before any round, and its range.
REALISED_EMA = 0.02
REALISED_PRIOR = 8.0
REALISED_RANGE = (0.5, 1.25)


def bins_of(scores: np.ndarray) -> np.ndarray:
    return np.searchsorted(BIN_EDGES, scores, side="right")


@dataclass
class Observation:
    """One verified round. Arrays in best-first order, root excluded, length n-1 unless stated.

    mode: 'treeflash', 'marginal' or 'chain'. top_m, top_k: the settings its tables were built with.
    scores: float, path log-probs (<= 0). accepted: bool, length <= n-1 (the verified prefix; nodes
    past it were scored but not verified and only predict). depth: int >= 1 (needed for chain
    rounds only if the nodes are not in depth order). m_rank, k_rank: int, the largest parent rank
    and child rank along the node's path (None: no subsetting by M or K from this round).
    """

    mode: str
    scores: np.ndarray
    accepted: np.ndarray
    top_m: int = 1
    top_k: int = 1
    depth: np.ndarray | None = None
    m_rank: np.ndarray | None = None
    k_rank: np.ndarray | None = None


class Calibrator:
    """P(accepted | path score): binned counts with a Beta prior centred on a per-node prior mean,
    r * exp(score). r is the drafter's overconfidence away from certainty: accepted over expected
    (sum of exp(score)) among the labelled nodes scored below PRIOR_FIT_BELOW, with PRIOR_FIT_STRENGTH
    at r = 1, kept within PRIOR_RANGE. A drafter that is right half as often as it claims then
    predicts half as much in the bins no round has filled yet (large trees' lower nodes, early on)."""

    def __init__(self, prior_strength: float = 4.0, decay: float = 1.0):
        self.s, self.decay = float(prior_strength), float(decay)
        self.acc = np.zeros(NBINS)
        self.seen = np.zeros(NBINS)
        self.fit_acc = 0.0  # accepted nodes scored below PRIOR_FIT_BELOW
        self.fit_exp = 0.0  # their sum of exp(score)

    def update(self, scores: np.ndarray, accepted: np.ndarray) -> None:
        if self.decay != 1.0:  # forget slowly, so the rates follow drift in the traffic
            self.acc *= self.decay
            self.seen *= self.decay
            self.fit_acc *= self.decay
            self.fit_exp *= self.decay
        b = bins_of(scores)
        np.add.at(self.seen, b, 1.0)
        np.add.at(self.acc, b, accepted.astype(float))
        low = scores < PRIOR_FIT_BELOW
        self.fit_acc += float(accepted[low].sum())
        self.fit_exp += float(np.exp(scores[low]).sum())

    @property
    def prior_scale(self) -> float:
        return float(np.clip((self.fit_acc + PRIOR_FIT_STRENGTH) / (self.fit_exp + PRIOR_FIT_STRENGTH), *PRIOR_RANGE))

    def coefficients(self, outer: "Calibrator | None" = None, blend: float = 16.0) -> tuple[np.ndarray, np.ndarray]:
        """(alpha, beta) per bin such that p(node) = alpha[bin] + beta[bin] * exp(score).

        With `outer` (the deployment's calibrator) these are a request's own counts with the outer
        probability as their prior, of strength `blend` nodes, and in a bin whose outer probability p
        is small, of PRIOR_ACCEPTED / p nodes (at most MAX_BLEND): a prior worth at least that many
        accepted nodes. With 4 nodes everywhere, one accepted node of two in a bin accepted 2% of the
        time made it 18% for the request. Labelled in hindsight (one run of the demo pair: two demo
        prompts and six held-out chat requests), the unverified half of the rounds' reported trees,
        the nodes a larger tree would add, held 10 accepted nodes of 241; the requests' calibration
        predicted 12.1 with 4 nodes, 10.6 with this prior, the deployment's alone 10.0."""
        if outer is None:
            a = self.acc / (self.seen + self.s)
            b = self.s * self.prior_scale / (self.seen + self.s)
            return a, b
        ga, gb = outer.coefficients()
        p = np.clip(ga + gb * _EXP_BIN_MIDS, PRIOR_ACCEPTED / MAX_BLEND, 1.0)
        strength = np.maximum(blend, PRIOR_ACCEPTED / p)
        denom = self.seen + strength
        return (self.acc + strength * ga) / denom, strength * gb / denom

    def probability(self, scores: np.ndarray, outer: "Calibrator | None" = None, blend: float = 16.0) -> np.ndarray:
        a, b = self.coefficients(outer, blend)
        k = bins_of(scores)
        return np.clip(a[k] + b[k] * np.exp(np.minimum(scores, 0.0)), 0.0, 1.0)


class ChainEstimate:
    """Per-depth acceptance of the chain (depth d accepted given d-1 accepted), Beta-smoothed."""

    def __init__(self, prior_strength: float = 4.0, decay: float = 1.0):
        self.s, self.decay = float(prior_strength), float(decay)
        self.reached: dict[int, float] = {}
        self.acc: dict[int, float] = {}
        self.step_p: dict[int, tuple[float, float]] = {}  # depth -> (sum of exp(step lp), count)

    def update(self, step_lp: np.ndarray, n_accepted: int) -> None:
        """step_lp: [D] the chain's per-depth log-probs (depth 1..D); n_accepted: its accepted prefix."""
        for store in (self.reached, self.acc):
            for d in store:
                store[d] *= self.decay
        for d, lp in enumerate(step_lp, start=1):
            tot, cnt = self.step_p.get(d, (0.0, 0.0))
            self.step_p[d] = (tot * self.decay + float(np.exp(min(lp, 0.0))), cnt * self.decay + 1.0)
            if d <= n_accepted + 1:  # its parent was accepted: this depth was tried
                self.reached[d] = self.reached.get(d, 0.0) + 1.0
                self.acc[d] = self.acc.get(d, 0.0) + float(d <= n_accepted)

    def expected_tokens(self, block_size: int) -> float | None:
        if not self.step_p:
            return None
        total, prod = 1.0, 1.0
        for d in range(1, block_size):
            tot, cnt = self.step_p.get(d, self.step_p[max(self.step_p)])  # deeper than seen: the deepest prior
            prior = tot / cnt
            prod *= (self.acc.get(d, 0.0) + self.s * prior) / (self.reached.get(d, 0.0) + self.s)
            total += prod
        return total


class RequestStream:
    """One request's own calibration counts (no decay), blended with the deployment's."""

    def __init__(self, blend: float = 4.0):
        self.blend = blend
        self.calibrators = {"treeflash": Calibrator(), "marginal": Calibrator()}
        self.rounds = 0


def _family(mode: str) -> str:
    return "treeflash" if mode == "treeflash" else "marginal"


class AcceptanceModel:
    """Calibrated acceptance across the deployment, and the averaged expectation curves.

    sizes, top_ms, top_ks: the tracked tree sizes N and (M, K) values (the candidates').
    ema: the weight of the newest round in the averages (0.05: about the last 20 rounds).
    """

    def __init__(self, sizes=TREE_SIZES, top_ms=TOP_MS, top_ks=TOP_KS, ema: float = 0.05,
                 prior_strength: float = 4.0, decay: float = 0.995):
        self.sizes = np.array(sorted(sizes))
        self.ema = ema
        self.calibrators = {f: Calibrator(prior_strength, decay) for f in ("treeflash", "marginal")}
        self.chain = ChainEstimate(prior_strength, decay)
        # Ascending, so combos[0] at sizes[0] is the reference point every tree holds (see expected).
        self.combos = {"treeflash": [(m, k) for m in sorted(top_ms) for k in sorted(top_ks)],
                       "marginal": [(1, k) for k in sorted(top_ks)]}
        shape = lambda f: (len(self.combos[f]), len(self.sizes))  # noqa: E731
        # Per family: statistics [combos, sizes, 2 * NBINS] (counts, then exp-sums) and their EMA weights.
        self.full = {f: np.zeros((*shape(f), 2 * NBINS)) for f in self.combos}
        self.full_w = {f: np.zeros(shape(f)) for f in self.combos}
        # The reference point's statistics over the same rounds as each point's `full` average (see expected).
        self.full_ref = {f: np.zeros((*shape(f), 2 * NBINS)) for f in self.combos}
        self.partial = {f: np.zeros((*shape(f), 2 * NBINS)) for f in self.combos}
        self.partial_w = {f: np.zeros(shape(f)) for f in self.combos}
        # How many rounds informed each point (seen whole, or at all), forgotten as slowly as the
        # calibration: the support of its prediction (the averages' weights cannot say it, a new
        # request's first round weighs half of them).
        self.count_decay = decay
        self.full_n = {f: np.zeros(shape(f)) for f in self.combos}
        self.partial_n = {f: np.zeros(shape(f)) for f in self.combos}
        self.rounds = 0
        self.realised = (0.0, 0.0)  # moving sums of the gains realised and predicted (see realised_factor)
        self.recorder = None  # a replay.Recording that records what this model is taught, if any
        self._coef_memo: dict = {}
        self._combo_at = {f: {mk: i for i, mk in enumerate(c)} for f, c in self.combos.items()}
        self._size_at = {int(n): i for i, n in enumerate(self.sizes)}
        # Per point, the rounds that updated its average since restart_averages, seen whole and seen at
        # all (inf: none called, the moving average). Per point, not per family: with one count per
        # family, rounds that did not update a point (score probes of smaller trees, rounds of another
        # N) used up its plain mean, so a request's first round of a point weighed about a fifth of the
        # average after ten of its own rounds, where it should weigh a twelfth: on held-out chat
        # TreeFlash N=16 was predicted at 3.1 tokens a round for twenty rounds while its rounds' own
        # nodes predicted (and gained) about 2.3.
        self._fresh = {f: {k: np.full(shape(f), np.inf) for k in ("full", "partial")} for f in self.combos}

    def restart_averages(self) -> None:
        """The next rounds weigh more in the averages (see _observe_curves): a new request begins."""
        if self.recorder is not None:
            self.recorder.restart()
        for f in self._fresh.values():
            for k in f.values():
                k[...] = 0.0

    # ---- learning --------------------------------------------------------------------------
    def observe(self, obs: Observation, stream: RequestStream | None = None, deployment: bool = True) -> None:
        """Feeds one round to the calibration, the averages and the chain estimate. A round whose
        nodes carry no labels feeds the averages only. deployment=False (a score probe labelled in
        hindsight): its labels calibrate the request's stream but not the deployment's calibration,
        because probes run where their tree is not chosen (plain decoding's requests, the other
        family's), and counts from there alone would make that family look worse everywhere."""
        scores = np.asarray(obs.scores, dtype=float)
        accepted = np.asarray(obs.accepted, dtype=bool)
        if len(accepted) > len(scores):
            raise ValueError(f"{len(accepted)} acceptance labels for {len(scores)} scored nodes")
        if self.recorder is not None:
            self.recorder.observe(obs, stream, deployment)
        fam = _family(obs.mode)
        self._coef_memo.clear()
        self.rounds += 1
        if not len(accepted):
            if obs.mode != "chain":
                self._observe_curves(fam, obs, scores)
            return
        labelled = scores[: len(accepted)]
        if deployment:
            self.calibrators[fam].update(labelled, accepted)
        if stream is not None:
            stream.calibrators[fam].update(labelled, accepted)
            stream.rounds += 1
        if obs.mode == "chain":
            self._observe_chain(scores, accepted)
            return
        if obs.mode == "marginal" and obs.k_rank is not None:
            on_chain = np.asarray(obs.k_rank) == 0
            if on_chain.any():  # best-first puts a path in depth order: its scores decrease
                self._observe_chain(scores[on_chain], accepted[on_chain[: len(accepted)]])
        self._observe_curves(fam, obs, scores)

    def _observe_chain(self, path_scores: np.ndarray, accepted: np.ndarray) -> None:
        step = np.diff(np.concatenate([[0.0], path_scores]))
        n_acc = int(np.argmin(accepted)) if not accepted.all() else len(accepted)  # the accepted prefix
        self.chain.update(step[: len(accepted)], n_acc)  # only the verified depths count

    def _observe_curves(self, fam: str, obs: Observation, scores: np.ndarray) -> None:
        """Updates every tracked (M, K, n) point of the family at once (about 0.1 ms for 64 nodes)."""
        n = len(scores)
        onehot = np.zeros((n, 2 * NBINS))  # [nodes, 2 * NBINS]: the node's bin, then exp(score) in it
        b = bins_of(scores)
        onehot[np.arange(n), b] = 1.0
        onehot[np.arange(n), NBINS + b] = np.exp(np.minimum(scores, 0.0))
        m_rank = np.zeros(n, int) if obs.m_rank is None else np.asarray(obs.m_rank)
        k_rank = np.zeros(n, int) if obs.k_rank is None else np.asarray(obs.k_rank)
        obs_m = 1 if fam == "marginal" else obs.top_m
        ms = np.array([m for m, _ in self.combos[fam]])  # [C]
        ks = np.array([k for _, k in self.combos[fam]])
        # Without ranks a round predicts only its own (M, K).
        informed = np.ones(len(ms), bool)  # [C]
        if obs.m_rank is None:
            informed &= ms == obs_m
        if obs.k_rank is None:
            informed &= ks == obs.top_k
        elig = (m_rank[None, :] < ms[:, None]) & (k_rank[None, :] < ks[:, None])  # [C, nodes]
        order = np.cumsum(elig, axis=1)  # [C, nodes]: 1-based place of a node among the eligible
        take = elig[:, None, :] & (order[:, None, :] <= (self.sizes - 1)[None, :, None])  # [C, S, nodes]
        stats = take.astype(float) @ onehot  # [C, S, 2 * NBINS]: the first n-1 eligible nodes' statistics
        have = elig.sum(axis=1)  # [C]
        full = ((self.sizes[None, :] - 1 <= have[:, None]) & (ms <= obs_m)[:, None] & (ks <= obs.top_k)[:, None]
                & informed[:, None])  # [C, S]
        part = np.broadcast_to(informed[:, None], full.shape)
        if not full[0, 0]:  # rare (a round too small for the reference): its points keep their reference in step
            full = np.zeros_like(full)
        for kind, upd, vals, wts, cnt in (
                ("partial", part, self.partial[fam], self.partial_w[fam], self.partial_n[fam]),
                ("full", full, self.full[fam], self.full_w[fam], self.full_n[fam])):
            # After restart_averages a point's rounds weigh as a plain mean with the past as one of them
            # (1/2, 1/3, ...) until that falls to `ema`: a new request's scores replace the old
            # traffic's quickly.
            fresh = self._fresh[fam][kind]
            fresh[upd] += 1.0
            a = np.maximum(self.ema, 1.0 / (fresh[upd] + 1.0))[:, None]  # [updated points, 1]
            if kind == "full":  # the reference point (smallest M, K and N) beside every point seen whole
                ref = self.full_ref[fam]
                ref[upd] = (1 - a) * ref[upd] + a * stats[0, 0]
            vals[upd] = (1 - a) * vals[upd] + a * stats[upd]
            wts[upd] = (1 - a[:, 0]) * wts[upd] + a[:, 0]
            cnt *= self.count_decay
            cnt[upd] += 1.0

    # ---- predicting ------------------------------------------------------------------------
    def _coef(self, fam: str, stream: RequestStream | None) -> np.ndarray:
        """[2 * NBINS]: the current calibration as weights of the statistics (memoised until the next round)."""
        key = (fam, id(stream))
        if key not in self._coef_memo:
            g = self.calibrators[fam]
            alpha, beta = g.coefficients() if stream is None else stream.calibrators[fam].coefficients(g, stream.blend)
            self._coef_memo[key] = np.concatenate([alpha, beta])
        return self._coef_memo[key]

    def expected_tokens(self, obs: Observation, n: int, top_m: int | None = None, top_k: int | None = None,
                        stream: RequestStream | None = None) -> float:
        """Expected tokens of one round's tree cut to n nodes and (M, K): 1 + the calibrated
        probabilities of its first n-1 eligible nodes (ranks < M, K where the round has them)."""
        scores = np.asarray(obs.scores, dtype=float)
        elig = np.ones(len(scores), bool)
        if top_m is not None and obs.m_rank is not None:
            elig &= np.asarray(obs.m_rank) < top_m
        if top_k is not None and obs.k_rank is not None:
            elig &= np.asarray(obs.k_rank) < top_k
        fam, nodes = _family(obs.mode), scores[elig][: max(n - 1, 0)]
        outer = self.calibrators[fam]
        # A request's counts blend with the deployment's as in the choice (RequestStream.blend).
        p = outer.probability(nodes) if stream is None else \
            stream.calibrators[fam].probability(nodes, outer, stream.blend)
        return 1.0 + float(p.sum())

    def expected(self, s: Setting, stream: RequestStream | None = None, block_size: int | None = None,
                 raw: bool = False) -> float | None:
        """Average expected tokens per round at setting s over recent rounds, its gain scaled by the
        realised factor (see `realised_factor`; raw: not scaled); None when no round has informed it
        yet (the tuner explores first). Plain decoding: 1."""
        tokens = self._expected(s, stream, block_size)
        if raw or tokens is None or s.mode == "ar":
            return tokens
        return 1.0 + self.realised_factor() * (tokens - 1.0)

    # ---- what the predicted trees really gained -----------------------------------------------
    def realised_factor(self) -> float:
        """What the trees run as the best predicted of their kind gained (in their rounds, or in
        hindsight for score probes) over what was predicted for them, tokens beyond the first, as
        moving sums over about the last 1 / REALISED_EMA of them with REALISED_PRIOR tokens on both
        sides, within REALISED_RANGE (see online.TreeTuner for which rounds count). A tree runs when
        its prediction is high, and a prediction is high partly by luck (easy rounds just before, the
        best of many noisy estimates), so the rounds that follow gain less than predicted. Replayed
        over the rounds of 30 held-out requests, the chosen tree's prediction was 0.33 tokens a round
        above its gain (0.59 on everyday chat) while the nodes of those very rounds, calibrated,
        predicted within 0.13; scaled by this factor (counting the chosen rounds only), the
        prediction's bias was 0.02 and its mean error fell from 0.93 to 0.83 tokens. The prior of
        REALISED_PRIOR tokens keeps a first contact's few unlucky rounds from taking the trees off at
        once (with 2 tokens, `make demo`'s prompt ran plain decoding in 42 of its first 94 rounds)."""
        g, p = self.realised
        return float(np.clip((g + REALISED_PRIOR) / (p + REALISED_PRIOR), *REALISED_RANGE))

    def observe_gain(self, predicted: float, gained: float) -> None:
        """A tree predicted best of its kind ran (or was probed): ``predicted`` tokens (the unscaled
        prediction it ran on) and ``gained`` tokens."""
        g, p = self.realised
        self.realised = ((1 - REALISED_EMA) * g + (gained - 1.0), (1 - REALISED_EMA) * p + (predicted - 1.0))

    def _expected(self, s: Setting, stream: RequestStream | None, block_size: int | None) -> float | None:
        if s.mode == "ar":
            return 1.0
        if s.mode == "chain":
            return self.chain.expected_tokens(block_size or s.tree_size)
        fam = _family(s.mode)
        m = 1 if fam == "marginal" else s.top_m
        c, i = self._combo_at[fam].get((m, s.top_k)), self._size_at.get(s.tree_size)
        if c is None or i is None:
            return None
        coef = self._coef(fam, stream)
        if self.full_w[fam][c, i] > 0:
            w = self.full_w[fam][c, i]
            gain = float(self.full[fam][c, i] @ coef) / w
            # The rounds that saw this point whole may have been luckier (or not) than recent traffic:
            # correct its gain by the reference point's, over all recent rounds against over those same
            # rounds, so settings seen in different rounds compare fairly. Of the two corrections, the
            # ratio (the gain scaled as the reference's) and the shift (the gain moved by as much as the
            # reference's), the lower: a ratio over a few hard old rounds scaled a large tree's gain to
            # three times what it gained, and a shift on a harder request keeps too much.
            same = float(self.full_ref[fam][c, i] @ coef) / w
            recent = float(self.full[fam][0, 0] @ coef) / self.full_w[fam][0, 0]
            if same > 1e-6 and recent > 0:
                gain = min(gain * recent / same, gain + recent - same)
            most = min(s.tree_size, block_size) - 1 if block_size else s.tree_size - 1
            return 1.0 + min(max(gain, 0.0), float(most))
        if self.partial_w[fam][c, i] > 0:
            return 1.0 + float(self.partial[fam][c, i] @ coef) / self.partial_w[fam][c, i]
        return None

    # ---- persistence ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        """The learnt state (calibration counts, chain rates, expectation curves) as plain JSON."""
        arr = lambda a: np.asarray(a).tolist()  # noqa: E731
        return {"bins": arr(BIN_EDGES), "sizes": arr(self.sizes), "combos": {f: [list(c) for c in cs]
                                                                           for f, cs in self.combos.items()},
                "ema": self.ema, "rounds": self.rounds, "realised": list(self.realised),
                "calibrators": {f: {"acc": arr(c.acc), "seen": arr(c.seen), "fit": [c.fit_acc, c.fit_exp]}
                                for f, c in self.calibrators.items()},
                "chain": {"reached": {str(d): v for d, v in self.chain.reached.items()},
                          "acc": {str(d): v for d, v in self.chain.acc.items()},
                          "step_p": {str(d): list(v) for d, v in self.chain.step_p.items()}},
                "curves": {f: {"full": arr(self.full[f]), "full_w": arr(self.full_w[f]), "full_ref": arr(self.full_ref[f]),
                               "partial": arr(self.partial[f]), "partial_w": arr(self.partial_w[f]),
                               "full_n": arr(self.full_n[f]), "partial_n": arr(self.partial_n[f])}
                           for f in self.combos}}

    def load_json(self, d: dict, max_seen: float = 256.0) -> None:
        """Takes a state saved by `to_json` from a model with the same bins, sizes and (M, K) points
        (ValueError otherwise, the model unchanged). Calibration counts are scaled down to at most
        ``max_seen`` nodes per bin, so what the new rounds show soon outweighs the old traffic."""
        same = (d["bins"] == BIN_EDGES.tolist() and d["sizes"] == self.sizes.tolist()
                and d["combos"] == {f: [list(c) for c in cs] for f, cs in self.combos.items()})
        if not same:
            raise ValueError("saved for other bins, tree sizes or (M, K) points")
        shaped = {}
        for f in self.combos:
            c = d["curves"][f]
            shaped[f] = {k: np.asarray(c[k], dtype=float) for k in ("full", "full_w", "full_ref", "partial", "partial_w")}
            for k in ("full", "partial"):  # a state saved before the counts: the rounds its weights imply
                n = c.get(f"{k}_n")
                shaped[f][f"{k}_n"] = (np.asarray(n, dtype=float) if n is not None
                                       else self._rounds_of(shaped[f][f"{k}_w"]))
            if (shaped[f]["full"].shape != self.full[f].shape or shaped[f]["full_w"].shape != self.full_w[f].shape
                    or shaped[f]["full_ref"].shape != self.full[f].shape
                    or any(shaped[f][k].shape != self.full_w[f].shape for k in ("full_n", "partial_n"))):
                raise ValueError(f"curves of family {f} have another shape")
        cals = {}
        for f in self.calibrators:
            acc, seen = (np.asarray(d["calibrators"][f][k], dtype=float) for k in ("acc", "seen"))
            if acc.shape != (NBINS,) or seen.shape != (NBINS,) or (acc < 0).any() or (acc > seen + 1e-9).any():
                raise ValueError(f"calibration counts of family {f} are malformed")
            scale = np.minimum(1.0, max_seen / np.maximum(seen, 1e-9))
            fit = [float(x) for x in d["calibrators"][f].get("fit", (0.0, 0.0))]  # absent: saved before the fit
            if len(fit) != 2 or min(fit) < 0:
                raise ValueError(f"calibration counts of family {f} are malformed")
            shrink = min(1.0, max_seen / max(fit[1], 1e-9))
            cals[f] = (acc * scale, seen * scale, fit[0] * shrink, fit[1] * shrink)
        realised = tuple(float(x) for x in d.get("realised", (0.0, 0.0)))  # absent: saved before it
        if len(realised) != 2 or not all(np.isfinite(x) and x >= 0 for x in realised):
            raise ValueError("the realised gains are malformed")
        ch = d["chain"]
        chain = ({int(k): float(v) for k, v in ch["reached"].items()}, {int(k): float(v) for k, v in ch["acc"].items()},
                 {int(k): (float(v[0]), float(v[1])) for k, v in ch["step_p"].items()})
        for f, (acc, seen, fit_acc, fit_exp) in cals.items():  # nothing is changed before everything is read
            c = self.calibrators[f]
            c.acc, c.seen, c.fit_acc, c.fit_exp = acc, seen, fit_acc, fit_exp
        for f, c in shaped.items():
            self.full[f], self.full_w[f], self.full_ref[f], self.partial[f], self.partial_w[f] = (
                c["full"], c["full_w"], c["full_ref"], c["partial"], c["partial_w"])
            self.full_n[f], self.partial_n[f] = c["full_n"], c["partial_n"]
        self.chain.reached, self.chain.acc, self.chain.step_p = chain
        self.rounds = int(d.get("rounds", 0))
        self.realised = realised
        self._coef_memo.clear()

    def support(self, s: Setting) -> float:
        """How many rounds inform the prediction of s (slowly forgotten: see count_decay): those that
        saw its tree whole, else those that saw part of it; the chain: the rounds that reached depth 1."""
        if s.mode == "ar":
            return float("inf")
        if s.mode == "chain":
            return float(self.chain.reached.get(1, 0.0))
        fam = _family(s.mode)
        c = self._combo_at[fam].get((1 if fam == "marginal" else s.top_m, s.top_k))
        i = self._size_at.get(s.tree_size)
        if c is None or i is None:
            return 0.0
        return float(self.full_n[fam][c, i] if self.full_w[fam][c, i] > 0 else self.partial_n[fam][c, i])

    def _rounds_of(self, w: np.ndarray) -> np.ndarray:
        """The rounds a moving average's weights imply (a weight w after n rounds is 1 - (1 - ema)^n)."""
        return np.log1p(-np.minimum(w, 1 - 1e-12)) / np.log1p(-self.ema)

    def observed(self, s: Setting) -> bool:
        """Whether some round held the whole of setting s's tree (its prediction is not a lower bound)."""
        if s.mode in ("ar", "chain"):
            return s.mode == "ar" or bool(self.chain.step_p)
        fam = _family(s.mode)
        c = self._combo_at[fam].get((1 if fam == "marginal" else s.top_m, s.top_k))
        i = self._size_at.get(s.tree_size)
        return c is not None and i is not None and bool(self.full_w[fam][c, i] > 0)
