"""The GPU fast path's pieces that CPU can prove: the in-place model forms against the exported
forms, the tree-attention kernel (Triton's interpreter on CPU, compiled on CUDA) against its
reference, a round that reads no host value, and the cache-size check."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from treeflash_export.config import SamplingConfig, TreeConfig
from treeflash_export.errors import ConfigError
from treeflash_export.models.common import attend
from treeflash_export.tree import chain_tree
from treeflash_kernels import tree_attention as ta
from treeflash_runtime.backends.pytorch import TorchRunner
from treeflash_runtime.plan import RoundPlan
from treeflash_runtime.sampling import sampling_kind

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(ta.triton is None, reason="triton is not installed (pip install triton)")


def attention_problem(Hq, Hkv, n, S, D, P, *, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((Hq, n, D), (Hkv, S, D), (Hkv, S, D)))
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]  # a random tree
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
    return (q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), torch.tensor(P, device=device),
            mask.to(device))


# (Hq, Hkv, n, S, D, P): grouped and plain heads, one query, an empty prefix, a full cache.
SHAPES = [(4, 2, 5, 40, 16, 13), (4, 2, 1, 40, 16, 0), (6, 2, 7, 100, 32, 60), (4, 4, 3, 64, 16, 61),
          (8, 2, 16, 130, 16, 100), (2, 1, 1, 300, 64, 299)]
IDS = ["Hq{}-Hkv{}-n{}-S{}-D{}-P{}".format(*s) for s in SHAPES]


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_reference_is_the_concatenated_form(shape):
    """The in-place definition equals the exported graphs' form: the prefix sliced to P, the new
    nodes appended under the tree mask, K/V repeated per group (models.common.attend)."""
    q, k, v, past, mask = attention_problem(*shape)
    P, n = int(past), q.shape[1]
    full = torch.cat([torch.ones(n, P, dtype=torch.bool), mask], dim=1)
    want = attend(q, k[:, : P + n], v[:, : P + n], full)
    got = ta.tree_attention_reference(q, k, v, past, mask)
    assert (got - want).abs().max() < 1e-5
    assert (ta.tree_attention_reference(q, k, v, past, mask, key_bound=P + n) - got).abs().max() < 1e-6


@needs_triton
@pytest.mark.parametrize("splits", [0, 1, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_kernel_matches_reference_fp32(shape, splits):
    q, k, v, past, mask = attention_problem(*shape, device=DEVICE)
    out = ta.tree_attention_triton(q, k, v, past, mask, splits=splits)
    ref = ta.tree_attention_reference(q, k, v, past, mask)
    assert out.shape == ref.shape == (shape[2], shape[0] * shape[4])
    assert (out - ref).abs().max() < 1e-5  # seen: about 3e-7


@needs_triton
def test_kernel_reads_the_cache_in_place_and_stops_at_the_length():
    """A layer's K/V as views of the runtime's [L, 2, Hkv, S, D] cache, and garbage (NaN) in every
    slot past P + n: the kernel must neither copy nor look past the length."""
    q, k, v, past, mask = attention_problem(4, 2, 6, 96, 16, 37, device=DEVICE)
    cache = torch.full((3, 2, 2, 96, 16), float("nan"), device=DEVICE)
    cache[1, 0, :, :43], cache[1, 1, :, :43] = k[:, :43], v[:, :43]
    out = ta.tree_attention_triton(q, cache[1, 0], cache[1, 1], past, mask)
    ref = ta.tree_attention_reference(q, k, v, past, mask)
    assert (out - ref).abs().max() < 1e-5


def batched_problem(lengths, Hq=4, Hkv=2, n=5, S=48, D=16, seed=1, device="cpu"):
    """Slots with their own lengths and trees, their caches side by side on one sequence axis (as a
    serving batch lays them out: [Hkv, M * S, D], slot m at m * S..), seen as [M, Hkv, S, D] views.
    Every slot's cache past its own P + n, and every other slot's range, is NaN: reading it shows."""
    M = len(lengths)
    probs = [attention_problem(Hq, Hkv, n, S, D, P, seed=seed + m) for m, P in enumerate(lengths)]
    q = torch.stack([p[0] for p in probs])
    flat = torch.full((2, Hkv, M * S, D), float("nan"))
    for m, (_, k, v, past, _) in enumerate(probs):
        live = int(past) + n
        flat[0, :, m * S : m * S + live], flat[1, :, m * S : m * S + live] = k[:, :live], v[:, :live]
    view = flat.to(device).view(2, Hkv, M, S, D).transpose(1, 2)  # [2, M, Hkv, S, D], strided
    past = torch.tensor(lengths, device=device)
    mask = torch.stack([p[4] for p in probs]).to(device)
    return q.to(device), view[0], view[1], past, mask, probs  # probs: each slot alone, on the CPU


@pytest.mark.parametrize("lengths", [[13, 0, 40], [7], [0, 43, 20, 1]], ids=["three", "one", "four"])
def test_batched_reference_is_each_slot_alone(lengths):
    q, k, v, past, mask, probs = batched_problem(lengths)
    got = ta.tree_attention_reference(q, k.nan_to_num(), v.nan_to_num(), past, mask)
    for m, args in enumerate(probs):
        live = int(args[3]) + 5
        want = ta.tree_attention_reference(*args, key_bound=live)
        assert (got[m] - want).abs().max() < 1e-5, m


@pytest.mark.skipif(ta.triton is None, reason="triton is not installed (pip install triton)")
@pytest.mark.parametrize("lengths,splits", [([13, 0, 40], 0), ([0, 43, 20, 1], 3), ([7], 2)],
                         ids=["three", "four-split3", "one-split2"])
def test_batched_kernel_reads_only_each_slots_own_keys(lengths, splits):
    """Each slot attends to its own cache up to its own P + n: the NaN everywhere else never shows."""
    from treeflash_kernels.ops import tree_attention

    q, k, v, past, mask, probs = batched_problem(lengths, device=DEVICE)
    got = ta.tree_attention_triton(q, k, v, past, mask, splits=splits).cpu()
    assert got.shape == (len(lengths), 5, 4 * 16) and bool(got.isfinite().all())
    for m, args in enumerate(probs):
        assert (got[m] - ta.tree_attention_reference(*args)).abs().max() < 1e-5, m
    assert tree_attention(q, k.nan_to_num(), v.nan_to_num(), past, mask).shape == got.shape  # the op takes both


@pytest.mark.skipif(ta.triton is None, reason="triton is not installed (pip install triton)")
def test_rows_read_the_cache_ranges_slot_ids_name_in_place():
    """A prefill of some slots: row m reads range slot_ids[m] of caches holding more ranges, in place
    (the kernel) and by gathering only the first key_bound slots (the reference): both equal each
    slot alone."""
    q, k, v, past, mask, probs = batched_problem([13, 0, 40, 7], device=DEVICE)
    ids = torch.tensor([2, 0], device=DEVICE)
    got = ta.tree_attention_triton(q[ids], k, v, past[ids], mask[ids], slot_ids=ids).cpu()
    ref = ta.tree_attention_reference(q[ids], k.nan_to_num(), v.nan_to_num(), past[ids], mask[ids], key_bound=45,
                                      slot_ids=ids).cpu()
    for row, m in enumerate(ids.tolist()):
        want = ta.tree_attention_reference(*probs[m])
        assert (got[row] - want).abs().max() < 1e-5 and (ref[row] - want).abs().max() < 1e-5, m


def test_launch_plan_is_static_and_covers_the_cache():
    for n, S in [(1, 4096), (64, 4096), (64, 8192), (7, 33)]:
        plan = ta.launch_plan(n, 32, 8, S, 128)
        assert plan["splits"] * plan["split_len"] >= S and plan["split_len"] % plan["block_n"] == 0
        assert plan["row_blocks"] * plan["block_m"] >= plan["G"] * n
    # A single query at 8 K/V heads still spreads over many programs (about two per H100 SM).
    plan = ta.launch_plan(1, 32, 8, 8192, 128)
    assert plan["row_blocks"] * 8 * plan["splits"] >= 256


@pytest.mark.skipif(ta.triton is None, reason="triton is not installed (pip install triton)")
def test_key_splits_share_the_current_length_not_the_capacity():
    """A short prompt in a long cache: the P + n keys are divided among all the launch's splits (each
    sees keys, so has a finite max), not the capacity (which left 4 of these 8 splits idle)."""
    q, k, v, past, mask = attention_problem(4, 2, 4, 1024, 16, 508, device=DEVICE)  # P + n = 512 keys, S = 1024
    o, m, l_sum, plan = ta.split_partials(q[None], k[None], v[None], past.reshape(1), mask[None], splits=8)
    assert plan["splits"] == 8 and plan["block_n"] == 64
    assert bool(m.isfinite().all()), [bool(m[t].isfinite().any()) for t in range(8)]
    assert (ta.tree_attention_triton(q, k, v, past, mask, splits=8)
            - ta.tree_attention_reference(q, k, v, past, mask)).abs().max() < 1e-5


def test_custom_op_fake_and_cpu_path():
    from treeflash_kernels.ops import tree_attention

    args = attention_problem(4, 2, 5, 40, 16, 13)
    assert torch.equal(tree_attention(*args), ta.tree_attention_reference(*args))
    torch.library.opcheck(tree_attention, args)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-2), (torch.bfloat16, 3e-2)])
def test_kernel_16_bit_cuda(dtype, tol):
    for shape in [(32, 8, 1, 4096, 128, 4000), (32, 8, 64, 4096, 128, 600)]:
        q, k, v, past, mask = attention_problem(*shape, dtype=dtype, device="cuda")
        ref = ta.tree_attention_reference(q.float(), k.float(), v.float(), past, mask)
        err = (ta.tree_attention_triton(q, k, v, past, mask).float() - ref).abs().max().item()
        assert err < tol, err


# ---------------------------------------------------------------- in-place model forms


@torch.no_grad()
def test_in_place_verifier_equals_the_exported_form(load):
    pair = load("qwen3")
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=64)
    v = runner.verifier
    prompt = torch.tensor(pair.tokenizer("def main(argv):\n")["input_ids"])
    P = prompt.shape[0]
    cache = v.new_cache(64)
    logits, feats = v.forward_cached(*_chain(prompt, 0), cache, torch.tensor(0))
    want_logits, want_feats, want_kv = v(*_chain(prompt, 0), v.new_cache(64), 0)
    assert (logits - want_logits).abs().max() < 1e-5 and (feats - want_feats).abs().max() < 1e-5
    assert (cache[:, :, :, :P] - want_kv).abs().max() < 1e-5
    # A tree on top of the prefix; only the last node's logits asked for.
    tokens = torch.tensor([7, 8, 9, 10])  # parents -1, 0, 0, 1
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    depths = mask.sum(-1) - 1
    want_logits, want_feats, want_kv = v(tokens, P + depths, mask, cache, P)
    logits, feats = v.forward_cached(tokens, P + depths, mask, cache, torch.tensor(P), logit_rows=torch.tensor([3]))
    assert (logits - want_logits[3:]).abs().max() < 1e-5 and (feats - want_feats).abs().max() < 1e-5
    assert (cache[:, :, :, P : P + 4] - want_kv).abs().max() < 1e-5


def _chain(tokens, start):
    t = chain_tree(tokens)
    return t.tokens, start + t.depths, t.mask


@torch.no_grad()
def test_in_place_drafter_equals_the_exported_form(load):
    """Context padded to a fixed row count with a valid count, then the block: same z and the same
    context K/V as the exported form with its separate new-K/V output."""
    pair = load("qwen3")
    d, cfg = pair.drafter.model, pair.drafter_cfg
    H, B, T = cfg.hidden_size, cfg.block_size, len(cfg.target_layer_ids)
    g = torch.Generator().manual_seed(0)
    feats, block = torch.randn(11, T * H, generator=g), torch.randn(B, H, generator=g)
    ref_cache = d.new_cache(48)
    _, kv = d(feats[:7], torch.arange(7), block, torch.arange(7, 7 + B), ref_cache, 0)
    ref_cache[:, :, :, :7] = kv
    want_z, want_kv = d(feats[7:], torch.arange(7, 11), block, torch.arange(11, 11 + B), ref_cache, 7)

    cache = d.new_cache(48)
    assert d.forward_cached(feats[:7], torch.tensor(0), torch.tensor(7), None, cache) is None
    padded = torch.cat([feats[7:], torch.randn(B - 4, T * H, generator=g)])
    z = d.forward_cached(padded, torch.tensor(7), torch.tensor(4), block, cache)
    assert (z - want_z).abs().max() < 1e-5
    assert (cache[:, :, :, :7] - ref_cache[:, :, :, :7]).abs().max() < 1e-5
    assert (cache[:, :, :, 7:11] - want_kv).abs().max() < 1e-5


# ---------------------------------------------------------------- no host value inside a round

MODES = [("treeflash", 0.0), ("marginal", 0.0), ("chain", 0.0), ("ar", 0.0), ("treeflash", 0.8)]


@pytest.mark.parametrize("fast_kernels", [False, True], ids=["torch-ops", "fast-kernels"])
@pytest.mark.parametrize("mode,temperature", MODES)
def test_round_reads_no_host_value(load, mode, temperature, fast_kernels):
    """What a CUDA graph needs: with the state as fake tensors (values unknown), any host read
    (.item(), int(), bool(), indexing with a 0-d tensor, nonzero, data-dependent shapes) raises."""
    pair = load("qwen3")
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=96, fast_kernels=fast_kernels)
    tree = TreeConfig(mode=mode, tree_size=16, top_m=4, top_k=4).resolved(runner.block_size)
    runner.begin(torch.tensor([5, 6, 7, 8]), tree, SamplingConfig(temperature=temperature, top_p=0.9))
    runner.use_graphs = True  # the captured form (eagerly on the CPU the drafter's context reads its counts)
    kind = sampling_kind(temperature, 0.9)
    mode_ = FakeTensorMode(allow_non_fake_inputs=True)
    st = runner.slots.state
    runner.slots.state = runner.state = dataclasses.replace(
        st, **{f.name: mode_.from_tensor(getattr(st, f.name)) for f in dataclasses.fields(st)
               if getattr(st, f.name) is not None})
    unknown_count = mode_.from_tensor(torch.tensor(5))  # a fake whose value the mode does not know
    with torch.inference_mode(), mode_:
        with pytest.raises(DataDependentOutputException):  # the check itself can fail
            int(runner.state.past_len + 1)
        with pytest.raises(DataDependentOutputException):
            int(unknown_count)
        runner.stages.run(1, tree, kind)
        runner._prefill_pass(torch.zeros(1, 32, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                             unknown_count.reshape(1), torch.ones(1, dtype=torch.bool))  # int(count) would raise


class EagerReplay:
    """The captured graph's contract (static copies of the arguments; a call copies new ones in and
    runs), run eagerly: the CUDA form's functions, arguments and padding, on the CPU."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, [a.clone() for a in args]

    def __call__(self, *args):
        for dst, src in zip(self.args, args):
            dst.copy_(src)
        self.fn(*self.args)


