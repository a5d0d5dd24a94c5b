"""The draft vocabulary: the drafter ranks a subset of the LM head's rows (its training tokens), the
tables still hold token ids, and greedy output stays the verifier's own in every mode."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import PROMPTS, hf_greedy
from oracle import SETTINGS, OracleRunner
from treeflash_runtime import generate
from treeflash_runtime.backends.pytorch import TorchRunner

from treeflash_export.checkpoints import load_pair
from treeflash_export.config import SamplingConfig, TreeConfig
from treeflash_export.errors import CheckpointError, ConfigError
from treeflash_export.models import draft_vocab


def test_token_order_counts_the_weighed_positions_and_keeps_every_token():
    tokens = torch.tensor([[9, 9, 9, 3, 5, 5], [7, 7, 7, 3, 5, 2]])
    # Counted: the last three positions of each row (3, 5, 5 and 3, 5, 2): 5 thrice, 3 twice, 2 once;
    # 7 and 9 only in the prompts, after them in id order.
    assert draft_vocab.token_order(tokens, tokens[:, 3:]) == [5, 3, 2, 7, 9]
    assert draft_vocab.token_order(tokens) == [5, 7, 9, 3, 2]  # ties (3 x 9, 3 x 7, 3 x 5): lower id first


def test_write_read_round_trip_and_bad_files(tmp_path):
    draft_vocab.write(tmp_path, [5, 3, 2], source="test")
    assert draft_vocab.read(tmp_path, 10) == [5, 3, 2]
    assert draft_vocab.read(tmp_path / "missing", 10) is None
    with pytest.raises(CheckpointError, match="distinct token ids in 0..3"):
        draft_vocab.read(tmp_path, 4)  # 5 is outside a vocabulary of 4
    for bad, match in (('{"format": 1, "ids": [1, 1]}', "distinct"), ("{not json", "cannot read"),
                       ('{"format": 2, "ids": [1]}', "cannot read"), ('{"format": 1, "ids": ["a"]}', "cannot read"),
                       ('{"format": 1, "ids": []}', "distinct")):
        (tmp_path / draft_vocab.FILE).write_text(bad)
        with pytest.raises(CheckpointError, match=match):
            draft_vocab.read(tmp_path, 10)


def test_select_sizes():
    order = [7, 2, 9]
    assert draft_vocab.select(order, None, 20).tolist() == [2, 7, 9]  # all of the list, ascending
    assert draft_vocab.select(order, 2, 20).tolist() == [2, 7]
    assert draft_vocab.select(order, 5, 20).tolist() == [0, 1, 2, 7, 9]  # filled with the lowest other ids
    assert draft_vocab.select(None, 3, 20).tolist() == [0, 1, 2]
    assert draft_vocab.select(order, 0, 20) is None and draft_vocab.select(None, None, 20) is None
    assert draft_vocab.select(order, 20, 20) is None  # the whole vocabulary: no subset
    with pytest.raises(CheckpointError, match="between 1 and the vocabulary size 20"):
        draft_vocab.select(order, 21, 20)


def _ids(pair, i):
    return pair.tokenizer(PROMPTS[i])["input_ids"]


@pytest.mark.parametrize("mode", ["treeflash", "marginal", "chain"])
def test_greedy_output_is_the_verifiers_with_a_small_draft_vocabulary(load, mode):
    """A draft vocabulary of a quarter of the tokens (so most tokens the verifier picks cannot be
    drafted): the drafts come from it only, and greedy output equals transformers' own."""
    pair = load("qwen3")
    V = pair.verifier.config.vocab_size
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=256, draft_vocab=V // 4)
    assert runner.draft_vocab_size == V // 4 and runner.head.ids.tolist() == list(range(V // 4))
    tree = TreeConfig(mode=mode, **SETTINGS)
    for i in range(2):
        ids = _ids(pair, i)
        res = generate(runner, ids, tree, SamplingConfig(max_new_tokens=32))
        assert res.token_ids == hf_greedy(pair.verifier, ids, 32), (mode, i)
    runner.begin(torch.tensor(_ids(pair, 0)), tree.resolved(runner.block_size), SamplingConfig())
    tables = runner.stages.tables(runner.state.root[:1], runner.stages.draft(1)[0], tree.resolved(runner.block_size))
    assert int(tables.tokens.max()) < V // 4  # every child token is in the draft vocabulary


def test_oracle_rounds_stay_exact_with_a_draft_vocabulary(load):
    """Deep accepted paths and KV compaction with a draft vocabulary (the oracle plants the truth)."""
    pair = load("qwen3")
    ids = _ids(pair, 0)
    want = hf_greedy(pair.verifier, ids, 48)
    runner = OracleRunner(pair.verifier, pair.drafter, capacity=256, truth=ids + want, seed=3, draft_vocab=64)
    res = generate(runner, ids, TreeConfig(**SETTINGS), SamplingConfig(max_new_tokens=48))
    assert res.token_ids == want and max(res.stats.accept_lengths) >= 3


