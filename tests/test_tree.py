"""Tree algebra: the fixed-shape beam equals best-first assembly; hand-computed trees."""

from __future__ import annotations

import math
import random

import pytest
import torch

from treeflash_export.tree import (
    Tables, ancestor_mask, best_first_paths, build_tree, chain_tree, link_next_rows, tree_paths,
)


def random_tables(D, M, K, V, g, *, ties: bool, leaf_rate: float) -> Tables:
    tokens = torch.stack([torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(M)]) for _ in range(D)])
    if ties:  # few distinct values: many exact ties between scores
        lp = -(torch.randint(0, 3, (D, M, K), generator=g).float() / 2)
    else:
        lp = -torch.rand(D, M, K, generator=g) * 4
    lp = lp.sort(dim=-1, descending=True).values
    nxt = torch.randint(0, M, (D, M, K), generator=g)
    nxt[torch.rand(D, M, K, generator=g) < leaf_rate] = -1
    nxt[-1] = -1
    return Tables(tokens, lp, nxt)


@pytest.mark.parametrize("ties", [True, False])
def test_beam_equals_best_first_heap(ties):
    g = torch.Generator().manual_seed(1234 + ties)
    rng = random.Random(7 + ties)
    for _ in range(600):
        D, M, K = rng.randint(1, 7), rng.randint(1, 5), rng.randint(1, 6)
        N = rng.randint(2, 40)
        tables = random_tables(D, M, K, max(K, 9), g, ties=ties, leaf_rate=rng.choice([0.0, 0.3, 0.7]))
        tree = build_tree(tables, 3, N)
        beam = tree_paths(tree)
        heap = best_first_paths(tables, N)
        assert set(beam) == set(heap), (D, M, K, N)
        assert len(beam) == len(heap) <= N - 1
        # Fixed shape: padding fills up to N nodes and is marked invalid.
        assert tree.size == N and int(tree.valid.sum()) == len(heap) + 1
        # Parents precede children; the mask is ancestor-or-self; depth = rowsum - 1.
        assert bool((tree.parents[1:] < torch.arange(1, N)).all())
        assert torch.equal(tree.depths, tree.mask.sum(-1) - 1)
        for a in range(1, N):
            p = int(tree.parents[a])
            expect = tree.mask[p].clone()
            expect[a] = True
            assert torch.equal(tree.mask[a], expect)


def test_best_first_hand_example():
    # D=2, M=2, K=2. Root row: tokens 10 (lp -0.1, children in row 1), 11 (lp -1.0, leaf).
    # Depth-1 row 1: tokens 20 (-0.2), 21 (-3.0). Row 0 unused.
    tok = torch.tensor([[[10, 11], [0, 0]], [[0, 0], [20, 21]]])
    lp = torch.tensor([[[-0.1, -1.0], [0.0, 0.0]], [[0.0, 0.0], [-0.2, -3.0]]])
    nxt = torch.tensor([[[1, -1], [-1, -1]], [[-1, -1], [-1, -1]]])
    tables = Tables(tok, lp, nxt)
    # Scores: 10:-0.1, 10>20:-0.3, 11:-1.0, 10>21:-3.1. Best 3: {10, 10>20, 11}.
    tree = build_tree(tables, 5, 4)
    assert tree.tokens.tolist() == [5, 10, 11, 20]
    assert tree.parents.tolist() == [-1, 0, 0, 1]
    assert tree.depths.tolist() == [0, 1, 1, 2]
    assert tree.mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert tree.valid.all()
    assert best_first_paths(tables, 4) == [(10,), (10, 20), (11,)]
    # With N = 6 only 4 drafts exist: one padding node, invalid, hung under the root.
    big = build_tree(tables, 5, 6)
    assert big.valid.tolist() == [True, True, True, True, True, False]
    assert big.tokens.tolist()[:5] == [5, 10, 11, 20, 21]
    assert big.parents.tolist() == [-1, 0, 0, 1, 1, 0]


def test_marginal_rows_are_shared_by_all_parents():
    # Marginal tables: one row per depth, next = 0, so every depth-1 node has the same children.
    tok = torch.tensor([[[1, 2]], [[3, 4]]])
    lp = torch.log(torch.tensor([[[0.6, 0.4]], [[0.7, 0.3]]]))
    nxt = torch.tensor([[[0, 0]], [[-1, -1]]])
    tree = build_tree(Tables(tok, lp, nxt), 0, 5)
    # Path probabilities: 1:.6, 2:.4, 1>3:.42, 1>4:.18, 2>3:.28, 2>4:.12 -> best 4: 1, 1>3, 2, 2>3.
    assert sorted(tree_paths(tree)) == [(1,), (1, 3), (2,), (2, 3)]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2]
    assert set(zip(tree.tokens.tolist()[3:], tree.parents.tolist()[3:])) == {(3, 1), (3, 2)}