def captured_form(runner) -> list:
    """The runner's CUDA form on the CPU: graphs on, each capture an EagerReplay; returns the list of
    the functions captured so far (it grows as the runner captures)."""
    captured = []

    def capture(fn, args, reset):
        captured.append(fn)
        return EagerReplay(fn, args)

    runner.use_graphs = True
    runner.graphs.capture = capture
    return captured


@pytest.mark.parametrize("fast_kernels", [False, True], ids=["torch-ops", "fast-kernels"])
@pytest.mark.parametrize("mode", ["treeflash", "marginal", "chain", "ar"])
def test_the_graph_form_run_eagerly_is_exact(load, mode, fast_kernels):
    """What CUDA replays differs from the eager path the other exactness tests run: rounds attend over
    the whole static cache (bound 0, masked by the device length) and the prompt goes in padded
    chunks of 256 (here one chunk, and two with a short last one). Greedy output still equals
    transformers' own."""
    from conftest import PROMPTS, hf_greedy

    from treeflash_runtime import generate
    from treeflash_runtime.plan import PREFILL_CHUNK

    pair = load("qwen3")
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=384, fast_kernels=fast_kernels)
    captured_form(runner)
    short = pair.tokenizer(PROMPTS[0])["input_ids"]
    long = pair.tokenizer(PROMPTS[2] * 40)["input_ids"][: PREFILL_CHUNK + 44]
    assert len(long) == PREFILL_CHUNK + 44
    for ids in (short, long):
        res = generate(runner, ids, TreeConfig(mode=mode, tree_size=16, top_m=4, top_k=4),
                       SamplingConfig(max_new_tokens=24))
        assert res.token_ids == hf_greedy(pair.verifier, ids, 24), len(ids)
    assert ("prefill", 1) in runner.graphs  # the captured path really ran


