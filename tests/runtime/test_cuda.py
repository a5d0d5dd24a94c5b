"""The exactness checks on a CUDA GPU (fp32), and bf16 agreement with transformers' bf16 greedy output.

Skipped where torch sees no CUDA device.
"""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS
from oracle import SETTINGS, OracleRunner
from transformers import GenerationConfig

from treeflash_export.checkpoints import load_pair
from treeflash_export.config import SamplingConfig, TreeConfig
from treeflash_runtime import generate
from treeflash_runtime.backends.pytorch import TorchRunner
from treeflash_runtime.backends.pytorch.graphs import round_key
from treeflash_runtime.plan import RoundPlan
from treeflash_runtime.sampling import GREEDY

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; torch sees none"),
]
MODES = ["treeflash", "marginal", "chain", "ar"]


def _greedy(model, ids, n):
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=[], pad_token_id=0)
    out = model.generate(torch.tensor([ids], device=model.device), generation_config=cfg)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("fast_kernels", [True, False], ids=["fast-kernels", "torch-ops"])
@pytest.mark.parametrize("name", ["qwen3", "llama"])
@pytest.mark.parametrize("mode", MODES)
def test_cuda_fp32_greedy_equals_verifier(pair_dirs, name, mode, fast_kernels):
    """Token for token, fast kernels included. Only the verifier's kernels can change the output (the
    drafter's decide acceptance, never the tokens); they divide and take square roots correctly
    rounded in float32 (layer_ops._rstd, the attention merge's div_rn). What still differs from
    PyTorch's own path is the order of sums and the exponential's last bits (about 1e-7 relative),
    so equality is the claim for models whose top two logits are not that close, as these are."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    d = pair_dirs[name]
    pair = load_pair(str(d / "verifier"), str(d / "drafter"), device="cuda", dtype=torch.float32)
    for i, prompt in enumerate(PROMPTS):
        ids = pair.tokenizer(prompt)["input_ids"]
        ref = _greedy(pair.verifier, ids, 64)
        runner = TorchRunner(pair.verifier, pair.drafter, capacity=256, fast_kernels=fast_kernels)
        assert runner.use_graphs and runner.fast_kernels == fast_kernels
        res = generate(runner, ids, TreeConfig(mode=mode, **SETTINGS), SamplingConfig(max_new_tokens=64))
        assert res.token_ids == ref, (name, mode, i)
        if mode != "ar":
            oracle = OracleRunner(pair.verifier, pair.drafter, capacity=256, truth=ids + ref, seed=i,
                                  fast_kernels=fast_kernels)
            res = generate(oracle, ids, TreeConfig(mode=mode, **SETTINGS), SamplingConfig(max_new_tokens=64))
            assert res.token_ids == ref, (name, mode, i, "oracle")


@pytest.mark.parametrize("mode", MODES)
def test_cuda_bf16_departs_from_verifier_bf16_only_at_near_ties(pair_dirs, mode):
    """bf16 kernels round differently for a tree batch than for one token, so on a random model (whose
    logits are close together) a near-tie may flip: where the output first departs from transformers'
    bf16 greedy output, the two tokens' float32 logits after that prefix must be within 2% of the
    logits' range (a rounding difference, not a wrong token). The agreement length is reported."""
    d = pair_dirs["qwen3"]
    pair = load_pair(str(d / "verifier"), str(d / "drafter"), device="cuda", dtype=torch.bfloat16)
    exact = load_pair(str(d / "verifier"), None, device="cuda", dtype=torch.float32).verifier
    for prompt in PROMPTS:
        ids = pair.tokenizer(prompt)["input_ids"]
        ref = _greedy(pair.verifier, ids, 64)
        runner = TorchRunner(pair.verifier, pair.drafter, capacity=256)
        out = generate(runner, ids, TreeConfig(mode=mode, **SETTINGS), SamplingConfig(max_new_tokens=64)).token_ids
        agree = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), len(ref))
        print(f"bf16 {mode}: {agree}/64 tokens agree")
        if agree < len(ref):
            with torch.no_grad():
                logits = exact(torch.tensor([ids + out[:agree]], device="cuda")).logits[0, -1].float()
            gap = (logits[out[agree]] - logits[ref[agree]]).abs().item()
            assert gap <= 0.02 * (logits.max() - logits.min()).item(), (mode, agree, gap)


