"""A measured cost model: milliseconds of a round's parts per batch bucket, and a round's prediction.

A round is draft -> expand -> build tree -> verify -> accept + commit + read back. The runner times
each part on the device through a small probe (below); this module holds the numbers and sums them:

    ar         round = ar                                      (one plain decoding step)
    chain      round = draft + expand['chain'] + verify(B) + other
    marginal   round = draft + expand['marginal'] + tree(N) + verify(N) + other
    treeflash  round = draft + expand(M, K) + tree(N) + verify(N) + other

`other` is the residual of a full round measured at a reference setting (acceptance, KV commit,
the host read-back): round - (draft + expand + tree + verify), at least 0. The marginal tree's
expansion (the drafter's own rows and a top-K, no head) is measured on its own: priced as the head's
cost at one parent row, as caches written before it was measured still do, it cost the demo pair's
marginal rounds 10 ms (a sixth) that they do not take.

All times are milliseconds for the whole bucket of b slots (one batched round); `verify` and
`tree` are keyed by nodes per slot (N), so slots x N nodes go through the verifier.

The probe protocol (the runner implements it; nothing here touches a tensor):

    probe.time_part(part: str, b: int, **params) -> float   # seconds of one call, synchronised
      'ar'                        one plain decoding step of b slots
      'draft'                     the drafter pass
      'verify', nodes=N           a verifier pass over N nodes per slot
      'expand', top_m=M, top_k=K  the expansion (transition tables)
      'expand', mode='chain'      the chain's argmax over the block
      'expand', mode='marginal', top_k=K   the marginal tree's tables (no head)
      'tree', tree_size=N         the tree build
      'round', setting=Setting    a whole round at that setting (for the residual)

The grid (see `Grid`) is small on purpose: on the 2-core CPU with SmolLM2-135M a verifier pass
takes 40-180 ms, so each point costs; about 17 points per bucket, each one warm-up call plus up
to `repeats` timed calls that stop early once they have spent `part_budget_s`.
"""

from __future__ import annotations

import bisect
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from .setting import TREE_SIZES, Setting

NAMED_EXPANSIONS = ("chain", "marginal")  # expansion costs kept by mode, not by (M, K)
# A part whose measurement takes longer than this (its first call compiling kernels, on a GPU) says so.
SLOW_PART_S = 3.0
# The plain step is timed before a bucket's parts, halfway through them and after the last (the fastest
# of STEADY_CALLS calls each, which transient noise hardly moves): when those differ by more than this
# factor, the machine's speed changed while the parts were timed (another job started or stopped), so
# some parts are off against others. Such a model serves the process that measured it but is not
# cached (`CostModel.unsteady`). Seen: a model measured while a second job ran
# on the demo pair's 2-core CPU priced an 8-node verification at 106 ms (61 measured again on a quiet
# machine), and its cache kept `make demo` on plain decoding at 23 tok/s, against 34 tok/s with trees.
STEADY_DRIFT = 1.25
STEADY_CALLS = 5


class Probe(Protocol):
    def time_part(self, part: str, b: int, **params) -> float: ...


