"""The prior: each candidate's round time measured once through the runner's cost probe (whole rounds
on a dummy prompt, not parts summed), which orders exploration and prices the arms that have not run.
Real rounds override it (rule.py).

The probe protocol (the runner implements it; nothing here touches a tensor):

    probe.time_part('ar', b) -> seconds                     one plain decoding step of b slots
    probe.time_part('round', b, setting=Setting, tree=TreeConfig) -> seconds
                                                            one whole round at that setting (tree: the
                                                            config the tuner's plans carry for it)

Each time is the median of a few calls after a warm-up call. The trees' timed calls take turns
(one call of each, then the next call of each): a burst of another job's work then slows one call
of several trees, which their medians drop, not every call of one tree, which its median would
keep (in one probe on a busy machine the 32-node tree's round came out 60% slow, the others about
30%). The plain step is timed before and after the rounds: when the two differ by more than
STEADY_DRIFT the machine's speed changed meanwhile (another job?), and the prior serves this process
only.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Protocol

from .setting import PLAIN, Setting

REPEATS = 3
STEADY_DRIFT = 1.25
SLOW_PART_S = 3.0  # a measurement that takes longer says why (its first call compiling kernels)


class Probe(Protocol):
    def time_part(self, part: str, b: int, **params) -> float: ...


def time_median(probe: Probe, part: str, b: int, params: dict, repeats: int = REPEATS) -> float:
    """Median seconds of ``repeats`` calls after one warm-up call."""
    probe.time_part(part, b, **params)
    return statistics.median(float(probe.time_part(part, b, **params)) for _ in range(max(1, repeats)))


def measure_prior(probe: Probe, b: int, arms: list[Setting], log: Callable[[str], None] | None = None,
                  repeats: int = REPEATS, tree=None) -> tuple[dict[Setting, float], bool]:
    """({arm: ms per round} for bucket b, steady): plain decoding's step and each tree's whole round.
    tree(setting) -> the TreeConfig the rounds will run (a probe on a graph runner keeps that
    round's graph for them)."""
    trees = [s for s in arms if s.mode != "ar"]
    params = {s: {"setting": s} if tree is None else {"setting": s, "tree": tree(s)} for s in trees}
    plain_first = 1000.0 * time_median(probe, "ar", b, {}, repeats)
    for i, s in enumerate(trees, 1):  # each tree's warm-up call (kernels compile, a graph is captured)
        if log:
            log(f"tuning: timing a round of {s.label()}{f' for {b} slots' if b > 1 else ''} ({i}/{len(trees)})")
        t0 = time.perf_counter()
        probe.time_part("round", b, **params[s])
        if log and time.perf_counter() - t0 > SLOW_PART_S:
            log(f"tuning: the first round of {s.label()} took {time.perf_counter() - t0:.1f} s (where kernels "
                f"compile or a graph is captured, the first call does it, and compiled kernels are cached for "
                f"later runs)")
    calls: dict[Setting, list[float]] = {s: [] for s in trees}
    for _ in range(max(1, repeats)):  # the timed calls take turns
        for s in trees:
            calls[s].append(float(probe.time_part("round", b, **params[s])))
    out = {s: 1000.0 * statistics.median(v) for s, v in calls.items()}
    plain_last = 1000.0 * time_median(probe, "ar", b, {}, repeats) if trees else plain_first
    out[PLAIN] = min(plain_first, plain_last)
    steady = max(plain_first, plain_last) <= STEADY_DRIFT * min(plain_first, plain_last)
    if log and not steady:
        log(f"tuning: the plain step took {plain_first:.1f} then {plain_last:.1f} ms while the rounds were timed: "
            f"the machine's speed changed (another job?), so this prior serves this process only")
    return out, steady


def interpolated_prior(measured: dict[int, dict[Setting, float]], b: int) -> dict[Setting, float]:
    """A bucket's prior from the buckets measured, before its own rounds say better: between two
    measured buckets, each arm's time interpolated on log scales (a round of b slots costs somewhere
    between a compute-bound b times and a weight-bound once); past the largest measured bucket, its
    times a tenth more per slot (real rounds correct either within a few rounds)."""
    lower = max((m for m in measured if m <= b), default=None)
    upper = min((m for m in measured if m >= b), default=None)
    if lower is None:
        lower = upper
    if upper is None or upper == lower:
        factor = (1.0 + 0.1 * (b - 1)) / (1.0 + 0.1 * (lower - 1))
        return {s: ms * factor for s, ms in measured[lower].items()}
    w = math.log(b / lower) / math.log(upper / lower)
    lo, hi = measured[lower], measured[upper]
    return {s: math.exp((1.0 - w) * math.log(lo[s]) + w * math.log(hi[s])) for s in lo if s in hi}
