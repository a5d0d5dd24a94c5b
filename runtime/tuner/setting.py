"""What the tuner chooses between: a round's settings, and the small bounded set of candidates.

A `Setting` is (mode, tree_size, top_m, top_k) in the runner's resolved form (see
`TreeConfig.resolved`): plain decoding is ('ar', 1, 1, 1), the chain is ('chain', B, 1, 1) with B
the drafter's block size, a marginal tree has top_m 1.

The candidates: plain decoding and, per tree mode, the sizes N in (4, 8, 16, 32, 64) with one (M, K)
(FAMILY, unless the user gives them): each mode's trees are then one prefix-closed family, and a round
of the largest tells exactly what every smaller one would have gained (hindsight). Trees of another M
or K are not read off a round (their tables are ranked on their own, and a low-precision head's logits
tie often enough that one ranking's top M are not another's first M).
"""

from __future__ import annotations

from typing import NamedTuple

TREE_SIZES = (4, 8, 16, 32, 64)
TREE_MODES = ("treeflash", "marginal")
FIELDS = ("mode", "tree_size", "top_m", "top_k")
# (M, K) of each tree mode unless given: on the demo pair's CPU, M = 4 and K = 8 gained the most tokens a
# round at each size, at about the cost of M = 2 (docs/results); K = 8 lets trees of 64 nodes branch.
FAMILY = {"treeflash": (4, 8), "marginal": (1, 8)}

class Setting(NamedTuple):
    """One round's settings. tree_size N counts the root; ar is ('ar', 1, 1, 1)."""

    mode: str
    tree_size: int
    top_m: int
    top_k: int

    def label(self) -> str:
        if self.mode == "ar":
            return "ar"
        if self.mode == "chain":
            return f"chain B={self.tree_size}"
        return f"{self.mode} N={self.tree_size} M={self.top_m} K={self.top_k}"


PLAIN = Setting("ar", 1, 1, 1)


def candidate_settings(modes: tuple[str, ...], block_size: int, max_tree_size: int = 64, fixed: dict | None = None,
                       sizes: tuple[int, ...] = TREE_SIZES) -> list[Setting]:
    """The settings to choose between, plain decoding first.

    modes: the modes this pair can run ('ar' always; 'chain' and 'marginal' with a drafter;
    'treeflash' with a head). max_tree_size: the largest N the runner allows (sizes above it are
    dropped). fixed: explicit values (field -> value) that every candidate must carry; an explicit
    tree_size, top_m or top_k names a tree, so with the mode left to the tuner only the modes that
    use that field stay candidates. An explicit value outside the sets is used exactly as given.
    """
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    unknown = set(fixed) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown tree settings {sorted(unknown)}; use {', '.join(FIELDS)}")
    want_modes = [fixed["mode"]] if "mode" in fixed else list(modes)
    if "mode" not in fixed and {"tree_size", "top_k"} & set(fixed):
        want_modes = [m for m in want_modes if m in TREE_MODES]
    if "mode" not in fixed and "top_m" in fixed:
        want_modes = [m for m in want_modes if m == "treeflash" or (m == "marginal" and fixed["top_m"] == 1)]
    ns = [fixed["tree_size"]] if "tree_size" in fixed else [n for n in sizes if n <= max_tree_size]
    out: list[Setting] = []
    for mode in want_modes:
        if mode == "ar":
            out.append(PLAIN)
        elif mode == "chain":
            out.append(Setting("chain", block_size, 1, 1))
        elif mode in TREE_MODES:
            m, k = FAMILY[mode]
            m = 1 if mode == "marginal" else fixed.get("top_m", m)
            out += [Setting(mode, n, m, fixed.get("top_k", k)) for n in ns]
        else:
            raise ValueError(f"unknown mode {mode!r}")
    return out


def covers(big: Setting, small: Setting) -> bool:
    """Whether a round of ``big`` tells what ``small`` would have gained: the same tree mode, M and K
    (one prefix-closed family), no more nodes."""
    return big == small or (big.mode == small.mode and big.mode in TREE_MODES
                            and (big.top_m, big.top_k) == (small.top_m, small.top_k)
                            and small.tree_size <= big.tree_size)


def hindsight(ran: Setting, accepted: list[float], arms: list[Setting]) -> dict[Setting, float]:
    """Tokens each arm that ``ran`` covers would have gained this round: ``accepted`` is the verified
    tree's nodes best first (root excluded), 1.0 where accepted. The tree of n nodes is the first
    n - 1 of them (prefix-closed), so its accepted path is what they hold of this one's."""
    return {s: 1.0 + float(sum(accepted[: s.tree_size - 1])) for s in arms if s.mode != "ar" and covers(ran, s)}
