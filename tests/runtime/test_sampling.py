"""Acceptance rules, top-p, and losslessness of sample-and-match at temperature > 0."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from treeflash_export.config import DrafterConfig, SamplingConfig, TreeConfig
from treeflash_export.models import TreeFlashDrafter
from treeflash_export.tiny import drafter_config, random_drafter_state, verifier_config
from treeflash_export.tree import Tree, ancestor_mask
from treeflash_runtime import generate
from treeflash_runtime.backends.torch_backend import TorchRunner
from treeflash_runtime.sampling import accept, verifier_probs

ALPHA = 1e-3  # significance level of the goodness-of-fit tests


def _tree(tokens, parents, valid=None):
    parents = torch.tensor(parents)
    mask = ancestor_mask(parents, len(tokens))
    return Tree(torch.tensor(tokens), parents, mask.sum(-1) - 1, mask,
                torch.tensor(valid) if valid is not None else torch.ones(len(tokens), dtype=torch.bool))


def test_accept_takes_the_deepest_matching_path():
    #        0(r)
    #      /   |   \
    #    1:a  2:b  3:c
    #    |     |
    #   4:d   5:e
    #          |
    #         6:f
    tree = _tree([9, 10, 11, 12, 13, 14, 15], [-1, 0, 0, 0, 1, 2, 5])
    # y[a] = verifier's token after node a. Root -> 11 (node 2), node 2 -> 14 (node 5), node 5 -> 99 (no child).
    y = torch.tensor([11, 13, 14, 0, 0, 99, 0])
    assert _accepted(tree, y) == ([0, 2, 5], 99)
    # Node 4 (d) matches y[1] but node 1 itself does not match y[0]: not accepted.
    y = torch.tensor([50, 13, 0, 0, 0, 0, 0])
    assert _accepted(tree, y) == ([0], 50)
    # Whole depth-3 path accepted: bonus comes from the leaf.
    y = torch.tensor([11, 0, 14, 0, 0, 15, 77])
    assert _accepted(tree, y) == ([0, 2, 5, 6], 77)
    # Fixed shape: the path is padded to max_path entries with the other nodes, in index order.
    path, tau, bonus = accept(tree, torch.tensor([11, 13, 14, 0, 0, 99, 0]), 5)
    assert path.tolist() == [0, 2, 5, 1, 3] and int(tau) == 3 and int(bonus) == 99


def _accepted(tree, y):
    path, tau, bonus = accept(tree, y)
    assert path.shape == (tree.size,) and sorted(path.tolist()) == list(range(tree.size))
    return path[: int(tau)].tolist(), int(bonus)


def test_padding_nodes_are_never_accepted():
    tree = _tree([9, 10, 0], [-1, 0, 0], valid=[True, True, False])
    # y[root] = 0 equals the padding token
    assert _accepted(tree, torch.tensor([0, 5, 5])) == ([0], 0)


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = verifier_probs(logits, 1.0, 0.8)
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = verifier_probs(logits, 1.0, 0.81)
    assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    p = verifier_probs(logits, 1.0, 0.1)  # the top token always survives
    assert torch.allclose(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


# ---------------------------------------------------------------- losslessness

V, NEW = 6, 3
PROMPT = [1, 2, 3]


def make_small_vocab_pair():
    vcfg = verifier_config("qwen3", V, hidden=32, layers=2, eos=0)
    vcfg.initializer_range = 0.6  # peaked distributions: drafts get accepted often
    torch.manual_seed(11)
    verifier = AutoModelForCausalLM.from_config(vcfg).eval()
    dcfg = drafter_config(vcfg, layers=1, block_size=4, mask_token_id=V - 1)
    drafter = TreeFlashDrafter(DrafterConfig.from_hf(dcfg))
    drafter.load_state_dict(random_drafter_state(dcfg, 5))
    return verifier, drafter.eval()


@pytest.fixture(scope="module")
def small_vocab_pair():
    return make_small_vocab_pair()


def _filtered(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter written independently of the runtime: walk tokens by probability."""
    order = sorted(range(len(p)), key=lambda i: -float(p[i]))
    keep, mass = [], 0.0
    for i in order:
        keep.append(i)
        mass += float(p[i])
        if mass >= top_p:
            break
    q = torch.zeros_like(p)
    q[keep] = p[keep]
    return q / q.sum()


