"""Verifier-side token choice and lossless tree acceptance.

Greedy: y[a] = argmax of the verifier at node a. Sampling: y[a] is an
independent draw from the verifier's own (temperature, top-p) distribution at
node a. A node is accepted when every node on its path equals its parent's y;
siblings hold distinct tokens, so the accepted nodes form one path, and walking
it reproduces exactly the verifier's sequential choices (greedy or sampled).
"""

from __future__ import annotations

import torch

from treeflash_export.tree import Tree


def nucleus(probs: torch.Tensor, top_p) -> torch.Tensor:
    """[..., V] probabilities -> [..., V] bool: the tokens top-p sampling keeps, the most likely ones
    up to mass top_p (a number, or a tensor broadcast over the rows; where it is >= 1, every token)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
    keep_sorted = (before < top_p) | (top_p >= 1.0)  # always keeps the most likely token
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def verifier_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """[n, V] logits -> [n, V] probabilities after temperature and nucleus (top-p) filtering."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs = torch.where(nucleus(probs, top_p), probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def accept(tree: Tree, y: torch.Tensor, max_path: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deepest accepted node b*, in fixed shapes (no host read):

    returns path [L] (the node indices root..b* in order, then other nodes as padding), tau (0-d:
    the path's length, depth(b*) + 1) and the bonus token y[b*] (0-d). L = max_path or N; a path
    never has more nodes than the block, so the runtime passes min(N, B)."""
    N = tree.size
    parents = tree.parents.clamp(min=0)
    ids = torch.arange(N, device=y.device)
    match = ((tree.tokens == y[parents]) & tree.valid) | (ids == 0)
    accepted = ~(tree.mask & ~match[None, :]).any(dim=-1)  # every node on the path matched
    depth = torch.where(accepted, tree.depths, torch.full_like(tree.depths, -1))
    # The first deepest (unique: siblings hold distinct tokens). Kept 1-d: indexing with a 0-d
    # tensor would read it on the host.
    best = depth.argmax().reshape(1)
    on_path = tree.mask[best][0]
    # Path nodes first, in index order (= path order: parents precede children), then the rest.
    order = torch.where(on_path, ids, ids + N).argsort()
    return order[: max_path or N], depth[best][0] + 1, y[best][0]


# ------------------------------------------------------------------ keyed sampling
#
# A request's draws must depend on its own seed only, never on which slot it holds, who shares its
# rounds, or the tree. So each position draws one uniform from a hash of (seed, position), and the
# token at position t is the inverse CDF of the verifier's (temperature, top-p) distribution at
# that uniform: the first token whose cumulative kept probability passes U * (kept mass). Every tree node
# at depth d chooses the token of position P + d + 1; siblings share the uniform, but only one node
# per depth lies on the accepted path, so the tokens emitted are exactly those of sequential
# sampling with the same uniforms: the same for any tree, mode or batch, and for plain decoding.
# The nucleus only zeroes the tokens it drops; the inverse CDF always walks the vocabulary order.
#
# Costs: the hash is [k, n] (one number per row, never one per vocabulary entry); rows are handled
# in chunks of about ROW_CHUNK_ELEMENTS vocabulary entries, so the float32 temporaries stay bounded
# whatever slots x tree nodes is; the nucleus sort runs only when some request asks for top-p < 1.

GREEDY, SAMPLE, NUCLEUS = 0, 1, 2  # sampling kinds: what the round's sampler must compute
ROW_CHUNK_ELEMENTS = 1 << 24  # vocabulary entries per chunk of rows (64 MiB per float32 temporary)

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64's constants as int64 (torch has no uint64 arithmetic)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def sampling_kind(temperature: float, top_p: float) -> int:
    """What one request needs of the sampler: GREEDY, SAMPLE or NUCLEUS (sampling with top-p < 1)."""
    if temperature <= 0:
        return GREEDY
    return NUCLEUS if top_p < 1.0 else SAMPLE


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (>> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser (int64 products wrap, as unsigned ones would)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def keyed_uniform(seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """seed [k] int64, positions [k, n] int64 -> U [k, n] float32 in (0, 1), a pure function of
    (seed, position): 24 bits of a splitmix64 hash, offset by half a step."""
    z = _mix(seed.reshape(-1, 1) + _GOLDEN)
    z = _mix(z + (positions + 1) * _GOLDEN)
    return (_shr(z, 40).float() + 0.5) * 2.0**-24


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor, top_p: torch.Tensor | None) -> torch.Tensor:
    """probs [r, V] float32, u [r], top_p [r] or None (no nucleus) -> [r] int64: the first token in
    vocabulary order whose cumulative kept mass passes u times all the kept mass. A token of
    probability 0 (or outside the nucleus) is never chosen; a row with top_p >= 1 gives the same
    token with or without the nucleus step, so a request's tokens do not depend on its neighbours."""
    if top_p is not None:
        probs = torch.where(nucleus(probs, top_p[:, None]), probs, torch.zeros_like(probs))
    cum = probs.cumsum(-1)
    target = (u * cum[:, -1])[:, None]
    return torch.searchsorted(cum, target, right=True)[:, 0].clamp_max(probs.shape[-1] - 1)


def choose_tokens_keyed(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
                        positions: torch.Tensor, kind: int) -> torch.Tensor:
    """logits [k, n, V]; per request temperature, top_p [k] float and seed [k] int64; positions [k, n]
    (the position of the token each row chooses) -> [k, n] int64. Greedy where temperature is 0.
    kind (known to the host, the largest of the requests' sampling_kind): GREEDY computes only the
    argmax; SAMPLE skips the nucleus sort (every request has top_p >= 1)."""
    greedy = logits.argmax(dim=-1)
    if kind == GREEDY:
        return greedy
    k, n, V = logits.shape
    rows = logits.reshape(k * n, V)
    t = temperature.clamp_min(1e-6).repeat_interleave(n)  # [k * n]
    p = top_p.float().repeat_interleave(n) if kind == NUCLEUS else None
    u = keyed_uniform(seed, positions).reshape(-1)
    step = max(1, ROW_CHUNK_ELEMENTS // V)
    picks = []
    for r in range(0, k * n, step):  # static in the shapes: a captured round unrolls it
        part = slice(r, r + step)
        probs = torch.softmax(rows[part].float() / t[part, None], dim=-1)
        picks.append(_inverse_cdf(probs, u[part], None if p is None else p[part]))
    sampled = torch.cat(picks).reshape(k, n)
    return torch.where(temperature.reshape(-1, 1) > 0, sampled, greedy)
