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


def verifier_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """[n, V] logits -> [n, V] probabilities after temperature and nucleus (top-p) filtering."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        keep_sorted = before < top_p  # always keeps the most likely token
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
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