def exact_distribution(verifier, temperature, top_p):
    """P(a, b, c) of the first NEW tokens under the verifier's own sequential sampling."""
    seqs = list(itertools.product(range(V), repeat=NEW))
    probs = {}
    with torch.no_grad():
        for s in seqs:
            logits = verifier(torch.tensor([PROMPT + list(s[:-1])])).logits[0, len(PROMPT) - 1:]
            pr = 1.0
            for j, t in enumerate(s):
                pr *= float(_filtered(torch.softmax(logits[j].double() / temperature, -1), top_p)[t])
            probs[s] = pr
    return probs


def sample_counts(runner, tree_cfg, temperature, top_p, n):
    counts = {}
    for seed in range(n):
        res = generate(runner, PROMPT, tree_cfg,
                       SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=NEW, seed=seed))
        key = tuple(res.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


def gof_pvalue(counts, probs, n):
    """Chi-square goodness of fit; categories with expected count < 5 are pooled into one."""
    obs, exp, pooled_o, pooled_e = [], [], 0, 0.0
    for s, p in probs.items():
        if p * n >= 5:
            obs.append(counts.get(s, 0))
            exp.append(p * n)
        else:
            pooled_o += counts.get(s, 0)
            pooled_e += p * n
    obs.append(pooled_o + sum(c for s, c in counts.items() if s not in probs))
    exp.append(pooled_e)
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp_t = torch.tensor(exp, dtype=torch.float64)
    exp_t = exp_t * (sum(obs) / exp_t.sum())  # remove rounding drift
    return chisquare(obs, exp_t.tolist()).pvalue


@pytest.mark.parametrize("mode,temperature,top_p", [
    ("treeflash", 1.0, 1.0),
    ("treeflash", 0.7, 0.8),
    ("marginal", 1.0, 0.9),
])
def test_speculative_sampling_matches_verifier_distribution(small_vocab_pair, mode, temperature, top_p):
    verifier, drafter = small_vocab_pair
    n = 1200
    runner = TorchRunner(verifier, drafter, capacity=32)
    tree_cfg = TreeConfig(mode=mode, tree_size=8, top_m=2, top_k=3)
    counts = sample_counts(runner, tree_cfg, temperature, top_p, n)
    probs = exact_distribution(verifier, temperature, top_p)
    assert gof_pvalue(counts, probs, n) > ALPHA


def test_goodness_of_fit_detects_a_wrong_distribution(small_vocab_pair):
    """Power check: samples at temperature 0.6 are rejected against the temperature-1 distribution."""
    verifier, drafter = small_vocab_pair
    n = 1200
    runner = TorchRunner(verifier, drafter, capacity=32)
    counts = sample_counts(runner, TreeConfig(mode="ar"), 0.6, 1.0, n)
    assert gof_pvalue(counts, exact_distribution(verifier, 1.0, 1.0), n) < ALPHA


def test_trees_accept_several_tokens_when_sampling(small_vocab_pair):
    """The losslessness test above is meaningful only if sampled rounds really accept drafts."""
    verifier, drafter = small_vocab_pair
    runner = TorchRunner(verifier, drafter, capacity=64)
    res = generate(runner, PROMPT, TreeConfig(mode="treeflash", tree_size=8, top_m=2, top_k=3),
                   SamplingConfig(temperature=1.0, max_new_tokens=40, seed=1))
    assert max(res.stats.accept_lengths) >= 3 and res.stats.mean_accepted > 1.3


def test_seed_reproduces_output(small_vocab_pair):
    verifier, drafter = small_vocab_pair
    runner = TorchRunner(verifier, drafter, capacity=64)
    cfg = TreeConfig(mode="treeflash", tree_size=8, top_m=2, top_k=3)

    def run(seed):
        return generate(runner, PROMPT, cfg, SamplingConfig(temperature=1.0, max_new_tokens=30, seed=seed)).token_ids

    assert run(4) == run(4)
    assert len({tuple(run(s)) for s in range(5)}) > 1
