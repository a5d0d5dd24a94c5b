"""The fast kernels against their references (Triton's interpreter on CPU, compiled on CUDA): the
decoder-layer kernels (treeflash_kernels.layer_ops) with their custom ops, the merged projections
and the model forms that use them against the Hugging Face modules, and the one-kernel tree build
(treeflash_kernels.build_tree) against treeflash_export.tree.build_tree."""

from __future__ import annotations

import pytest
import torch

from treeflash_export.models import TreeVerifier
from treeflash_export.models.fused import merge_linears
from treeflash_export.tree import chain_tree
from treeflash_kernels import layer_ops as lo

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(lo.triton is None, reason="triton is not installed (pip install triton)")


def randn(*shape, seed=0, dtype=torch.float32, device=DEVICE):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def qkv_problem(n, Hq, Hkv, D, S, *, dtype=torch.float32, device=DEVICE, seed=0):
    qkv = randn(n, (Hq + 2 * Hkv) * D, seed=seed, dtype=dtype, device=device)
    qw, kw = randn(D, seed=seed + 1, dtype=dtype, device=device), randn(D, seed=seed + 2, dtype=dtype, device=device)
    angles = randn(n, D // 2, seed=seed + 3, device=device) * 3
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    cache = randn(2, Hkv, S, D, seed=seed + 4, dtype=dtype, device=device)
    return qkv, qw, kw, cos, sin, cache


# ---------------------------------------------------------------- kernels vs references (float32)


@needs_triton
@pytest.mark.parametrize("n,H", [(1, 64), (5, 96), (3, 40)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_kernel_matches_reference(n, H, with_delta):
    x, d, w = randn(n, H, seed=1), randn(n, H, seed=2), randn(H, seed=3)
    delta = d if with_delta else None
    s, h = lo.add_rms_norm_triton(x, delta, w, 1e-5)
    s_ref, h_ref = lo.add_rms_norm_reference(x, delta, w, 1e-5)
    assert torch.equal(s, s_ref)  # one rounding of one add either way
    assert (h - h_ref).abs().max() < 1e-5  # seen: about 5e-7


@needs_triton
@pytest.mark.parametrize("with_norm", [True, False], ids=["qwen3", "llama"])
@pytest.mark.parametrize("n,Hq,Hkv,D", [(1, 4, 2, 16), (6, 6, 2, 32), (3, 4, 4, 16)])
def test_qk_norm_rope_kernel_matches_reference(n, Hq, Hkv, D, with_norm):
    qkv, qw, kw, cos, sin, cache = qkv_problem(n, Hq, Hkv, D, 24)
    norms = (qw, kw) if with_norm else (None, None)
    slots = torch.tensor([9, 3, -1, 17, 10, 11][:n], device=DEVICE)  # any order; -1: a padding row
    before = cache.clone()
    got_cache, want_cache = cache.clone(), cache.clone()
    q = lo.qk_norm_rope_triton(qkv, *norms, 1e-6, cos, sin, got_cache[0], got_cache[1], slots, Hq)
    q_ref = lo.qk_norm_rope_reference(qkv, *norms, 1e-6, cos, sin, want_cache[0], want_cache[1], slots, Hq)
    assert q.shape == q_ref.shape == (Hq, n, D) and (q - q_ref).abs().max() < 1e-5
    assert (got_cache - want_cache).abs().max() < 1e-5
    written = slots[slots >= 0]
    untouched = torch.ones(24, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert torch.equal(got_cache[:, :, untouched], before[:, :, untouched])  # nothing else, no padding row
    assert not torch.equal(got_cache[:, :, written], before[:, :, written])
    # v goes in as it came out of the projection
    v = qkv.view(n, Hq + 2 * Hkv, D)[:, Hq + Hkv:]
    keep = slots >= 0
    assert torch.equal(got_cache[1][:, slots[keep]], v[keep].transpose(0, 1))


def test_qk_norm_rope_reference_padding_rows_never_touch_a_real_slot():
    """A first prefill chunk: the real row of slot 0 and padding rows (slot -1) in one launch. Padding
    must not write slot 0 (duplicate writes to one slot land in any order on a GPU; on the CPU the
    last one wins, which would put back the old K/V)."""
    qkv, qw, kw, cos, sin, cache = qkv_problem(4, 4, 2, 16, 24, device="cpu")
    before = cache.clone()
    slots = torch.tensor([0, 1, -1, -1])
    lo.qk_norm_rope_reference(qkv, qw, kw, 1e-6, cos, sin, cache[0], cache[1], slots, 4)
    v = qkv.view(4, 8, 16)[:, 6:]
    assert torch.equal(cache[1][:, :2], v[:2].transpose(0, 1))  # both real rows written
    assert torch.equal(cache[:, :, 2:], before[:, :, 2:])  # padding left every other slot as it was


def test_qk_norm_rope_reference_is_the_module_composition():
    """Per-head RMSNorm then rotate-half RoPE, as Qwen3's attention module computes them."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from treeflash_export.models.common import apply_rope

    n, Hq, Hkv, D = 5, 4, 2, 16
    qkv, qw, kw, cos, sin, cache = qkv_problem(n, Hq, Hkv, D, 12, device="cpu")
    q_norm, k_norm = Qwen3RMSNorm(D, eps=1e-6), Qwen3RMSNorm(D, eps=1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(qw), k_norm.weight.copy_(kw)
        q, k, v = qkv.view(n, -1, D).split([Hq, Hkv, Hkv], dim=1)
        want_q = apply_rope(q_norm(q).transpose(0, 1), cos, sin)
        want_k = apply_rope(k_norm(k).transpose(0, 1), cos, sin)
        got = lo.qk_norm_rope_reference(qkv, qw, kw, 1e-6, cos, sin, cache[0], cache[1], torch.arange(n), Hq)
    assert torch.equal(got, want_q)
    assert torch.equal(cache[0, :, :n], want_k) and torch.equal(cache[1, :, :n], v.transpose(0, 1))


@needs_triton
@pytest.mark.parametrize("n,I", [(1, 48), (4, 1500), (3, 17)])
def test_silu_mul_kernel_matches_reference(n, I):
    gu = randn(n, 2 * I, seed=4) * 4  # products up to about 100: a relative tolerance (a GPU's exp differs in its last bits)
    torch.testing.assert_close(lo.silu_mul_triton(gu), lo.silu_mul_reference(gu), rtol=1e-5, atol=1e-6)


def test_custom_ops_fake_and_cpu_paths():
    """The ops' fake (meta) implementations agree with what they return (shapes, strides), as
    torch.compile and the fake-tensor round check need."""
    from treeflash_kernels.ops import add_rms_norm, qk_norm_rope, silu_mul

    x, d, w = randn(3, 40, device="cpu"), randn(3, 40, seed=1, device="cpu"), randn(40, seed=2, device="cpu")
    torch.library.opcheck(add_rms_norm, (x, d, w, 1e-6))
    torch.library.opcheck(add_rms_norm, (x, None, w, 1e-6))
    qkv, qw, kw, cos, sin, cache = qkv_problem(3, 4, 2, 16, 10, device="cpu")
    torch.library.opcheck(qk_norm_rope, (qkv, qw, kw, 1e-6, cos, sin, cache[0], cache[1], torch.tensor([4, -1, 5]), 4))
    torch.library.opcheck(silu_mul, (randn(3, 20, device="cpu"),))
    s, h = add_rms_norm(x, None, w, 1e-6)
    assert torch.equal(s, x) and s.data_ptr() != x.data_ptr()  # a copy, never an alias of an input


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fast_kernels_16_bit_cuda_track_the_modules(dtype):
    """In 16-bit the kernels round where the modules do, so they differ from the references by
    the order of a row's sum only: almost every element equal, none by more than a rounding step."""
    x, d, w = randn(64, 4096, seed=1, dtype=dtype), randn(64, 4096, seed=2, dtype=dtype), randn(4096, seed=3,
                                                                                                  dtype=dtype)
    got, want = lo.add_rms_norm_triton(x, d, w, 1e-6), lo.add_rms_norm_reference(x, d, w, 1e-6)
    assert torch.equal(got[0], want[0])
    assert (got[1] != want[1]).float().mean() < 0.01
    gu = randn(64, 2 * 12288, seed=5, dtype=dtype)
    assert (lo.silu_mul_triton(gu) != lo.silu_mul_reference(gu)).float().mean() < 0.01
    # The per-head norm and RoPE apart and together, so that a failure says which part departs (on an
    # H200, 2026-11-26, 21% of q's elements differed by 1-3 rounding steps: RoPE's products fused into
    # 16-bit multiply-adds, since launched with FP contraction off; see the sm_90 test below).
    qkv, qw, kw, cos, sin, cache = qkv_problem(64, 32, 8, 128, 256, dtype=dtype)
    seen = {}
    for part, (w1, w2, c, s) in {"norm": (qw, kw, torch.ones_like(cos), torch.zeros_like(sin)),
                                 "rope": (None, None, cos, sin), "both": (qw, kw, cos, sin)}.items():
        c1, c2 = cache.clone(), cache.clone()
        slots = torch.arange(64, device="cuda") + 100
        q1 = lo.qk_norm_rope_triton(qkv, w1, w2, 1e-6, c, s, c1[0], c1[1], slots, 32)
        q2 = lo.qk_norm_rope_reference(qkv, w1, w2, 1e-6, c, s, c2[0], c2[1], slots, 32)
        seen[part] = ((q1 != q2).float().mean().item(), (c1 != c2).float().mean().item(),
                      (q1.float() - q2.float()).abs().max().item())
    assert all(q < 0.02 and k < 0.02 and top < 0.1 for q, k, top in seen.values()), seen  # (q, cache, max)


@needs_triton
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_fast_kernels_compile_for_hopper(dtype):
    """The three kernels compile for sm_90 at Qwen3-8B's shapes with no GPU present."""
    from conftest import compile_for_hopper

    T = "*" + dtype
    out = compile_for_hopper("treeflash_kernels.layer_ops", [
        ("add_rms_norm_kernel", dict(x_ptr=T, d_ptr=T, w_ptr=T, H="i32", s_ptr=T, h_ptr=T),
         dict(EPS=1e-6, HAS_DELTA=True, BLOCK_H=4096), 8),
        ("qk_norm_rope_kernel", dict(qkv_ptr=T, qw_ptr=T, kw_ptr=T, cos_ptr=T, sin_ptr=T, slots_ptr="*i64", Hq="i32",
                                     Hkv="i32", stride_kh="i64", stride_ks="i64", q_ptr=T, k_ptr=T, v_ptr=T),
         dict(EPS=1e-6, HAS_NORM=True, HEAD_DIM=128), 1),
        ("silu_mul_kernel", dict(gu_ptr=T, I="i32", out_ptr=T), dict(BLOCK=1024), 4)])
    assert set(out) == {"add_rms_norm_kernel", "qk_norm_rope_kernel", "silu_mul_kernel"}, out
    assert all(k["sm90"] for k in out.values()), out


@needs_triton
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_layer_kernels_round_16_bit_products_where_the_modules_do(dtype):
    """Compiled for sm_90 with the launch options the runtime uses, no 16-bit fused multiply-add is
    left: each product rounds before its sum, as in the modules. With FP contraction on (Triton's
    default) RoPE's two products and their sum became fma.rn on 16 bits, which an H200 showed as 21%
    of q's elements off by 1-3 rounding steps; the first compile below shows that this check sees it."""
    from conftest import compile_for_hopper

    T = "*" + dtype
    rope = ("qk_norm_rope_kernel", dict(qkv_ptr=T, qw_ptr=T, kw_ptr=T, cos_ptr=T, sin_ptr=T, slots_ptr="*i64",
                                        Hq="i32", Hkv="i32", stride_kh="i64", stride_ks="i64", q_ptr=T, k_ptr=T,
                                        v_ptr=T), dict(EPS=1e-6, HAS_NORM=True, HEAD_DIM=128))
    fused = compile_for_hopper("treeflash_kernels.layer_ops", [rope + (dict(num_warps=1),)])
    assert fused["qk_norm_rope_kernel"]["fma16"], fused
    out = compile_for_hopper("treeflash_kernels.layer_ops", [
        ("add_rms_norm_kernel", dict(x_ptr=T, d_ptr=T, w_ptr=T, H="i32", s_ptr=T, h_ptr=T),
         dict(EPS=1e-6, HAS_DELTA=True, BLOCK_H=4096), lo._row_options(4096)),
        rope + (lo._row_options(128),),
        ("silu_mul_kernel", dict(gu_ptr=T, I="i32", out_ptr=T), dict(BLOCK=1024), lo._row_options(1024))])
    assert set(out) == {"add_rms_norm_kernel", "qk_norm_rope_kernel", "silu_mul_kernel"}, out
    assert not any(k["fma16"] for k in out.values()), out


# ---------------------------------------------------------------- merged projections, model forms


def test_merged_projections_are_views_and_keep_the_modules_exact(load):
    pair = load("qwen3")
    layer = pair.verifier.model.layers[0]
    attn = layer.self_attn
    h = randn(3, pair.verifier.config.hidden_size, seed=7, device="cpu")
    with torch.no_grad():
        before = [attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)]
        weight, bias = merge_linears([attn.q_proj, attn.k_proj, attn.v_proj], "_treeflash_qkv", attn)
        after = [attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)]
    assert bias is None and weight.shape[0] == sum(t.shape[-1] for t in before)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    # One copy of the weights: the modules' parameters are row blocks of the merged tensor.
    assert attn.q_proj.weight.data_ptr() == weight.data_ptr()
    assert attn.v_proj.weight.data_ptr() == weight[-attn.v_proj.weight.shape[0]:].data_ptr()
    again = merge_linears([attn.q_proj, attn.k_proj, attn.v_proj], "_treeflash_qkv", attn)
    assert again[0] is weight  # merging twice reuses the first merge


@torch.no_grad()
@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_verifier_with_fast_kernels_equals_the_modules(load, name):
    pair = load(name)
    taps = pair.drafter_cfg.target_layer_ids
    modules, kernels = TreeVerifier(pair.verifier, taps), TreeVerifier(pair.verifier, taps)
    kernels.use_layer_kernels()
    prompt = chain_tree(torch.arange(3, 20))
    tree = (torch.tensor([7, 8, 9, 10]),
            torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool))
    outs = []
    for v in (modules, kernels):
        cache = v.new_cache(64)
        first = v.forward_cached(prompt.tokens, prompt.depths, prompt.mask, cache, torch.tensor(0))
        P = torch.tensor(17)
        second = v.forward_cached(tree[0], P + tree[1].sum(-1) - 1, tree[1], cache, P, logit_rows=torch.tensor([3]))
        outs.append((*first, *second, cache))
    for a, b in zip(*outs):
        assert (a - b).abs().max() < 1e-5  # seen: identical on CPU


@torch.no_grad()
def test_drafter_with_fast_kernels_equals_the_modules(load):
    """Padded context then the block, as a round feeds them: same z, same committed context K/V."""
    pair = load("qwen3")
    d, cfg = pair.drafter.model, pair.drafter_cfg
    H, B, T = cfg.hidden_size, cfg.block_size, len(cfg.target_layer_ids)
    feats, block = randn(11, T * H, seed=1, device="cpu"), randn(B, H, seed=2, device="cpu")
    padded = torch.cat([feats[7:], randn(B - 4, T * H, seed=3, device="cpu")])
    outs = []
    try:
        for on in (False, True):
            d.use_layer_kernels(on)
            cache = d.new_cache(48)
            assert d.forward_cached(feats[:7], torch.tensor(0), torch.tensor(7), None, cache) is None
            z = d.forward_cached(padded, torch.tensor(7), torch.tensor(4), block, cache)
            outs.append((z, cache[:, :, :, :11]))
    finally:
        d.use_layer_kernels(False)
    assert (outs[0][0] - outs[1][0]).abs().max() < 1e-5 and (outs[0][1] - outs[1][1]).abs().max() < 1e-5


# ---------------------------------------------------------------- the tree build in one kernel


def random_tables(D, M, K, seed, *, ties=False, dead=0.0):
    """Tables as the expand stage makes them (log-probabilities descending along K), with ties
    (scores on a half-unit grid) and -inf entries (a fraction ``dead``) when asked, random links."""
    from treeflash_export.tree import Tables

    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(D, M, K, generator=g) * 3
    if ties:
        lp = (lp * 2).round() / 2
    lp[torch.rand(D, M, K, generator=g) < dead] = float("-inf")
    lp = lp.sort(-1, descending=True).values
    nxt = torch.randint(-1, M, (D, M, K), generator=g)
    nxt[-1] = -1
    return Tables(torch.randint(0, 1000, (D, M, K), generator=g).to(DEVICE), lp.to(DEVICE), nxt.to(DEVICE))


# (D, M, K, N): fewer candidates than W at depth 1, one parent row, one child, N = 2, a deep thin chain.
TREE_SHAPES = [(3, 2, 3, 8), (4, 3, 4, 9), (1, 1, 4, 3), (2, 3, 2, 5), (5, 2, 2, 6), (4, 1, 1, 4), (2, 2, 3, 2)]


@needs_triton
@pytest.mark.parametrize("ties,dead", [(False, 0.0), (True, 0.0), (True, 0.5), (False, 0.95)],
                         ids=["plain", "ties", "ties-dead", "mostly-dead"])
@pytest.mark.parametrize("shape", TREE_SHAPES, ids=lambda s: "D{}-M{}-K{}-N{}".format(*s))
def test_build_tree_kernel_equals_the_reference(shape, ties, dead):
    """The same nodes in the same order (ties broken alike, padding nodes when too few drafts
    exist), so the round is unchanged whichever builds the tree. Seen at Qwen3 shapes (D 15,
    M = K = 16, N = 64) in a run by hand too; the interpreter is too slow for them in the suite."""
    from treeflash_export.tree import Tree, build_tree
    from treeflash_kernels.build_tree import build_tree_triton

    D, M, K, N = shape
    for seed in range(3):
        tables = random_tables(D, M, K, seed, ties=ties, dead=dead)
        root = torch.tensor([7], device=DEVICE)
        want, got = build_tree(tables, root, N), Tree(*build_tree_triton(tables, root, N))
        for field in ("tokens", "parents", "depths", "mask", "valid"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (field, seed)


@needs_triton
def test_build_tree_kernel_builds_a_batch_of_trees_at_once():
    """Request slots: one launch, one program per slot's tables, each tree the reference's."""
    from treeflash_export.tree import Tables, Tree, build_tree
    from treeflash_kernels.build_tree import build_tree_triton

    parts = [random_tables(4, 3, 4, seed, ties=seed == 1, dead=0.3 * (seed == 2)) for seed in range(3)]
    tables = Tables(*(torch.stack([getattr(t, f) for t in parts]) for f in ("tokens", "logprobs", "next_row")))
    roots = torch.tensor([7, 8, 9], device=DEVICE)
    got = Tree(*build_tree_triton(tables, roots, 9))
    batched = build_tree(tables, roots, 9)
    for i, t in enumerate(parts):
        want = build_tree(t, roots[i : i + 1], 9)
        for field in ("tokens", "parents", "depths", "mask", "valid"):
            assert torch.equal(getattr(got, field)[i], getattr(want, field)), (field, i)
            assert torch.equal(getattr(batched, field)[i], getattr(want, field)), (field, i)


def test_build_tree_fast_falls_back_beyond_the_kernel():
    from treeflash_kernels.build_tree import kernel_fits

    assert kernel_fits(15, 16, 64) and kernel_fits(15, 16, 128)
    assert not kernel_fits(15, 16, 256)  # more nodes than one block's mask
    assert not kernel_fits(15, 300, 64)  # 63 x 300 candidates per depth: more than one sort


@needs_triton
def test_build_tree_kernel_compiles_for_hopper():
    """At the default setting for Qwen3 drafters (block 16, N = 64, top-16 children)."""
    from conftest import compile_for_hopper

    i64 = "*i64"
    sig = dict(tok_ptr=i64, lp_ptr="*fp32", nxt_ptr=i64, root_ptr=i64, M="i32", K="i32", b_score="*fp32",
               b_tok=i64, b_row=i64, b_slot=i64, node_of=i64, flat_of=i64, out_tok=i64, out_par=i64, out_dep=i64,
               out_mask="*i1", out_valid="*i1")
    out = compile_for_hopper("treeflash_kernels.build_tree",
                             [("build_tree_kernel", sig, dict(D=15, W=63, CAND=1024, FLAT=1024, NP=64), 4)])
    assert out["build_tree_kernel"]["sm90"], out


def test_fast_kernels_are_on_by_default_only_where_triton_compiles_them():
    from treeflash_runtime.backends.pytorch import fast_kernels_default

    assert fast_kernels_default(torch.device("cuda"), False) == (lo.triton is not None)
    assert not fast_kernels_default(torch.device("cpu"), False)  # the references would only add dispatch
    assert not fast_kernels_default(torch.device("cuda"), True)  # compiled: Inductor fuses over the modules


# ---------------------------------------------------------------- top-k log-probabilities


def stable_top(x: torch.Tensor, k: int, temperature: float):
    """The kernels' order, spelt out: scaled logits desc, then index asc; values from log_softmax."""
    scaled = x.float() / temperature
    order = scaled.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.log_softmax(scaled, dim=-1).gather(-1, order), order


@needs_triton
@pytest.mark.parametrize("lead,V,k,chunk,temperature", [
    ((3,), 1000, 16, 512, 1.0),  # two chunks, the last one partial
    ((2, 2), 1000, 16, 512, 0.7),  # 3-D logits, as the expansion's [B-1, M, V]
    ((2,), 5000, 8, 256, 1.0),  # 20 chunks merged
    ((2,), 300, 16, 512, 1.3),  # one chunk, mostly past V
    ((3,), 700, 1, 1024, 1.0),  # chain mode's k = 1
])
def test_topk_logprobs_kernel_matches_reference(lead, V, k, chunk, temperature):
    from treeflash_kernels import topk_logprobs as tk

    x = randn(*lead, V, seed=V + k) * 3
    values, ids = tk.topk_logprobs_triton(x, k, temperature, chunk=chunk)
    want_values, want_ids = stable_top(x, k, temperature)
    assert ids.dtype == torch.long and values.dtype == torch.float32 and ids.shape == (*lead, k)
    assert torch.equal(ids, want_ids)
    assert (values - want_values).abs().max() < 1e-5  # seen: up to 4.8e-7 (the sum's order)
    ref_values, ref_ids = tk.topk_logprobs_reference(x, k, temperature)  # what the expansion computes
    assert torch.equal(ref_ids, ids) and (ref_values - values).abs().max() < 1e-5


@needs_triton
@pytest.mark.parametrize("kind", ["ties", "dead"])
def test_topk_logprobs_kernel_orders_ties_and_dead_entries_by_index(kind):
    """Equal logits (common in bf16) come lower id first; -inf entries (a masked vocabulary) rank
    last and never bring an id past the vocabulary, even with fewer than k finite entries."""
    from treeflash_kernels import topk_logprobs as tk

    g = torch.Generator().manual_seed(3)
    if kind == "ties":
        x = torch.randint(0, 4, (3, 1000), generator=g).float()
    else:
        x = torch.full((3, 1000), float("-inf"))
        x[0, torch.randperm(1000, generator=g)[:200]] = torch.randn(200, generator=g)
        x[1, [5, 700, 999]] = torch.tensor([1.0, 2.0, 1.0])  # three finite entries for k = 16
        x[2, :] = 0.0
        x[2, 513:] = float("-inf")
    x = x.to(DEVICE)
    values, ids = tk.topk_logprobs_triton(x, 16, 1.0, chunk=512)
    want_values, want_ids = stable_top(x, 16, 1.0)
    assert torch.equal(ids, want_ids) and int(ids.max()) < 1000
    assert torch.equal(values.isinf(), want_values.isinf())
    finite = want_values.isfinite()
    assert (values[finite] - want_values[finite]).abs().max() < 1e-5


@needs_triton
def test_topk_logprobs_kernel_keeps_ids_inside_the_vocabulary_with_nan_logits():
    """NaN logits rank as -inf: a row or a chunk of NaN never yields an id past the vocabulary (one
    would reach an embedding gather and kill the CUDA context); the other entries keep their order."""
    from treeflash_kernels import topk_logprobs as tk

    x = randn(3, 1000, seed=9, device="cpu")
    x[0, :] = float("nan")  # a whole row
    x[1, 512:] = float("nan")  # the second chunk of a row
    x[2, 7] = float("nan")  # one entry
    values, ids = tk.topk_logprobs_triton(x.to(DEVICE), 4, 1.0, chunk=512)
    assert 0 <= int(ids.min()) and int(ids.max()) < 1000
    assert torch.equal(ids[0].cpu(), torch.arange(4))  # all ranked alike: lower ids first
    _, want_ids = stable_top(torch.where(x.isnan(), float("-inf"), x), 4, 1.0)
    assert torch.equal(ids[1:].cpu(), want_ids[1:])


def test_topk_logprobs_fast_falls_back_and_the_op_traces():
    from treeflash_kernels import topk_logprobs as tk
    from treeflash_kernels.ops import topk_logprobs

    x = randn(2, 3, 50, seed=4, device="cpu")
    got, want = tk.topk_logprobs_fast(x, 4, 0.5), tk.topk_logprobs_reference(x, 4, 0.5)
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # on CPU: the reference itself
    assert not tk.kernel_fits(50, 65) and not tk.kernel_fits(10, 16) and tk.kernel_fits(151_936, 16)
    assert not tk.kernel_fits(1000, 4, chunk=768) and not tk.kernel_fits(1000, 4, chunk=16)  # 2^n >= a group
    torch.library.opcheck(topk_logprobs, (x, 4, 0.5))
    with pytest.raises(ValueError, match="exceeds its limits"):
        tk.topk_logprobs_triton(x, 65, 1.0)


@needs_triton
def test_topk_logprobs_kernels_compile_for_hopper():
    """At the TreeFlash expansion of Qwen3 drafters: 151,936 logits a row in chunks of 4,096, k = 16."""
    from conftest import compile_for_hopper

    sig = dict(x_ptr="*bf16", V="i32", temperature="fp32", cand_v="*fp32", cand_i="*i64", stats="*fp32",
               n_chunks="i32")
    out = compile_for_hopper("treeflash_kernels.topk_logprobs", [
        ("_chunk_kernel", sig, dict(K=16, KP=16, NG=128, G=32, SCALE=True), 4),
        ("_merge_kernel", dict(cand_v="*fp32", cand_i="*i64", stats="*fp32", n_chunks="i32", out_v="*fp32",
                               out_i="*i64"), dict(K=16, NC=64, NCAND=1024), 4)])
    assert set(out) == {"_chunk_kernel", "_merge_kernel"} and all(k["sm90"] for k in out.values()), out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_topk_logprobs_bf16_cuda_at_qwen3_shapes():
    """bf16 logits [15, 16, 151936] (the expansion at block 16, M = 16): the kernels' ids are the
    stable order of the logits, their values the reference's up to the sum's order."""
    from treeflash_kernels import topk_logprobs as tk

    x = (randn(15, 16, 151_936, seed=9) * 4).to(torch.bfloat16)
    values, ids = tk.topk_logprobs_triton(x, 16, 1.0)
    want_values, want_ids = stable_top(x, 16, 1.0)
    assert torch.equal(ids, want_ids)
    assert (values - want_values).abs().max() < 1e-4


def test_fast_kernels_compile_into_the_project_cache_unless_told_otherwise(load, monkeypatch, tmp_path):
    """With the fast kernels on, Triton's cache goes under TREEFLASH_CACHE (a warm start reuses it);
    a TRITON_CACHE_DIR the user set is kept; with them off nothing is set."""
    import os

    from treeflash_runtime.backends.pytorch import TorchRunner

    pair = load("qwen3")
    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path / "tf"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    TorchRunner(pair.verifier, pair.drafter, capacity=32, fast_kernels=False)
    assert "TRITON_CACHE_DIR" not in os.environ
    TorchRunner(pair.verifier, pair.drafter, capacity=32, fast_kernels=True)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "tf" / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    TorchRunner(pair.verifier, pair.drafter, capacity=32, fast_kernels=True)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    TorchRunner(pair.verifier, pair.drafter, capacity=32, fast_kernels=False)  # the shared drafter back as it was


def test_a_shared_drafter_follows_the_runner_that_generates(load):
    """Two runners over one drafter module: each generation runs the drafter with its own runner's
    setting, whichever runner was built last."""
    from treeflash_export.config import SamplingConfig, TreeConfig
    from treeflash_runtime import generate
    from treeflash_runtime.backends.pytorch import TorchRunner

    pair = load("qwen3")
    fast = TorchRunner(pair.verifier, pair.drafter, capacity=64, fast_kernels=True)
    plain = TorchRunner(pair.verifier, pair.drafter, capacity=64, fast_kernels=False)
    assert pair.drafter.model.fused is None  # the last runner built set it
    ids = pair.tokenizer("def f(x):")["input_ids"]
    tree = TreeConfig(tree_size=8, top_m=2, top_k=2)
    out_fast = generate(fast, ids, tree, SamplingConfig(max_new_tokens=6))
    assert pair.drafter.model.fused is not None
    out_plain = generate(plain, ids, tree, SamplingConfig(max_new_tokens=6))
    assert pair.drafter.model.fused is None
    assert out_fast.token_ids == out_plain.token_ids