def test_captured_plain_steps_keep_the_drafters_context_lazily(load):
    """With graphs, a plain step inside a tuned generation appends its features to the pending rows and
    runs the drafter only when the B rows are full (the host's bound picks one of two captured plain
    steps, so nothing is read back): a drafter pass every B - 1 steps or so instead of every step. Tree
    rounds after any number of plain steps still draft from the whole context: greedy output equals
    transformers' own."""
    from conftest import PROMPTS, hf_greedy

    from treeflash_runtime.sampling import GREEDY

    pair = load("qwen3")
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=256)
    captured_form(runner)
    B = runner.block_size
    runner.state.pending = runner.state.pending[:, :B].clone()  # the CUDA form's B rows
    ids = pair.tokenizer(PROMPTS[0])["input_ids"]
    want = hf_greedy(pair.verifier, ids, 60)
    tree = TreeConfig(mode="treeflash", tree_size=8, top_m=2, top_k=4)
    plain = TreeConfig(mode="ar")
    calls = []
    real = pair.drafter.model.forward_cached
    pair.drafter.model.forward_cached = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        out = [runner.begin(torch.tensor(ids), tree, SamplingConfig())]
        schedule = [plain] * 20 + [tree] * 3 + [plain] * (B + 3) + [tree] * 4 + [plain] * 3 + [tree] * 30
        plain_passes = 0
        for t in schedule:
            if len(out) >= 60:
                break
            before = len(calls)
            out += runner.step(RoundPlan(tree=t.resolved(B), keep_context=True)).gained[0]
            if t.mode == "ar":
                plain_passes += len(calls) - before
    finally:
        pair.drafter.model.forward_cached = real
    assert out[:60] == want
    plain_steps = 20 + B + 3 + 3
    assert plain_passes <= 3 + plain_steps // (B - 1), (plain_passes, plain_steps)  # not one a step
    plain_keys = {k for k in runner.graphs if k[0] == "round" and k[2].mode == "ar"}
    assert {k[5] for k in plain_keys} == {"append", "flush"} and {k[3:5] for k in plain_keys} == {(GREEDY, False)}


