"""The tree algebra: transition tables -> a fixed-shape draft tree.

Everything here is a pure function of tensors, so the same code runs in the
PyTorch backend and traces into a static-shape graph.

Transition tables (D = B - 1 depths, M parent rows, K children per row):
    tokens   [D, M, K] int64  child token at block position d+1 for parent row m, best first
    logprobs [D, M, K] float  its drafter log-probability given that parent (sorted descending)
    next_row [D, M, K] int64  row of depth d+1 that holds this child's own children; -1 = leaf
Row 0 of depth 0 is the root's row (every row of depth 0 has the root as parent).

A tree of N nodes (root included) is the prefix-closed set of the N-1 best
paths under path score = sum of logprobs. Ties are broken by a fixed total
order: (score desc, depth asc, parent's order asc, rank asc). It is monotone
along edges (a parent precedes its children, rank r precedes rank r+1), so the
best-first heap and the depth-synchronous beam below pick the same nodes.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tables:
    tokens: torch.Tensor  # [D, M, K] int64
    logprobs: torch.Tensor  # [D, M, K] float32, descending along K
    next_row: torch.Tensor  # [D, M, K] int64, -1 = leaf


@dataclass(frozen=True)
class Tree:
    """N nodes, parents before children; node 0 is the root.

    tokens  [N] int64   node tokens (the root's token first; padding nodes hold 0)
    parents [N] int64   parent index, -1 for the root
    depths  [N] int64   0 for the root; position id = P + depth (siblings share a position)
    mask    [N, N] bool ancestor-or-self: mask[a, b] = b is on the path root..a
    valid   [N] bool    False for padding nodes (when fewer than N-1 drafts exist); they come last,
                        hang under the root and are never accepted
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    mask: torch.Tensor
    valid: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


def link_next_rows(child_tokens: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """next_row for TreeFlash tables.

    child_tokens [D, M, K]; candidates [D, M] = the top-M marginal tokens of block
    positions 0..D-1 (position 0's candidates are unused: its parent is the root).
    next[d, m, k] = index of child_tokens[d, m, k] in candidates[d + 1], or -1; the last depth is all -1.
    """
    D = child_tokens.shape[0]
    hits = child_tokens[:-1, :, :, None] == candidates[1:, None, None, :]  # [D-1, M, K, M]
    idx = torch.where(hits.any(-1), hits.int().argmax(-1), torch.full_like(child_tokens[:-1], -1))
    last = torch.full_like(child_tokens[:1], -1)
    return torch.cat([idx, last], dim=0) if D > 1 else last


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[..., N] parent indices (root -1) -> [..., N, N] ancestor-or-self mask, by pointer jumping.

    Fixed shapes only (one-hot ORs, no boolean indexing), so it traces into a static graph.
    """
    n = parents.shape[-1]
    ids = torch.arange(n, device=parents.device)
    mask = (ids[:, None] == ids[None, :]).expand(*parents.shape, n)
    cur = parents
    for _ in range(max_depth):
        hit = cur >= 0
        safe = torch.where(hit, cur, torch.zeros_like(cur))
        mask = mask | ((safe[..., :, None] == ids) & hit[..., :, None])
        cur = torch.where(hit, torch.gather(parents, -1, safe), cur)
    return mask


def stable_order_desc(scores: torch.Tensor) -> torch.Tensor:
    """Permutation sorting [..., n] scores descending, equal scores by index (a stable sort).

    Written as pairwise ranks (no Sort/TopK), so the tie order is exact and identical in
    PyTorch, ONNX Runtime and TensorRT, whose TopK does not promise an order among ties.
    O(n^2) comparisons: about a million for N = 64, K = 16.
    """
    n = scores.shape[-1]
    idx = torch.arange(n, device=scores.device)
    a, b = scores[..., None, :], scores[..., :, None]
    ahead = (a > b) | ((a == b) & (idx[None, :] < idx[:, None]))
    rank = ahead.sum(dim=-1)  # a permutation of 0..n-1
    return torch.zeros_like(rank).scatter(-1, rank, idx.expand_as(rank))


def build_tree(tables: Tables, root_token, tree_size: int) -> Tree:
    """Depth-synchronous beam of width N-1: exactly the best-first tree, in fixed shapes.

    Per depth keep the best N-1 children of the previous depth's beam, then take
    the global best N-1 over all depths. Nodes come out depth by depth, so parents
    precede children; padding nodes (when fewer than N-1 drafts exist) come last.
    The tables may carry a leading batch axis (tables [b, D, M, K], roots [b]): then so does
    every field of the tree, each tree built from its own tables (request slots).
    """
    batched = tables.tokens.dim() == 4
    tok, lp, nxt = (t if batched else t[None] for t in (tables.tokens, tables.logprobs.float(), tables.next_row))
    b, D, M, K = tok.shape
    W = tree_size - 1
    dev = tok.device
    neg_inf = torch.full((1, 1), -math.inf, device=dev)

    def take(x, index):  # x [b, n], index [b, m] -> x[i, index[i]]
        return torch.gather(x, 1, index)

    def topw(scores, *payload):
        # The stable order keeps the flattened (parent slot, rank) order among equal scores.
        if scores.shape[1] < W:
            pad = W - scores.shape[1]
            scores = torch.cat([scores, neg_inf.expand(b, pad)], dim=1)
            payload = [torch.cat([p, p.new_zeros(b, pad)], dim=1) for p in payload]
        order = stable_order_desc(scores)[:, :W]
        return (take(scores, order), *[take(p, order) for p in payload])

    def rows(x, d, r):  # x [b, D, M, K], r [b, W] -> x[i, d, r[i]] [b, W, K]
        return torch.gather(x[:, d], 1, r[:, :, None].expand(-1, -1, K))

    # Depth 1: the root's children (row 0 of depth 0).
    score, token, row, slot = topw(lp[:, 0, 0], tok[:, 0, 0], nxt[:, 0, 0],
                                   torch.zeros(b, K, dtype=torch.long, device=dev))
    all_score, all_token, all_slot = [score], [token], [slot]
    for d in range(1, D):
        parent_ok = torch.isfinite(score) & (row >= 0)
        r = row.clamp(min=0)
        child = torch.where(parent_ok[:, :, None], score[:, :, None] + rows(lp, d, r), neg_inf[:, :, None])  # [b, W, K]
        parent_slot = torch.arange(W, device=dev)[:, None].expand(W, K).reshape(1, -1).expand(b, -1)
        score, token, row, slot = topw(child.reshape(b, -1), rows(tok, d, r).reshape(b, -1),
                                       rows(nxt, d, r).reshape(b, -1), parent_slot)
        all_score.append(score)
        all_token.append(token)
        all_slot.append(slot)

    flat_score = torch.cat(all_score, dim=1)  # [b, D*W], depth-major
    flat_token = torch.cat(all_token, dim=1)
    flat_slot = torch.cat(all_slot, dim=1)
    flat_depth = torch.arange(1, D + 1, device=dev).repeat_interleave(W).expand(b, -1)
    chosen = stable_order_desc(flat_score)[:, :W]
    # Node order: chosen valid entries in depth-major order, then chosen padding entries.
    picked = torch.zeros(b, D * W, dtype=torch.bool, device=dev).scatter(1, chosen, torch.ones_like(chosen,
                                                                                                 dtype=torch.bool))
    good = picked & torch.isfinite(flat_score)
    pad = picked & ~good
    n_good = good.long().sum(dim=1, keepdim=True)
    position = torch.where(good, good.long().cumsum(1) - 1, n_good + pad.long().cumsum(1) - 1)  # node - 1
    node_of = torch.where(picked, position + 1, torch.zeros_like(position))  # flat index -> node
    flat_of = torch.zeros(b, W, dtype=torch.long, device=dev).scatter(1, take(position, chosen), chosen)  # node-1 -> flat

    valid = take(good, flat_of)
    depth = take(flat_depth, flat_of)
    parent_flat = (depth - 2) * W + take(flat_slot, flat_of)
    parent = torch.where(depth > 1, take(node_of, parent_flat.clamp(min=0)), torch.zeros_like(depth))
    parent = torch.where(valid, parent, torch.zeros_like(parent))
    depth = torch.where(valid, depth, torch.ones_like(depth))
    token = torch.where(valid, take(flat_token, flat_of), torch.zeros_like(depth))

    root = torch.as_tensor(root_token, dtype=torch.long, device=dev).reshape(b, 1)
    parents = torch.cat([torch.full((b, 1), -1, dtype=torch.long, device=dev), parent], dim=1)
    tree = Tree(
        tokens=torch.cat([root, token], dim=1),
        parents=parents,
        depths=torch.cat([torch.zeros(b, 1, dtype=torch.long, device=dev), depth], dim=1),
        mask=ancestor_mask(parents, D),
        valid=torch.cat([torch.ones(b, 1, dtype=torch.bool, device=dev), valid], dim=1),
    )
    return tree if batched else Tree(*(getattr(tree, f.name)[0] for f in dataclasses.fields(Tree)))


def chain_tree(tokens: torch.Tensor) -> Tree:
    """A path: tokens [n] with tokens[0] the root (prefill and plain decoding use this)."""
    n = tokens.shape[0]
    idx = torch.arange(n, device=tokens.device)
    return Tree(
        tokens=tokens,
        parents=idx - 1,
        depths=idx,
        mask=idx[:, None] >= idx[None, :],
        valid=torch.ones(n, dtype=torch.bool, device=tokens.device),
    )


def best_first_paths(tables: Tables, tree_size: int) -> list[tuple[int, ...]]:
    """Reference best-first (heap) assembly, in plain Python; returns token paths (root excluded).

    Same total order as build_tree: (score desc, depth, parent's pop index, rank).
    Used by tests to check the fixed-shape beam.
    """
    tok = tables.tokens.tolist()
    lp = tables.logprobs.double().tolist()
    nxt = tables.next_row.tolist()
    D, K = len(tok), len(tok[0][0])
    # entry: (-score, depth, parent pop index, rank, row, parent score, parent path)
    heap = []
    if math.isfinite(lp[0][0][0]):
        heap.append((-lp[0][0][0], 1, 0, 0, 0, 0.0, ()))
    out: list[tuple[int, ...]] = []
    while heap and len(out) < tree_size - 1:
        neg, depth, ppop, rank, row, pscore, ppath = heapq.heappop(heap)
        d = depth - 1
        path = ppath + (tok[d][row][rank],)
        out.append(path)
        me = len(out)  # pop index of this node (root = 0)
        if rank + 1 < K:
            s = pscore + lp[d][row][rank + 1]
            if math.isfinite(s):
                heapq.heappush(heap, (-s, depth, ppop, rank + 1, row, pscore, ppath))
        child_row = nxt[d][row][rank]
        if depth < D and child_row >= 0:
            s = -neg + lp[depth][child_row][0]
            if math.isfinite(s):
                heapq.heappush(heap, (-s, depth + 1, me, 0, child_row, -neg, path))
    return out


def tree_paths(tree: Tree) -> list[tuple[int, ...]]:
    """Token paths (root excluded) of a tree's valid non-root nodes, in node order."""
    tokens, parents, valid = tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist()
    paths: list[tuple[int, ...]] = [()]
    for a in range(1, len(tokens)):
        paths.append(paths[parents[a]] + (tokens[a],))
    return [paths[a] for a in range(1, len(tokens)) if valid[a]]


def node_paths(tables: Tables, tree: Tree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each node of a tree built from ``tables`` came from, in fixed shapes (no host value):

    scores [N] float32  the node's path score (sum of the tables' log-probabilities along its path;
                        0 for the root, -inf for padding nodes)
    m_rank [N] int64    the largest parent row (the parent's rank among its position's candidates)
                        on the path: the node is in the tree of a smaller top-M iff m_rank < M
    k_rank [N] int64    the largest child rank on the path: in the tree of a smaller top-K iff k_rank < K
    Batched like build_tree (tables [b, D, M, K], tree fields [b, N] -> [b, N] each). Siblings hold
    distinct tokens, so a node's rank is where its token sits in its row. The self-tuning tree
    predicts smaller trees from these (best-first trees are prefix-closed)."""
    if tables.tokens.dim() == 3:
        one = Tables(*(t[None] for t in (tables.tokens, tables.logprobs, tables.next_row)))
        return tuple(x[0] for x in node_paths(one, Tree(*(getattr(tree, f.name)[None]
                                                            for f in dataclasses.fields(Tree)))))
    tok, lp, nxt = tables.tokens, tables.logprobs.float(), tables.next_row
    b, D, M, K = tok.shape
    N = tree.tokens.shape[1]
    dev = tok.device
    parent = tree.parents.clamp(min=0)
    row = torch.zeros(b, N, dtype=torch.long, device=dev)
    rank, m_rank, k_rank = row.clone(), row.clone(), row.clone()
    score = torch.zeros(b, N, dtype=torch.float32, device=dev)
    ks = torch.arange(K, device=dev)
    for d in range(1, D + 1):  # parents precede children, one depth at a time
        here = (tree.depths == d) & tree.valid & (torch.arange(N, device=dev) > 0)
        p_row, p_rank = row.gather(1, parent), rank.gather(1, parent)
        r = (nxt[:, d - 2].reshape(b, M * K).gather(1, p_row * K + p_rank).clamp(min=0) if d > 1
             else torch.zeros_like(row))
        cells = r[:, :, None] * K + ks  # [b, N, K]: the node's row in the tables of depth d
        k = (tok[:, d - 1].reshape(b, M * K).gather(1, cells.flatten(1)).view(b, N, K)
             == tree.tokens[:, :, None]).long().argmax(-1)
        s = score.gather(1, parent) + lp[:, d - 1].reshape(b, M * K).gather(1, r * K + k)
        row, rank = torch.where(here, r, row), torch.where(here, k, rank)
        score = torch.where(here, s, score)
        m_rank = torch.where(here, torch.maximum(m_rank.gather(1, parent), r), m_rank)
        k_rank = torch.where(here, torch.maximum(k_rank.gather(1, parent), k), k_rank)
    score = torch.where(tree.valid, score, torch.full_like(score, -math.inf))
    return score, m_rank, k_rank


def on_accepted_path(tree: Tree, drafts: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """Which nodes of ``tree`` lie on a round's accepted path, in fixed shapes: drafts [b, L] the
    accepted path's tokens at depths 1..L (entries past tau - 1 are ignored), tau [b] the tokens the
    round gained (the accepted drafts plus the bonus). The tree may be a larger one than the round
    verified, built from the same tables: its nodes that the verified tree held are labelled as
    verification labelled them (a best-first tree holds every smaller one, so the accepted path is in
    it). Batched: tree fields [b, N]; returns accepted [b, N] bool (the root: True)."""
    depth = tree.depths
    along = drafts.gather(1, (depth - 1).clamp(min=0, max=drafts.shape[1] - 1))  # the path's token at the node's depth
    match = (depth == 0) | ((depth <= (tau - 1)[:, None]) & (tree.tokens == along) & tree.valid)
    # a node is on the path iff it and every ancestor match the path's token at their depth
    return (match[:, None, :] | ~tree.mask).all(dim=-1) & match
