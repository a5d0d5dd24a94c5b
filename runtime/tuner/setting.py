"""What the tuner chooses between: a round's settings, and the small bounded set of candidates.

A `Setting` is (mode, tree_size, top_m, top_k) in the runner's resolved form (see
`TreeConfig.resolved`): plain decoding is ('ar', 1, 1, 1), the chain is ('chain', B, 1, 1) with B
the drafter's block size, a marginal tree has top_m 1.

Why these candidate sets:
- tree sizes N in (4, 8, 16, 32, 64): powers of two from the smallest tree worth building to the
  paper's default; the runner keeps one graph per size (and per batch bucket), so the set must stay
  small; sizes between two of them gain little (the expected tokens curve is concave in N).
- top_m M in (1, 2, 4, 8, 16): the expansion's cost is linear in M (B-1 x M rows through the LM
  head), so doubling steps cover the range up to the paper's 16 with five points.
- top_k K in (4, 8, 16): K barely changes the expansion's cost (a top-K over the vocabulary) but
  bounds how bushy a parent row can be; below 4 a tree hardly branches, above 16 the extra children
  rank too low to enter a tree of at most 64 nodes.
That is at most 75 TreeFlash + 15 marginal + chain + plain = 92 settings, few enough to score
every one at each decision.
"""

from __future__ import annotations

from typing import NamedTuple

TREE_SIZES = (4, 8, 16, 32, 64)
TOP_MS = (1, 2, 4, 8, 16)
TOP_KS = (4, 8, 16)
TREE_MODES = ("treeflash", "marginal")
FIELDS = ("mode", "tree_size", "top_m", "top_k")


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


def chain_setting(block_size: int) -> Setting:
    return Setting("chain", block_size, 1, 1)


def candidate_settings(modes: tuple[str, ...], block_size: int, max_tree_size: int = 64, fixed: dict | None = None,
                       sizes: tuple[int, ...] = TREE_SIZES, top_ms: tuple[int, ...] = TOP_MS,
                       top_ks: tuple[int, ...] = TOP_KS) -> list[Setting]:
    """The settings to choose between, plain decoding first.

    modes: the modes this pair can run ('ar' always; 'chain' and 'marginal' with a drafter;
    'treeflash' with a head). max_tree_size: the largest N the runner allows (sizes above it are
    dropped). fixed: explicit values (field -> value) that every candidate must carry; an explicit
    tree_size, top_m or top_k names a tree, so with the mode left to the tuner only the modes that
    use that field stay candidates (an explicit `--tree-size 16` builds a 16-node tree, as it did
    before the tuner). An explicit value outside the sets is used exactly as given.
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
    ms = [fixed["top_m"]] if "top_m" in fixed else list(top_ms)
    ks = [fixed["top_k"]] if "top_k" in fixed else list(top_ks)
    out: list[Setting] = []
    for mode in want_modes:
        if mode == "ar":
            out.append(PLAIN)
        elif mode == "chain":
            out.append(chain_setting(block_size))
        elif mode == "marginal":
            out += [Setting("marginal", n, 1, k) for n in ns for k in ks]
        elif mode == "treeflash":
            out += [Setting("treeflash", n, m, k) for n in ns for m in ms for k in ks]
        else:
            raise ValueError(f"unknown mode {mode!r}")
    return out