@pytest.mark.parametrize("mode", MODES)
def test_cuda_graph_replay_never_synchronises_and_equals_eager(pair_dirs, mode):
    """A captured round replays with no host synchronisation (CUDA's sync-debug mode raises on one),
    and graphs on and off give the same tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    d = pair_dirs["qwen3"]
    pair = load_pair(str(d / "verifier"), str(d / "drafter"), device="cuda", dtype=torch.float32)
    ids = pair.tokenizer(PROMPTS[0])["input_ids"]
    outs = []
    for graphs in (True, False):
        runner = TorchRunner(pair.verifier, pair.drafter, capacity=256, cuda_graphs=graphs)
        outs.append(generate(runner, ids, TreeConfig(mode=mode, **SETTINGS), SamplingConfig(max_new_tokens=48)).token_ids)
        if graphs:
            tree = TreeConfig(mode=mode, **SETTINGS).resolved(runner.block_size)
            graph = runner.graphs[round_key(1, tree, GREEDY, False, None)]
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                graph()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert outs[0] == outs[1]


@pytest.mark.parametrize("mode,temperature,top_p", [("treeflash", 1.0, 1.0), ("marginal", 0.7, 0.8)])
def test_cuda_graph_sampling_matches_verifier_distribution(mode, temperature, top_p):
    """The sampling test of test_sampling on the device-resident round, captured in CUDA graphs."""
    import copy

    from test_sampling import ALPHA, exact_distribution, gof_pvalue, make_small_vocab_pair, sample_counts

    verifier, drafter = make_small_vocab_pair()
    probs = exact_distribution(verifier, temperature, top_p)  # on the CPU copy
    runner = TorchRunner(copy.deepcopy(verifier).cuda(), copy.deepcopy(drafter).cuda(), capacity=32)
    assert runner.use_graphs
    n = 1200
    counts = sample_counts(runner, TreeConfig(mode=mode, tree_size=8, top_m=2, top_k=3), temperature, top_p, n)
    assert gof_pvalue(counts, probs, n) > ALPHA


def test_cuda_graph_stage_times_leave_the_generation_unchanged(pair_dirs):
    """The benchmark's in-graph stage breakdown: every stage timed, and the state restored, so the
    rounds after it give the same tokens as rounds never interrupted."""
    d = pair_dirs["qwen3"]
    pair = load_pair(str(d / "verifier"), str(d / "drafter"), device="cuda", dtype=torch.float32)
    prompt = torch.tensor(pair.tokenizer(PROMPTS[0])["input_ids"], device="cuda")
    tree = TreeConfig(mode="treeflash", **SETTINGS)
    streams = []
    for timed in (False, True):
        runner = TorchRunner(pair.verifier, pair.drafter, capacity=256)
        tokens = [runner.begin(prompt, tree, SamplingConfig())]
        for i in range(8):
            if timed and i == 3:
                past = int(runner.state.past_len)
                times = runner.stage_times(RoundPlan(tree=tree), 4)
                assert set(times) == {"draft", "expand", "tree", "verify", "accept"}, times
                assert all(ms > 0 for ms in times.values()) and int(runner.state.past_len) == past
            tokens += runner.round()
        streams.append(tokens)
    assert streams[0] == streams[1]


@pytest.mark.parametrize("tuned", [False, True], ids=["deployment-tree", "self-tuning"])
def test_cuda_slots_fp32_each_request_equals_its_own_greedy(pair_dirs, tmp_path, tuned):
    """Request slots on CUDA, every bucket's graphs captured at start-up, five requests through three
    slots joining as others leave: each equals its own greedy decoding. Self-tuning (cheap trees by
    hand, so that trees are explored and chosen): exploration rounds run eagerly on the graph runner,
    the choices are captured mid-stream, and the output is the same."""
    from test_tuning import _sources, costs, serve_five, tuner_for

    from treeflash_runtime.engine import Engine

    torch.backends.cuda.matmul.allow_tf32 = False
    d = pair_dirs["qwen3"]
    pair = load_pair(str(d / "verifier"), str(d / "drafter"), device="cuda", dtype=torch.float32)
    runner = TorchRunner(pair.verifier, pair.drafter, max_batch=3, capacity=128,
                         tree=TreeConfig(mode="treeflash", tree_size=16, top_m=4, top_k=8))
    assert runner.use_graphs and ("round", 3, runner.deployment[3], GREEDY, False, None) in runner.graphs
    tuner = None
    if tuned:
        tuner = tuner_for(runner, _sources(pair_dirs), tmp_path, costs(ar=10.0, tree=11.0))
    for r, ids, n in serve_five(Engine(runner, policy=tuner), pair, [24, 10, 18, 32, 14]):
        assert r.tokens == _greedy(pair.verifier, ids, n), r.tokens
    if tuned:
        used = tuner.report()["settings_used"]
        assert len(used) >= 2 and any(not label.startswith("ar") for label in used), used