def interpolate(points: dict, x: float) -> float:
    """Piecewise-linear through `points` (x -> y); outside the measured range, the line through
    the two nearest points (a constant with one point). Never below 0: a time."""
    if not points:
        raise ValueError("no measured points to interpolate")
    xs = sorted(points)
    if len(xs) == 1:
        return float(points[xs[0]])
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return float(points[x])
    i = min(max(i, 1), len(xs) - 1)  # the segment [xs[i-1], xs[i]], the end segments extended
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = points[x0], points[x1]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass
class BucketCosts:
    """Milliseconds of each part of a round of b slots.

    verify: nodes per slot -> ms. tree: nodes per slot -> ms. expand: (top_m, top_k) -> ms over the
    drafter's whole block, 'chain' -> ms for the chain's argmax and 'marginal' -> ms for the marginal
    tree's tables. block: the drafter's block size
    (0: unknown); a tree of N < block nodes expands only its first N positions
    (backends.pytorch.stages.expansion_depth), so its expansion is predicted without the rows it skips, at
    `row_ms` each.
    """

    ar: float
    draft: float
    verify: dict[int, float]
    expand: dict
    tree: dict[int, float]
    other: float = 0.0
    block: int = 0

    def expand_ms(self, top_m: int, top_k: int) -> float:
        """Bilinear over the measured (M, K) points: over M at each measured K, then over K."""
        by_k: dict[int, dict[int, float]] = {}
        for key, ms in self.expand.items():
            if not isinstance(key, str):
                by_k.setdefault(key[1], {})[key[0]] = ms
        return interpolate({k: interpolate(pts, top_m) for k, pts in by_k.items()}, top_k)

    def row_ms(self) -> float:
        """The expansion's cost per LM head row: its slope over the conditional rows between the two
        smallest measured M at one K (the rest, the head's weight reads and the top-K, does not shrink
        with the rows); 0 without two such points or the block size."""
        if not self.block:
            return 0.0
        for k in sorted({key[1] for key in self.expand if not isinstance(key, str)}, reverse=True):
            ms = sorted((key[0], v) for key, v in self.expand.items() if not isinstance(key, str) and key[1] == k)
            if len(ms) >= 2 and ms[1][0] > ms[0][0]:
                (m0, t0), (m1, t1) = ms[:2]
                return max(0.0, (t1 - t0) / ((self.block - 1) * (m1 - m0)))
        return 0.0

    def parts(self, s: Setting) -> dict[str, float]:
        """The predicted ms of each part of a round at setting s (they sum to the round)."""
        if s.mode == "ar":
            return {"ar": self.ar}
        if s.mode == "chain":
            expand = self.expand["chain"] if "chain" in self.expand else self.expand_ms(1, 1)
            return {"draft": self.draft, "expand": expand, "tree": 0.0,
                    "verify": interpolate(self.verify, s.tree_size), "other": self.other}
        m = 1 if s.mode == "marginal" else s.top_m
        expand = self.expand["marginal"] if s.mode == "marginal" and "marginal" in self.expand else \
            self.expand_ms(m, s.top_k)
        if 0 < s.tree_size < self.block:  # LM head rows: d positions' marginal ones, (d - 1) x M conditional ones
            rows = (lambda d: d + (d - 1) * m) if s.mode == "treeflash" else (lambda d: d)
            expand = max(0.0, expand - self.row_ms() * (rows(self.block) - rows(s.tree_size)))
        return {"draft": self.draft, "expand": expand, "tree": interpolate(self.tree, s.tree_size),
                "verify": interpolate(self.verify, s.tree_size), "other": self.other}

    def to_json(self) -> dict:
        return {"ar": self.ar, "draft": self.draft, "other": self.other, "block": self.block,
                "verify": {str(n): ms for n, ms in sorted(self.verify.items())},
                "tree": {str(n): ms for n, ms in sorted(self.tree.items())},
                "expand": {k if isinstance(k, str) else f"{k[0]},{k[1]}": ms for k, ms in self.expand.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "BucketCosts":
        """Raises KeyError, TypeError or ValueError on a malformed entry (the cache treats that as a miss)."""
        def ms(v) -> float:
            v = float(v)
            if not v >= 0:
                raise ValueError(f"a time must be >= 0, got {v}")
            return v

        expand = {k if k in NAMED_EXPANSIONS else tuple(int(x) for x in k.split(",", 1)): ms(v)
                  for k, v in d["expand"].items()}
        if any(not isinstance(k, str) and len(k) != 2 for k in expand):
            raise ValueError("expand keys are 'M,K', 'chain' or 'marginal'")
        return cls(ar=ms(d["ar"]), draft=ms(d["draft"]), other=ms(d["other"]), expand=expand,
                   verify={int(n): ms(v) for n, v in d["verify"].items()},
                   tree={int(n): ms(v) for n, v in d["tree"].items()}, block=int(d.get("block", 0)))


@dataclass
class CostModel:
    """Measured costs per batch bucket (slot count -> BucketCosts); predictions in ms per round."""

    buckets: dict[int, BucketCosts] = field(default_factory=dict)
    _memo: dict = field(default_factory=dict, repr=False, compare=False)
    # bucket -> how far the plain step's time moved while that bucket was measured (see STEADY_DRIFT);
    # not saved with the model.
    unsteady: dict[int, float] = field(default_factory=dict, repr=False, compare=False)

    def bucket_costs(self, b: int) -> BucketCosts:
        """The costs of the smallest measured bucket holding b slots (the runner pads to it)."""
        fits = [k for k in self.buckets if k >= b]
        if not fits:
            raise KeyError(f"no costs measured for a batch of {b} (measured: {sorted(self.buckets)})")
        return self.buckets[min(fits)]

    def round_ms(self, s: Setting, b: int = 1) -> float:
        """Predicted ms of one round at setting s for b slots (memoised: decisions run every round)."""
        key = (s, b)
        if key not in self._memo:
            self._memo[key] = sum(self.bucket_costs(b).parts(s).values())
        return self._memo[key]

    def parts(self, s: Setting, b: int = 1) -> dict[str, float]:
        return self.bucket_costs(b).parts(s)

    def merged(self, other: "CostModel") -> "CostModel":
        """These buckets plus other's (other's win where both have one)."""
        return CostModel({**self.buckets, **other.buckets}, unsteady={**self.unsteady, **other.unsteady})

    def to_json(self) -> dict:
        return {str(b): c.to_json() for b, c in sorted(self.buckets.items())}

    @classmethod
    def from_json(cls, d: dict) -> "CostModel":
        return cls({int(b): BucketCosts.from_json(c) for b, c in d.items()})


@dataclass(frozen=True)
class Grid:
    """Where `measure` times the parts (per bucket). Chosen for few points that bracket the
    candidates (N in 4..64, M in 1..16, K in 4..16), the rest interpolated:

    verify_nodes (4, 8, 16, 32, 64): every tree size the tuner chooses from (and the chain's B). A
        verifier pass is not affine in the nodes: on the 2-core CPU the demo pair's 4-node pass took
        as long as its 8-node one (59 and 58 ms; the matrix kernels change with the rows), so the
        8-node pass interpolated between 4 and 16 came out 6 ms (a tenth of it) too slow, a bias
        towards larger trees where N = 8 paid best. Flat then rising on a GPU.
    tree_sizes (4, 16, 64): the tree build is small next to the passes; three points bracket it.
    expand_m (1, 4, 16) at K = expand_k (16): the expansion's cost is (B-1) x M rows through the LM
        head; K only sizes a top-K, so one (the largest, an upper bound) is measured.
    reference: the setting of the full round timed for the residual `other`.
    block_size: the drafter's block (the expansion's rows scale with the positions a tree can reach).
    """

    verify_nodes: tuple[int, ...] = TREE_SIZES
    tree_sizes: tuple[int, ...] = (4, 16, 64)
    expand_m: tuple[int, ...] = (1, 4, 16)
    expand_k: tuple[int, ...] = (16,)
    chain: bool = True
    marginal: bool = True
    tree: bool = True
    reference: Setting = Setting("treeflash", 16, 4, 16)
    block_size: int = 0


def default_grid(modes: tuple[str, ...], block_size: int, max_tree_size: int = 64) -> Grid:
    """The grid for the modes this pair can run: sizes clipped to max_tree_size (keeping at least
    the largest allowed), no tree or expansion points without a tree mode."""
    def clip(ns):  # the points up to the largest allowed size, and that size itself
        kept = tuple(n for n in ns if n <= max_tree_size)
        return kept if max_tree_size >= max(ns) or max_tree_size in kept else kept + (max_tree_size,)

    tree = any(m in ("treeflash", "marginal") for m in modes)
    ref_mode = "treeflash" if "treeflash" in modes else "marginal" if "marginal" in modes else "chain"
    ref_n = block_size if ref_mode == "chain" else min(16, max_tree_size)
    # The reference uses a measured (M, K) point, so the residual holds no interpolation error.
    ref = Setting(ref_mode, ref_n, 4 if ref_mode == "treeflash" else 1, max(Grid.expand_k) if tree else 1)
    verify = clip(Grid.verify_nodes)
    if "chain" in modes and block_size not in verify:
        verify = tuple(sorted(verify + (block_size,)))
    return Grid(verify_nodes=verify if (tree or "chain" in modes) else (),
                tree_sizes=clip(Grid.tree_sizes) if tree else (),
                expand_m=Grid.expand_m if "treeflash" in modes else (),
                expand_k=Grid.expand_k if tree else (), chain="chain" in modes,
                marginal="marginal" in modes, tree=tree, reference=ref,
                block_size=block_size)


def _steps(grid: Grid) -> list[tuple[str, str, dict]]:
    """(part, progress text, probe params) for one bucket, in the order they are timed."""
    steps = [("ar", "a plain decoding step", {})]
    if not grid.verify_nodes:
        return steps  # plain decoding only: nothing else to time
    steps.append(("draft", "the drafter pass", {}))
    steps += [("verify", f"verify at {n} nodes", {"nodes": n}) for n in grid.verify_nodes]
    steps += [("expand", f"the expansion at M={m}, K={k}", {"top_m": m, "top_k": k})
              for k in grid.expand_k for m in grid.expand_m]
    if grid.chain:
        steps.append(("expand", "the chain's argmax", {"mode": "chain"}))
    if grid.marginal and grid.expand_k:  # K only sizes a top-K: the largest, an upper bound
        k = max(grid.expand_k)
        steps.append(("expand", f"the marginal tree's expansion at K={k}", {"mode": "marginal", "top_k": k}))
    steps += [("tree", f"the tree build at {n} nodes", {"tree_size": n}) for n in grid.tree_sizes]
    steps.append(("round", f"a full round ({grid.reference.label()})", {"setting": grid.reference}))
    return steps


def time_median(probe: Probe, part: str, b: int, params: dict, repeats: int, part_budget_s: float) -> float:
    """Median seconds of up to `repeats` calls after one warm-up (graphs, allocator, caches);
    stops early once the timed calls add up to part_budget_s (long parts vary little)."""
    probe.time_part(part, b, **params)
    times: list[float] = []
    while len(times) < max(1, repeats) and (not times or sum(times) < part_budget_s):
        times.append(float(probe.time_part(part, b, **params)))
    return statistics.median(times)


def time_min(probe: Probe, b: int, calls: int = STEADY_CALLS) -> float:
    """Milliseconds of the fastest of `calls` plain steps after one warm-up (the steadiness check)."""
    probe.time_part("ar", b)
    return 1000.0 * min(float(probe.time_part("ar", b)) for _ in range(calls))


def measure(probe: Probe, buckets: list[int], grid: Grid, log: Callable[[str], None] | None = None,
            repeats: int = 3, part_budget_s: float = 0.25) -> CostModel:
    """Times the grid's parts for each batch bucket through `probe`; progress lines go to `log`."""
    plan = _steps(grid)
    total, done = len(plan) * len(buckets), 0
    model = CostModel()
    for b in buckets:
        got: dict[str, dict] = {"verify": {}, "expand": {}, "tree": {}}
        scalars: dict[str, float] = {}
        check = len(plan) > 2  # a plain-only grid has nothing to be off against
        plain_ms = [time_min(probe, b)] if check else []  # the plain step before, halfway and at the end
        for i, (part, text, params) in enumerate(plan):
            if check and i == len(plan) // 2:
                plain_ms.append(time_min(probe, b))
            done += 1
            where = f"{text}{f' for {b} slots' if b != 1 else ''}"
            if log:
                log(f"tuning: measuring {where} ({done}/{total})")
            t0 = time.perf_counter()
            ms = 1000.0 * time_median(probe, part, b, params, repeats, part_budget_s)
            took = time.perf_counter() - t0
            if log and took > SLOW_PART_S:  # a stall the progress line alone would leave unexplained
                log(f"tuning: {where} took {took:.1f} s to measure, most of it its first call (on a GPU, "
                    f"kernels compiling for this shape and a graph captured; compiled kernels are cached for "
                    f"later runs)")
            if part == "verify":
                got["verify"][params["nodes"]] = ms
            elif part == "expand":
                got["expand"][params["mode"] if "mode" in params else (params["top_m"], params["top_k"])] = ms
            elif part == "tree":
                got["tree"][params["tree_size"]] = ms
            else:
                scalars[part] = ms
        if check:
            plain_ms.append(time_min(probe, b))
        if check and max(plain_ms) > STEADY_DRIFT * min(plain_ms):
            model.unsteady[b] = max(plain_ms) / min(plain_ms)
            if log:
                log(f"tuning: the plain step took {' then '.join(f'{t:.1f}' for t in plain_ms)} ms while the parts "
                    f"{f'for {b} slots ' if b != 1 else ''}were timed: the machine's speed changed (another job?), "
                    f"so these costs serve this process only and are measured again next time")
        costs = BucketCosts(ar=scalars["ar"], draft=scalars.get("draft", 0.0), block=grid.block_size, **got)
        if "round" in scalars:
            ref_parts = sum(costs.parts(grid.reference).values()) - costs.other
            costs.other = max(0.0, scalars["round"] - ref_parts)
        model.buckets[b] = costs
    return model


__all__ = ["BucketCosts", "CostModel", "Grid", "Probe", "default_grid", "interpolate", "measure",
           "time_median"]