@pytest.mark.skipif(ta.triton is None, reason="triton is not installed (pip install triton)")
def test_a_generation_through_every_triton_kernel_is_exact(load, monkeypatch):
    """On the CPU every custom op otherwise runs its PyTorch reference: here the layer kernels, tree
    attention, the MLP expansion, the top-k kernels and the tree build all run (in Triton's
    interpreter, so a TreeFlash generation of a few tokens), and the greedy output still equals
    transformers' own."""
    from conftest import PROMPTS, hf_greedy

    from treeflash_kernels import mlp_expand
    from treeflash_runtime import generate

    if not mlp_expand.interpreting():
        pytest.skip("runs the kernels in Triton's interpreter (TRITON_INTERPRET=1), which a GPU machine does not set")
    from treeflash_kernels import build_tree, layer_ops, ops, topk_logprobs

    launched = set()
    for module, name in [(layer_ops, "add_rms_norm_triton"), (layer_ops, "qk_norm_rope_triton"),
                         (layer_ops, "silu_mul_triton"), (ta, "tree_attention_triton"), (ops, "mlp_expand_triton"),
                         (topk_logprobs, "topk_logprobs_triton"), (build_tree, "build_tree_triton")]:
        def counted(*args, _real=getattr(module, name), _name=name, **kwargs):
            launched.add(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    pair = load("qwen3")
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=48, fast_kernels=True)
    ids = pair.tokenizer(PROMPTS[1])["input_ids"]
    with mlp_expand.interpreted_on_cpu():
        assert mlp_expand.runs_triton(torch.zeros(1))
        res = generate(runner, ids, TreeConfig(mode="treeflash", tree_size=8, top_m=2, top_k=2),
                       SamplingConfig(max_new_tokens=4))
    assert not mlp_expand.runs_triton(torch.zeros(1))  # off again outside
    assert res.token_ids == hf_greedy(pair.verifier, ids, 4)
    assert len(launched) == 7, launched  # every kernel took part


