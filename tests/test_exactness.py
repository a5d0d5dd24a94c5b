"""The product's promise: greedy speculative output == the verifier's own greedy output, token for token.

Random drafters accept almost nothing, so an oracle drafter also hides the
verifier's true continuation inside otherwise wrong tables: long accepted
paths, deep branches and KV compaction are then really exercised.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import PROMPTS, hf_greedy

from treeflash_export.config import SamplingConfig, TreeConfig
from treeflash_export.tree import Tables, build_tree
from treeflash_runtime import generate
from treeflash_runtime.backends.torch_backend import TorchRunner

NEW_TOKENS = 64
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

    def tables(self, root, z, tree):
        return self.oracle.plant(super().tables(root, z, tree), int(self.state.past_len))


def _ids(pair, prompt):
    return pair.tokenizer(prompt)["input_ids"]


@pytest.fixture(scope="module")
def references(load):
    """(pair name, prompt index) -> the verifier's greedy continuation via transformers."""
    cache = {}

    def get(name, i):
        if (name, i) not in cache:
            pair = load(name)
            cache[name, i] = hf_greedy(pair.verifier, _ids(pair, PROMPTS[i]), NEW_TOKENS)
        return cache[name, i]

    return get


CASES = [("qwen3", m) for m in ("treeflash", "marginal", "chain", "ar")] + \
        [("llama", m) for m in ("treeflash", "marginal", "chain", "ar")] + \
        [("qwen3-dflash", m) for m in ("marginal", "chain")]


# The runtime with the Hugging Face modules and the PyTorch tree build (the CPU default), and with the
# fast kernels' merged projections, fused layer ops and one-kernel tree build (the CUDA default; their
# PyTorch references here).
KERNELS = pytest.mark.parametrize("fast_kernels", [False, True], ids=["torch-ops", "fast-kernels"])


@KERNELS
@pytest.mark.parametrize("name,mode", CASES)
def test_greedy_equals_verifier_with_real_drafter(load, references, name, mode, fast_kernels):
    pair = load(name)
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=256, fast_kernels=fast_kernels)
    for i in range(len(PROMPTS)):
        res = generate(runner, _ids(pair, PROMPTS[i]), TreeConfig(mode=mode, **SETTINGS),
                       SamplingConfig(max_new_tokens=NEW_TOKENS))
        assert res.token_ids == references(name, i), (name, mode, i)
        assert res.stats.new_tokens == NEW_TOKENS and res.stop_reason == "max_new_tokens"


@KERNELS
@pytest.mark.parametrize("name,mode", [c for c in CASES if c[1] != "ar"])
def test_greedy_equals_verifier_with_oracle_drafter(load, references, name, mode, fast_kernels):
    pair = load(name)
    gains = []
    for i in range(len(PROMPTS)):
        ids = _ids(pair, PROMPTS[i])
        ref = references(name, i)
        runner = OracleRunner(pair.verifier, pair.drafter, capacity=256, truth=ids + ref, seed=i,
                              fast_kernels=fast_kernels)
        res = generate(runner, ids, TreeConfig(mode=mode, **SETTINGS), SamplingConfig(max_new_tokens=NEW_TOKENS))
        assert res.token_ids == ref, (name, mode, i)
        gains += res.stats.accept_lengths
    # The oracle makes rounds accept several tokens, some over most of the block.
    block = pair.drafter_cfg.block_size
    assert max(gains) >= block - 2, gains
    assert sum(gains) / len(gains) > 2.0, gains
    assert sum(g > 1 for g in gains) >= len(gains) // 2, gains


def test_oracle_tree_has_deep_branches_off_the_true_path(load):
    """Guard on the oracle itself: its trees do branch (several children per depth) and go deep."""
    pair = load("qwen3")
    ids = _ids(pair, PROMPTS[0])
    runner = OracleRunner(pair.verifier, pair.drafter, capacity=256, truth=ids + [1] * 64, seed=0)
    cfg = TreeConfig(**SETTINGS)
    runner.begin(torch.tensor(ids), cfg, SamplingConfig())
    tables = runner.tables(runner.state.root, runner.draft(), cfg)
    tree = build_tree(tables, runner.state.root, cfg.tree_size)
    depths = tree.depths[tree.valid]
    assert int(depths.max()) >= 4
    assert int((depths == 1).sum()) >= 2 and int((depths == 2).sum()) >= 2


def test_stop_token_and_budget(load, references):
    pair = load("qwen3")
    ids = _ids(pair, PROMPTS[1])
    ref = references("qwen3", 1)
    stop = ref[20]
    first = ref.index(stop)
    runner = OracleRunner(pair.verifier, pair.drafter, capacity=256, truth=ids + ref, seed=3)
    res = generate(runner, ids, TreeConfig(**SETTINGS), SamplingConfig(max_new_tokens=64, stop_token_ids=(stop,)))
    assert res.token_ids == ref[: first + 1] and res.stop_reason == "stop_token"
    res = generate(runner, ids, TreeConfig(**SETTINGS), SamplingConfig(max_new_tokens=7))
    assert res.token_ids == ref[:7] and res.stop_reason == "max_new_tokens"
    res = generate(runner, ids, TreeConfig(**SETTINGS), SamplingConfig(max_new_tokens=1))
    assert res.token_ids == ref[:1] and res.stats.rounds == 0