def test_chain_tree_is_causal():
    t = chain_tree(torch.tensor([7, 8, 9]))
    assert t.mask.int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert t.parents.tolist() == [-1, 0, 1] and t.depths.tolist() == [0, 1, 2]


def test_ancestor_mask_from_parents():
    parents = torch.tensor([-1, 0, 0, 1, 3, 2])
    m = ancestor_mask(parents, 4)
    assert m[4].nonzero()[:, 0].tolist() == [0, 1, 3, 4]
    assert m[5].nonzero()[:, 0].tolist() == [0, 2, 5]


def test_link_next_rows():
    candidates = torch.tensor([[0, 0], [5, 6], [7, 8]])  # positions 0 (unused), 1, 2
    child = torch.tensor([[[6, 9]] * 2, [[8, 5]] * 2, [[1, 2]] * 2])  # D=3, M=2, K=2
    nxt = link_next_rows(child, candidates)
    assert nxt[0].tolist() == [[1, -1], [1, -1]]  # 6 is candidate 1 of position 1; 9 is not a candidate
    assert nxt[1].tolist() == [[1, -1], [1, -1]]  # 8 is candidate 1 of position 2; 5 is not
    assert nxt[2].tolist() == [[-1, -1], [-1, -1]]  # last depth: leaves


def test_non_finite_scores_are_never_nodes():
    tok = torch.tensor([[[1, 2, 3]]])
    lp = torch.tensor([[[-0.5, -math.inf, -math.inf]]])
    nxt = torch.full((1, 1, 3), -1)
    tree = build_tree(Tables(tok, lp, nxt), 0, 4)
    assert tree.valid.tolist() == [True, True, False, False]
    assert best_first_paths(Tables(tok, lp, nxt), 4) == [(1,)]


def test_a_batch_of_tables_builds_each_slots_own_tree():
    """Request slots build their trees in one call: equal, field by field, to one call per slot."""
    g = torch.Generator().manual_seed(5)
    b, D, M, K, N = 5, 4, 3, 3, 9
    tokens = torch.randint(0, 50, (b, D, M, K), generator=g)
    logprobs = torch.randn(b, D, M, K, generator=g).sort(-1, descending=True).values
    logprobs[1, 2] = float("-inf")  # dead entries in one slot: padding nodes there
    next_row = torch.randint(-1, M, (b, D, M, K), generator=g)
    roots = torch.randint(0, 50, (b,), generator=g)
    batch = build_tree(Tables(tokens, logprobs, next_row), roots, N)
    for j in range(b):
        one = build_tree(Tables(tokens[j], logprobs[j], next_row[j]), roots[j], N)
        for field in ("tokens", "parents", "depths", "mask", "valid"):
            assert torch.equal(getattr(batch, field)[j], getattr(one, field)), (j, field)


@pytest.mark.parametrize("seed", range(12))
def test_node_paths_give_each_nodes_path_score_and_ranks(seed):
    """node_paths against a walk in plain Python down each node's path: its score (the log-probabilities
    summed), the largest parent row and child rank on it; batched trees give each tree's own."""
    from treeflash_export.tree import node_paths

    g = torch.Generator().manual_seed(seed)
    D, M, K, N = 4, 3, 4, 12
    tables = []
    for _ in range(2):
        lp = (-torch.rand(D, M, K, generator=g) * 3).sort(-1, descending=True).values
        nxt = torch.randint(-1, M, (D, M, K), generator=g)
        nxt[-1] = -1
        tok = torch.stack([torch.stack([torch.randperm(50, generator=g)[:K] for _ in range(M)]) for _ in range(D)])
        tables.append(Tables(tok, lp, nxt))
    batch = Tables(*(torch.stack([getattr(t, f) for t in tables]) for f in ("tokens", "logprobs", "next_row")))
    trees = build_tree(batch, torch.tensor([7, 8]), N)
    got = node_paths(batch, trees)
    for i, t in enumerate(tables):
        tree = build_tree(t, torch.tensor([7 + i]), N)
        assert all(torch.equal(a, b[i]) for a, b in zip(node_paths(t, tree), got))  # batched = one at a time
        tok, lp, nxt = t.tokens.tolist(), t.logprobs.tolist(), t.next_row.tolist()
        walk = {0: (0, 0, 0.0, 0, 0)}  # node -> (row, rank, score, largest row, largest rank)
        for a in range(1, N):
            if not tree.valid[a]:
                assert got[0][i, a] == float("-inf")
                continue
            row_p, rank_p, score_p, m_p, k_p = walk[int(tree.parents[a])]
            d = int(tree.depths[a])
            row = 0 if d == 1 else nxt[d - 2][row_p][rank_p]
            rank = tok[d - 1][row].index(int(tree.tokens[a]))
            walk[a] = (row, rank, score_p + lp[d - 1][row][rank], max(m_p, row), max(k_p, rank))
            assert abs(float(got[0][i, a]) - walk[a][2]) < 1e-5
            assert (int(got[1][i, a]), int(got[2][i, a])) == walk[a][3:], (seed, i, a)
