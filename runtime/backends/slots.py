"""Request-slot bookkeeping that needs no tensors: the batch buckets rounds are captured for, each
bucket's tree size, and the groups a batched prefill is split into. The runner itself
(treeflash_runtime.backends.pytorch.TorchRunner) serves one sequence as its one-slot case.
"""

from __future__ import annotations

from treeflash_export.config import TreeConfig
from treeflash_export.errors import ConfigError


def bucket_sizes(max_batch: int) -> list[int]:
    """The slot counts rounds are captured for: 1, 2, 4, ... and max_batch itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def power_of_two_groups(items: list) -> list[list]:
    """items split into consecutive groups whose sizes are distinct powers of two, largest first
    (5 -> 4 + 1): each group is a batch size some captured prefill pass has, and none is padded."""
    groups, start, n = [], 0, len(items)
    size = 1 << max(n.bit_length() - 1, 0)
    while start < n:
        if size <= n - start:
            groups.append(items[start : start + size])
            start += size
        size >>= 1
    return groups


def tree_sizes_by_bucket(buckets: list[int], tree: TreeConfig, table: dict[int, int]) -> dict[int, int]:
    """Each bucket's tree size: the entry of ``table`` (batch size -> N) with the largest batch size
    at most the bucket's, else the deployment's tree size; never more than it."""
    out = {}
    for b in buckets:
        fits = [n for size, n in table.items() if size <= b]
        n = fits[-1] if fits else tree.tree_size
        if tree.mode in ("chain", "ar"):
            n = tree.tree_size  # a chain's length is the block's; plain decoding has one node
        out[b] = min(n, tree.tree_size)
    return out


def parse_tree_size_by_batch(text: str) -> dict[int, int]:
    """'1:64,4:32,16:16' -> {1: 64, 4: 32, 16: 16} (batch sizes ascending)."""
    table = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        size, sep, n = item.partition(":")
        try:
            if not sep:
                raise ValueError
            table[int(size)] = int(n)
        except ValueError:
            raise ConfigError(f"--tree-size-by-batch: {item!r} is not BATCH:TREE_SIZE (e.g. 1:64,4:32,16:16)") from None
        if int(size) < 1 or int(n) < 2:
            raise ConfigError(f"--tree-size-by-batch: {item!r} needs a batch size >= 1 and a tree size >= 2")
    return dict(sorted(table.items()))