class HostTensorSpy(TorchDispatchMode):
    """Records every tensor that enters an operator without being device state (given) or an
    earlier operator's output: on a GPU such a tensor was made on the host and copied over, which
    synchronises and is not permitted while a CUDA graph captures. `x[0] = 1` and `torch.tensor(...)`
    are the usual sources; on the CPU they cost nothing, so only this bookkeeping can see them."""

    def __init__(self, device_tensors):
        super().__init__()
        self.known = {id(t): t for t in device_tensors}  # holding them keeps their ids unique
        self.host_made: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs or {})):
            if isinstance(t, torch.Tensor) and id(t) not in self.known:
                self.host_made.append(f"{func} {tuple(t.shape)}")
        out = func(*args, **(kwargs or {}))
        self.known.update((id(t), t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _device_tensors(runner) -> list[torch.Tensor]:
    found = [t for t in vars(runner.state).values() if isinstance(t, torch.Tensor)]
    for part in (runner, runner.head, runner.slots):  # their own: the head's rows, the slot indices
        found += [t for t in vars(part).values() if isinstance(t, torch.Tensor)]
    for module in (runner.verifier, runner.drafter):
        for m in module.modules():  # parameters, buffers and plain tensor attributes (merged weights)
            found += [t for t in tree_leaves(vars(m)) if isinstance(t, torch.Tensor)]
    return found


def test_host_tensor_spy_sees_a_number_assigned_to_an_element():
    state = torch.zeros(4, dtype=torch.long)
    with torch.inference_mode(), HostTensorSpy([state]) as spy:
        state[:1].fill_(1)
        state[1:2].copy_(state[:1] + 1)
    assert spy.host_made == []
    with torch.inference_mode(), HostTensorSpy([state]) as spy:
        state[0] = 1
    assert spy.host_made, "the spy missed a host-made scalar"


@pytest.mark.parametrize("fast_kernels", [False, True], ids=["torch-ops", "fast-kernels"])
@pytest.mark.parametrize("mode,temperature", MODES)
def test_captured_functions_make_no_tensor_on_the_host(load, mode, temperature, fast_kernels):
    """The functions CUDA captures (the round, and a prefill pass with the arguments a replay copies
    into the graph's static inputs) use only device state, those inputs and their own results."""
    pair = load("qwen3")
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=96, fast_kernels=fast_kernels)
    tree = TreeConfig(mode=mode, tree_size=16, top_m=4, top_k=4).resolved(runner.block_size)
    runner.begin(torch.tensor([5, 6, 7, 8]), tree, SamplingConfig(temperature=temperature, top_p=0.9))
    args = (torch.zeros(1, 32, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.tensor([5]),
            torch.tensor([True]))
    with torch.inference_mode(), HostTensorSpy(_device_tensors(runner) + list(args)) as spy:
        runner.stages.run(1, tree, sampling_kind(temperature, 0.9))
        runner._prefill_pass(*args)
    assert spy.host_made == []


@pytest.mark.parametrize("flush", [False, True], ids=["append", "flush"])
def test_captured_plain_steps_with_context_make_no_tensor_on_the_host(load, flush):
    """Both captured plain steps of a tuned generation (one appends the step's features to the pending
    rows, one runs the drafter over them first) use only device state and their own results."""
    from treeflash_runtime.sampling import GREEDY

    pair = load("qwen3")
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=96)
    plain = TreeConfig(mode="ar")
    runner.begin(torch.tensor([5, 6, 7, 8]), plain, SamplingConfig())
    runner.use_graphs = True
    with torch.inference_mode(), HostTensorSpy(_device_tensors(runner)) as spy:
        runner.stages.run(1, plain.resolved(runner.block_size), GREEDY, keep_context=True, flush=flush)
    assert spy.host_made == []


def test_compiled_steps_are_exact(load, monkeypatch, tmp_path):
    """torch.compile wraps the steps from outside; plain decoding (the quickest to compile on a CPU)
    still equals transformers' greedy output, and a second generation reuses the compiled code."""
    from conftest import PROMPTS, hf_greedy

    from treeflash_runtime import generate

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[1])["input_ids"]
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=96, compile=True)
    for _ in range(2):
        res = generate(runner, ids, TreeConfig(mode="ar"), SamplingConfig(max_new_tokens=24))
        assert res.token_ids == hf_greedy(pair.verifier, ids, 24)
    assert (tmp_path / "inductor").is_dir()


