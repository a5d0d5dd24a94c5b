"""The product's promise: greedy speculative output == the verifier's own greedy output, token for token.

Random drafters accept almost nothing, so an oracle drafter also hides the
verifier's true continuation inside otherwise wrong tables: long accepted
paths, deep branches and KV compaction are then really exercised.
"""

from __future__ import annotations


import pytest
import torch
from conftest import PROMPTS, hf_greedy
from oracle import SETTINGS, OracleRunner

from treeflash_export.config import SamplingConfig, TreeConfig
from treeflash_export.tree import build_tree
from treeflash_runtime import generate
from treeflash_runtime.backends.pytorch import TorchRunner

NEW_TOKENS = 64
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
    tables = runner.stages.tables(runner.state.root[:1], runner.stages.draft(1)[0], cfg)
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
