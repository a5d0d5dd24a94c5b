"""Oracle drafters for the exactness tests: the verifier's true continuation planted in
otherwise wrong tables, so long accepted paths, deep branches and KV compaction are really
exercised (random drafters accept almost nothing)."""

from __future__ import annotations

import random

import torch

from treeflash_export.tree import Tables, build_tree
from treeflash_runtime.backends.onnxruntime_backend import OnnxRuntimeRunner
from treeflash_runtime.backends.pytorch import TorchRunner

SETTINGS = dict(tree_size=24, top_m=4, top_k=4)


class Oracle:
    """Plants the true continuation in transition tables at random ranks, wired through random
    rows, with steep synthetic scores that make the tree deep. Some rounds stop knowing the truth
    after a few depths, so wrong branches and partial acceptance occur too."""

    def __init__(self, truth: list[int], seed: int):
        self.truth = truth  # prompt + the verifier's greedy continuation
        self.rng = random.Random(seed)

    def plant(self, t: Tables, past_len: int) -> Tables:
        tok, nxt = t.tokens.clone(), t.next_row.clone()
        D, M, K = tok.shape
        lp = -0.05 - 1.2 * torch.arange(K, dtype=torch.float32, device=tok.device).expand(D, M, K).clone()
        row = 0
        for d in range(D):
            pos = past_len + 1 + d
            if pos >= len(self.truth) or self.rng.random() < 0.1:
                break  # the oracle stops knowing: the rest of the tree is wrong
            true_tok = self.truth[pos]
            rank = min(self.rng.choice([0, 0, 1, 2]), K - 1)
            r = tok[d, row]
            dup = (r == true_tok).nonzero()
            if len(dup):  # keep tokens distinct within the row
                r[int(dup[0])] = r[rank]
            r[rank] = true_tok
            nxt_row = self.rng.randrange(M) if d + 1 < D else -1
            nxt[d, row, rank] = nxt_row
            row = max(nxt_row, 0)
        return Tables(tok, lp, nxt)


class OracleRunner(TorchRunner):
    """Runs the real drafter (so its context cache is exercised), then plants the truth into the
    tables of the device-resident round (eagerly: the oracle itself reads host values)."""

    def __init__(self, *args, truth: list[int], seed: int, **kw):
        super().__init__(*args, cuda_graphs=False, **kw)
        self.oracle = Oracle(truth, seed)
        real = self.stages.tables  # the expansion's stage, wrapped from outside
        self.stages.tables = lambda root, z, tree: self.oracle.plant(real(root, z, tree), int(self.state.past_len))


class OracleOrtRunner(OnnxRuntimeRunner):
    """Runs the real draft and expand graphs, then swaps in a tree that hides the true
    continuation (as OracleRunner does), so the ONNX verify graph and the runtime's KV
    compaction see rounds that accept many tokens."""

    def __init__(self, art, truth, seed):
        super().__init__(art)
        self.oracle = Oracle(truth, seed)

    def propose(self, root, ctx, ctx_start, past_len, tree):
        real = super().propose(root, ctx, ctx_start, past_len, tree)
        D, M, K = self.block_size - 1, tree.top_m, tree.top_k
        g = torch.Generator().manual_seed(past_len)
        tok = torch.stack([torch.stack([torch.randperm(self.vocab_size, generator=g)[:K] for _ in range(M)])
                           for _ in range(D)])
        nxt = torch.randint(0, M, (D, M, K), generator=g)
        nxt[-1] = -1
        planted = self.oracle.plant(Tables(tok, torch.zeros(D, M, K), nxt), past_len)
        out = build_tree(planted, root, tree.tree_size)
        assert out.size == real.size
        return out
