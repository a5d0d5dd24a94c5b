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


def choose_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator | None) -> torch.Tensor:
    """[n, V] -> [n] int64: the verifier's token after each row.

    Sampling is an exponential race: argmax of p / E with E ~ Exp(1) independent per token
    picks token i with probability p_i exactly, with fixed shapes and elementwise kernels only,
    so it runs inside a captured round (torch.multinomial makes no such promise)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = verifier_probs(logits, temperature, top_p)
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return (probs / race).argmax(dim=-1)


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


# ------------------------------------------------------------------ keyed sampling (request slots)
#
# A served request's draws must depend on its own seed only, never on which slot it holds or who
# shares its rounds. So the exponential race takes its noise from a hash of (seed, position,
# token id) instead of a generator: the token at position t is argmax_v p(v) / E(seed, t, v) with
# E = -log U, U uniform in (0, 1). Every tree node at depth d draws the noise of position P + d + 1;
# siblings share it, but only one node per depth lies on the accepted path, so the tokens emitted
# are exactly those of sequential sampling with the same noise: the same for any tree, mode or
# batch, and for plain decoding with the same seed.

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64's constants as int64 (torch has no uint64 arithmetic)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (>> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser (int64 products wrap, as unsigned ones would)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def keyed_uniform(seed: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """seed [k] int64, positions [k, n] int64 -> U [k, n, vocab] float32 in (0, 1), a pure function
    of (seed, position, token id): 24 bits of a splitmix64 hash, offset by half a step."""
    z = _mix(seed.reshape(-1, 1, 1) + _GOLDEN)
    z = _mix(z + (positions[..., None] + 1) * _GOLDEN)
    z = _mix(z + (torch.arange(vocab, device=seed.device) + 1) * _GOLDEN)
    return (_shr(z, 40).float() + 0.5) * 2.0**-24


def choose_tokens_keyed(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
                        positions: torch.Tensor, sampling: bool) -> torch.Tensor:
    """logits [k, n, V]; per slot temperature, top_p [k] float and seed [k] int64; positions [k, n]
    (the position of the token each row chooses) -> [k, n] int64. Greedy where temperature is 0.
    sampling (known to the host): whether any slot samples; if not, only the argmax is computed."""
    greedy = logits.argmax(dim=-1)
    if not sampling:
        return greedy
    t = temperature.clamp_min(1e-6).reshape(-1, 1, 1)
    probs = torch.softmax(logits.float() / t, dim=-1)
    keep = nucleus(probs, top_p.reshape(-1, 1, 1))
    noise = -torch.log(keyed_uniform(seed, positions, probs.shape[-1]))  # Exp(1) per (position, token)
    race = torch.where(keep, probs, torch.zeros_like(probs)) / noise
    return torch.where(temperature.reshape(-1, 1) > 0, race.argmax(dim=-1), greedy)