# ---------------------------------------------------------------- memory


def test_caches_that_do_not_fit_are_a_one_line_error(load):
    pair = load("qwen3")
    with pytest.raises(ConfigError, match=r"need [\d.]+ GiB \(verifier cache .*drafter cache .*\) but only "
                                          r"[\d.]+ GiB is free on cpu: lower --max-seq-len"):
        TorchRunner(pair.verifier, pair.drafter, capacity=10**12)


# ---------------------------------------------------------------- the real-shape benchmark


def test_random_weights_bench_reports_rows_against_floors():
    import json

    from click.testing import CliRunner

    from treeflash_runtime.bench.cli import main as bench_main
    from treeflash_runtime.bench.random_weights import format_random_report

    r = CliRunner().invoke(bench_main, ["--random-weights", "tiny", "--prompt-lengths", "16,40", "--tree-sizes",
                                        "8,16", "--top-m", "4", "--top-k", "4", "--rounds", "2", "--warmup", "1",
                                        "--tokens-per-round", "2.5", "--fast-kernels", "both", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    cuda = DEVICE == "cuda"  # the bench runs where the device is auto: bfloat16 in CUDA graphs on a GPU
    assert rep["bandwidth_gbps"] > 0 and rep["floor_ms"] > 0 and rep["dtype"] == ("bfloat16" if cuda else "float32")
    w = rep["weights_gb"]
    assert rep["floor_ms"] == pytest.approx(w["verifier"] / rep["bandwidth_gbps"] * 1e3)
    # Both layer forms side by side (one runner each, over the same weights), each against its own plain step.
    got = {(x["fast_kernels"], x["prompt_tokens"], x["mode"], x["tree_size"]) for x in rep["rows"]}
    want = {(k, p, m, n) for k in (True, False) for p in (16, 40) for m, n in
            [("ar", 1), ("chain", 8), ("marginal", 8), ("marginal", 16), ("treeflash", 8), ("treeflash", 16)]}
    assert got == want and len(rep["rows"]) == len(want)
    assert set(rep["startup_s"]["capture_graphs"]) == set(rep["startup_s"]["runner"]) == {"fast kernels", "torch ops"}
    assert all(x["capture_s"] >= 0 for x in rep["rows"])
    by = {(x["fast_kernels"], x["prompt_tokens"], x["mode"], x["tree_size"]): x for x in rep["rows"]}
    for (k, p, mode, n), x in by.items():
        assert x["ms_per_round"] > 0 and x["ratio_to_floor"] == pytest.approx(x["ms_per_round"] / x["floor_ms"])
        ar = by[k, p, "ar", 1]["ms_per_round"]
        assert x["ratio_to_ar"] == pytest.approx(x["ms_per_round"] / ar)
        if mode != "ar":
            assert x["implied_speedup"] == pytest.approx(2.5 * ar / x["ms_per_round"])
            assert x["floor_ms"] > rep["floor_ms"] and set(x["stages_ms"]) == {"draft", "expand", "tree", "verify",
                                                                               "accept"}
            assert x["stages_how"] == ("in the CUDA graph" if cuda else "eager, synchronised")
        assert x["ratio_to_shortest_prompt"] == pytest.approx(x["ms_per_round"] / by[k, 16, mode, n]["ms_per_round"])
    # The head is read in TreeFlash mode only.
    assert by[True, 16, "treeflash", 8]["floor_ms"] > by[True, 16, "marginal", 8]["floor_ms"]
    assert "kernels " in format_random_report(rep) and "torch " in format_random_report(rep)
    r = CliRunner().invoke(bench_main, ["--random-weights", "tiny", "--rounds", "0"])
    assert r.exit_code == 2 and "--rounds must be >= 1" in r.output


def _attention_kernels(dtype: str, head_dim: int):
    import math

    plan = ta.launch_plan(64, 32, 8, 8192, head_dim)
    T = "*" + dtype
    sig = dict(q_ptr=T, k_ptr=T, v_ptr=T, len_ptr="*i64", mask_ptr="*i1", sid_ptr="*i64", o_ptr="*fp32",
               m_ptr="*fp32", l_ptr="*fp32", n="i32", G="i32", Hkv="i32", stride_km="i32", stride_kh="i32",
               stride_ks="i32")
    consts = dict(SM_SCALE=1 / math.sqrt(head_dim), PRECISION="ieee" if dtype == "fp32" else "tf32",
                  HEAD_DIM=head_dim, BLOCK_M=plan["block_m"], BLOCK_N=plan["block_n"])
    merge = dict(o_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", out_ptr=T, n="i32", G="i32", Hq="i32",
                 rows_per_split="i32")
    return [("tree_attention_kernel", sig, consts, 4),
            ("merge_splits_kernel", merge, dict(SPLITS=plan["splits"], HEAD_DIM=head_dim), 1)]


@needs_triton
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_attention_kernels_compile_for_hopper(dtype):
    """Both kernels compile for sm_90 at Qwen3-8B's heads with no GPU present."""
    from conftest import compile_for_hopper

    out = compile_for_hopper("treeflash_kernels.tree_attention", _attention_kernels(dtype, 128))
    assert set(out) == {"tree_attention_kernel", "merge_splits_kernel"}
    assert all(k["sm90"] and k["shared"] <= 227 * 1024 for k in out.values()), out


@needs_triton
def test_a_head_dim_the_kernel_cannot_compile_goes_to_the_reference():
    """Head dim 8 (the small test pairs): Triton's NVIDIA backend refuses tl.dot below 16, so the kernel
    does not compile for sm_90; kernel_fits says so, and the dispatcher, even where the kernels run
    (here: on a GPU, else in the interpreter), answers from the reference for 8 and for a head dim that
    is no power of two."""
    from conftest import compile_for_hopper
    import treeflash_kernels.ops  # noqa: F401 (registers torch.ops.treeflash; the test may run alone)
    from treeflash_kernels.mlp_expand import interpreted_on_cpu

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # a GPU machine does not set TRITON_INTERPRET

    with pytest.raises(AssertionError, match="dot|16"):
        compile_for_hopper("treeflash_kernels.tree_attention", _attention_kernels("bf16", 8))
    assert not ta.kernel_fits(8) and not ta.kernel_fits(24) and ta.kernel_fits(16) and ta.kernel_fits(128)
    for D in (8, 24):
        g = torch.Generator().manual_seed(D)
        q = torch.randn(2, 4, 3, D, generator=g).to(dev)
        k, v = (torch.randn(2, 2, 12, D, generator=g).to(dev) for _ in range(2))
        past, mask = torch.tensor([5, 2], device=dev), torch.ones(2, 3, 3, dtype=torch.bool, device=dev).tril()
        with contextlib.nullcontext() if dev == "cuda" else interpreted_on_cpu():
            got = torch.ops.treeflash.tree_attention(q, k, v, past, mask)
        assert torch.equal(got, ta.tree_attention_reference(q, k, v, past, mask))


def test_random_bench_keeps_one_path_when_the_other_fails(monkeypatch):
    """Comparing both paths, a kernel failing on a new device must not lose the other path's rows."""
    import treeflash_runtime.backends.pytorch.stages as tb
    from treeflash_runtime.bench.random_weights import format_random_report, run_random_bench

    def broken(*args, **kwargs):
        raise RuntimeError("tree kernel failed")

    monkeypatch.setattr(tb, "build_tree_fast", broken)
    kw = dict(modes=["treeflash"], tree_sizes=[8], prompt_lengths=[16], rounds=1, warmup=0, top_m=2, top_k=2,
              tokens_per_round=2.0, device="cpu", dtype="auto", cuda_graphs=True, stages=False)
    rep = run_random_bench("tiny", fast_kernels=(True, False), **kw)
    assert rep["failed"] == {"fast kernels": "RuntimeError: tree kernel failed"}
    assert {(r["fast_kernels"], r["mode"]) for r in rep["rows"]} == {(True, "ar"), (False, "ar"), (False, "treeflash")}
    assert "FAILED (fast kernels): RuntimeError: tree kernel failed" in format_random_report(rep)
    with pytest.raises(RuntimeError, match="tree kernel failed"):  # one path alone: the error itself
        run_random_bench("tiny", fast_kernels=(True,), **kw)
