"""Acceptance rules, top-p, and losslessness of sample-and-match at temperature > 0."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import one_thread
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from treeflash_export.config import DrafterConfig, SamplingConfig, TreeConfig
from treeflash_export.models import TreeFlashDrafter
from treeflash_export.tiny import drafter_config, random_drafter_state, verifier_config
from treeflash_export.tree import Tree, ancestor_mask
from treeflash_runtime import generate
from treeflash_runtime.backends.pytorch import TorchRunner
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

V, NEW = 6, 6  # the block is 4: a round gains at most 4 tokens, so 6 tokens always take two rounds or more
PROMPT = [1, 2, 3]
TREE = dict(tree_size=8, top_m=2, top_k=3)
SAMPLES = 1200


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


@pytest.fixture(scope="module")
def small_vocab_artifacts(small_vocab_pair, pair_dirs, tmp_path_factory):
    """mode -> the small-vocabulary pair exported for ONNX Runtime (the tiny pair's tokenizer files beside
    the verifier: the build copies them, generation here never tokenizes)."""
    import shutil

    from treeflash_export.export.artifact import load_artifact
    from treeflash_export.export.build import BuildConfig, build
    from treeflash_export.tiny import save_drafter

    verifier, drafter = small_vocab_pair
    root = tmp_path_factory.mktemp("small-vocab")
    verifier.save_pretrained(root / "verifier")
    for f in (pair_dirs["qwen3"] / "verifier").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(f, root / "verifier" / f.name)
    dcfg = drafter_config(verifier.config, layers=1, block_size=4, mask_token_id=V - 1)
    save_drafter(root / "drafter", dcfg, drafter.state_dict())
    made = {}

    def get(mode):
        if mode not in made:
            out = build(str(root / "verifier"), str(root / "drafter"), root / mode,
                        BuildConfig(mode=mode, max_seq_len=32, prefill_chunk=8, **TREE), validate=False,
                        log=lambda m: None)
            made[mode] = load_artifact(out)
        return made[mode]

    return get


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
    """P(t1..tNEW) of the first NEW tokens under the verifier's own sequential sampling: one batched pass over
    every sequence of NEW - 1 tokens gives each token's conditional distribution."""
    prefixes = list(itertools.product(range(V), repeat=NEW - 1))
    with torch.no_grad():
        x = torch.tensor([PROMPT + list(s) for s in prefixes])
        logits = verifier(x, attention_mask=torch.ones_like(x)).logits[:, len(PROMPT) - 1:].double()
    cond = {}  # (prefix of j tokens) -> filtered distribution of token j + 1
    for row, s in enumerate(prefixes):
        for j in range(NEW):
            if s[:j] not in cond:
                cond[s[:j]] = _filtered(torch.softmax(logits[row, j] / temperature, -1), top_p)
    probs = {}
    for s in prefixes:
        pr = 1.0
        for j in range(NEW - 1):
            pr *= float(cond[s[:j]][s[j]])
        if pr == 0.0:
            continue
        last = cond[s]
        for t in range(V):
            if last[t] > 0:
                probs[s + (t,)] = pr * float(last[t])
    return probs


def sample_counts(runner, tree_cfg, temperature, top_p, n, rounds=None):
    counts = {}
    with one_thread():
        for seed in range(n):
            res = generate(runner, PROMPT, tree_cfg,
                           SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=NEW, seed=seed))
            key = tuple(res.token_ids)
            counts[key] = counts.get(key, 0) + 1
            if rounds is not None:
                rounds.append(res.stats.rounds)
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


def _runner(backend, mode, small_vocab_pair, small_vocab_artifacts):
    if backend == "torch":
        return TorchRunner(*small_vocab_pair, capacity=32)
    from treeflash_runtime.backends.onnxruntime_backend import OnnxRuntimeRunner

    return OnnxRuntimeRunner(small_vocab_artifacts(mode))


SAMPLING_CASES = [
    # (backend, mode, temperature, top_p): every mode on both backends, top-p 1 and < 1 on each (12 cases)
    ("torch", "treeflash", 1.0, 1.0),
    ("torch", "treeflash", 0.7, 0.8),
    ("torch", "marginal", 1.0, 1.0),
    ("torch", "marginal", 1.0, 0.9),
    ("torch", "chain", 1.0, 1.0),
    ("torch", "chain", 0.8, 0.9),
    ("onnxruntime", "treeflash", 1.0, 1.0),
    ("onnxruntime", "treeflash", 1.2, 0.9),
    ("onnxruntime", "marginal", 1.0, 1.0),
    ("onnxruntime", "marginal", 1.0, 0.8),
    ("onnxruntime", "chain", 1.0, 1.0),
    ("onnxruntime", "chain", 1.0, 0.9),
]
assert sorted({(b, m, p < 1) for b, m, _, p in SAMPLING_CASES}) == sorted(itertools.product(
    ("torch", "onnxruntime"), ("treeflash", "marginal", "chain"), (False, True)))  # no combination missing