def test_subset_tables_map_back_to_the_full_vocabularys_tokens(load):
    """When the draft vocabulary holds every token the full-vocabulary expansion would pick (and the
    parents it expands), the tables hold the same tokens and links: the columns map back to ids."""
    pair = load("qwen3")
    V = pair.verifier.config.vocab_size
    # In fp32 (the CPU default may multiply the head in bf16): the columns are compared exactly.
    full = TorchRunner(pair.verifier, pair.drafter, capacity=256, draft_vocab=0, draft_head=torch.float32)
    tree = TreeConfig(mode="treeflash", tree_size=16, top_m=2, top_k=4).resolved(full.block_size)
    full.begin(torch.tensor(_ids(pair, 1)), tree, SamplingConfig())
    z = full.stages.draft(1)[0]
    want = full.stages.tables(full.state.root[:1], z, tree)
    parents = full.verifier.lm_head(full.drafter.model.norm(z)).topk(tree.top_m, dim=-1).indices
    keep = torch.unique(torch.cat([want.tokens.flatten(), parents.flatten(), torch.arange(0, V, 7)]))
    sub = TorchRunner(pair.verifier, pair.drafter, capacity=256, draft_vocab=0, draft_head=torch.float32)
    sub.head.ids = keep
    sub.head.rows = sub.verifier.lm_head.weight.index_select(0, keep)
    sub.draft_vocab_size = len(keep)
    got = sub.stages.tables(full.state.root[:1], z, tree)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.next_row, want.next_row)
    # Log-probabilities are normalised over the draft vocabulary: never lower than over all tokens.
    assert bool((got.logprobs >= want.logprobs - 1e-5).all())


def test_a_drafter_folder_brings_its_draft_vocabulary(pair_dirs, tmp_path):
    src = pair_dirs["qwen3"]
    drafter = tmp_path / "drafter"
    shutil.copytree(src / "drafter", drafter)
    draft_vocab.write(drafter, [11, 4, 30, 2], source="test")
    pair = load_pair(str(src / "verifier"), str(drafter))
    assert pair.drafter.vocab_order == [11, 4, 30, 2]
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=128)
    assert runner.head.ids.tolist() == [2, 4, 11, 30]
    assert TorchRunner(pair.verifier, pair.drafter, capacity=128, draft_vocab=0).head.ids is None
    # A top-K larger than the draft vocabulary is refused before any round.
    with pytest.raises(ConfigError, match="vocabulary 4"):
        generate(runner, _ids(pair, 0), TreeConfig(mode="marginal", tree_size=8, top_k=8),
                 SamplingConfig(max_new_tokens=4))
    (drafter / draft_vocab.FILE).write_text(json.dumps({"format": 1, "ids": [1, 1]}))
    with pytest.raises(CheckpointError, match="draft vocabulary"):
        load_pair(str(src / "verifier"), str(drafter))


@pytest.mark.parametrize("head", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["treeflash", "marginal", "chain"])
def test_the_expansions_head_dtype_leaves_the_output_the_verifiers(load, mode, head):
    """The expansion's LM head rows in bf16 (the default on a CPU with bf16 instructions) or in the
    model's fp32, with and without a draft vocabulary, one sequence and request slots: the trees
    change at most, greedy output stays transformers' own."""
    from test_slots import BUDGETS, engine_for, prompts_of
    from treeflash_runtime.engine import Request

    pair = load("qwen3")
    V = pair.verifier.config.vocab_size
    for vocab in (0, V // 2):
        runner = TorchRunner(pair.verifier, pair.drafter, capacity=256, draft_vocab=vocab, draft_head=head)
        assert runner.draft_head == head
        assert (runner.head.rows is None) == (vocab == 0 and head == torch.float32)
        if runner.head.rows is not None:
            assert runner.head.rows.dtype == head
            assert runner.head.logits(torch.zeros(2, runner.head.rows.shape[1])).dtype == torch.float32
        for i in range(2):
            ids = _ids(pair, i)
            res = generate(runner, ids, TreeConfig(mode=mode, **SETTINGS), SamplingConfig(max_new_tokens=24))
            assert res.token_ids == hf_greedy(pair.verifier, ids, 24), (mode, vocab, i)
    engine = engine_for(pair, mode, draft_head=head)
    prompts = prompts_of(pair)
    requests = [Request(ids, SamplingConfig(max_new_tokens=n, stop_token_ids=())) for ids, n in zip(prompts, BUDGETS)]
    engine.run(requests)
    for r, ids, n in zip(requests, prompts, BUDGETS):
        assert r.tokens == hf_greedy(pair.verifier, ids, n), (mode, ids)


def test_the_head_is_bf16_by_default_only_on_a_cpu_with_bf16_instructions_under_an_fp32_model(monkeypatch):
    from treeflash_runtime.backends.pytorch import draft_head_default

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for avx512_bf16, amx in ((True, False), (False, True), (False, False)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        want = torch.bfloat16 if avx512_bf16 or amx else torch.float32
        assert draft_head_default(cpu, torch.float32) == want
        assert draft_head_default(cpu, torch.float16) == torch.float16  # a 16-bit model keeps its own
        assert draft_head_default(cuda, torch.float32) == torch.float32  # GPUs: the model's dtype
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert draft_head_default(cpu, torch.float32) == torch.float32  # a torch without the checks: fp32
