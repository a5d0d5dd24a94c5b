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
    """[n, V] -> [n] int64: the verifier's token after each row."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = verifier_probs(logits, temperature, top_p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def accept(tree: Tree, y: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Deepest accepted node b*: returns (path node indices root..b* in order, bonus token y[b*])."""
    parents = tree.parents.clamp(min=0)
    match = (tree.tokens == y[parents]) & tree.valid
    match[0] = True
    accepted = ~(tree.mask & ~match[None, :]).any(dim=-1)  # every node on the path matched
    depth = torch.where(accepted, tree.depths, torch.full_like(tree.depths, -1))
    best = int(depth.argmax())
    path = tree.mask[best].nonzero()[:, 0]  # index order = path order (parents precede children)
    return path, int(y[best])