@pytest.mark.parametrize("backend,mode,temperature,top_p", SAMPLING_CASES)
def test_speculative_sampling_matches_verifier_distribution(small_vocab_pair, small_vocab_artifacts, backend, mode,
                                                            temperature, top_p):
    """The joint distribution of the first NEW tokens (prefill's token and two rounds or more) equals the
    verifier's own, exactly enumerated."""
    verifier, _ = small_vocab_pair
    runner = _runner(backend, mode, small_vocab_pair, small_vocab_artifacts)
    rounds = []
    counts = sample_counts(runner, TreeConfig(mode=mode, **TREE), temperature, top_p, SAMPLES, rounds)
    assert min(rounds) >= 2 and sum(counts.values()) == SAMPLES
    probs = exact_distribution(verifier, temperature, top_p)
    assert sum(probs.values()) == pytest.approx(1.0)
    assert sum(p * SAMPLES >= 5 for p in probs.values()) >= 4  # a case with several likely outcomes
    assert gof_pvalue(counts, probs, SAMPLES) > ALPHA


def test_goodness_of_fit_detects_a_wrong_distribution(small_vocab_pair):
    """Power check: samples at temperature 0.6 are rejected against the temperature-1 distribution."""
    verifier, drafter = small_vocab_pair
    runner = TorchRunner(verifier, drafter, capacity=32)
    counts = sample_counts(runner, TreeConfig(mode="ar"), 0.6, 1.0, SAMPLES)
    assert gof_pvalue(counts, exact_distribution(verifier, 1.0, 1.0), SAMPLES) < ALPHA


def test_trees_accept_several_tokens_when_sampling(small_vocab_pair):
    """The losslessness test above is meaningful only if sampled rounds really accept drafts."""
    verifier, drafter = small_vocab_pair
    runner = TorchRunner(verifier, drafter, capacity=64)
    res = generate(runner, PROMPT, TreeConfig(mode="treeflash", tree_size=8, top_m=2, top_k=3),
                   SamplingConfig(temperature=1.0, max_new_tokens=40, seed=1))
    assert max(res.stats.accept_lengths) >= 3 and res.stats.mean_accepted > 1.3


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("mode,top_p", [("treeflash", 1.0), ("marginal", 0.9), ("chain", 0.8)])
def test_seed_reproduces_output(small_vocab_pair, small_vocab_artifacts, backend, mode, top_p):
    """The same seed gives the same tokens on the same backend (20 tokens, several rounds), also after
    other generations ran in between; other seeds give other tokens."""
    runner = _runner(backend, mode, small_vocab_pair, small_vocab_artifacts)
    cfg = TreeConfig(mode=mode, **TREE)

    def run(seed):
        with one_thread():
            return generate(runner, PROMPT, cfg, SamplingConfig(temperature=1.0, top_p=top_p, max_new_tokens=20,
                                                                seed=seed)).token_ids

    first = run(4)
    others = {tuple(run(s)) for s in range(5, 10)}
    assert len(first) == 20 and run(4) == first
    assert len(others | {tuple(first)}) > 2


@pytest.mark.parametrize("mode,top_p", [("treeflash", 1.0), ("marginal", 0.8)])
def test_batched_slots_sampling_matches_verifier_distribution(small_vocab_pair, mode, top_p):
    """In-flight batching with keyed sampling: SAMPLES requests (seeds 0..SAMPLES-1) served eight at a
    time through the engine; the joint distribution of their first NEW tokens is the verifier's own."""
    from treeflash_runtime.backends.pytorch import TorchRunner
    from treeflash_runtime.engine import Engine, Request

    verifier, drafter = small_vocab_pair
    runner = TorchRunner(verifier, drafter, max_batch=8, capacity=32, tree=TreeConfig(mode=mode, **TREE))
    requests = [Request(list(PROMPT), SamplingConfig(temperature=1.0, top_p=top_p, max_new_tokens=NEW, seed=seed))
                for seed in range(SAMPLES)]
    engine = Engine(runner)
    with one_thread():
        engine.run(requests)
    counts = {}
    for r in requests:
        counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
    assert max(engine.rounds_by_batch) == 8 and max(len(r.accept_lengths) for r in requests) >= 2
    probs = exact_distribution(verifier, 1.0, top_p)
    assert sum(p * SAMPLES >= 5 for p in probs.values()) >= 4
    assert gof_pvalue(counts, probs, SAMPLES) > ALPHA
