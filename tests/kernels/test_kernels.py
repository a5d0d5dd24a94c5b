"""The MLP-expansion Triton kernels against their PyTorch reference (Triton's interpreter on CPU,
compiled on CUDA), the custom op, and ahead-of-time compilation for Hopper."""

from __future__ import annotations

import pytest
import torch

from treeflash_kernels import mlp_expand as mk
from conftest import make_inputs

needs_triton = pytest.mark.skipif(mk.triton is None, reason="triton is not installed (pip install triton)")
# Triton runs kernels in its interpreter on CPU tensors (conftest sets TRITON_INTERPRET without a GPU)
# and compiled on CUDA tensors where a GPU is present.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (B, M, H, I, V): non-powers of two everywhere, M = 1, a single block row (B = 2), H > one GEMM tile.
SHAPES = [(4, 3, 40, 24, 50), (2, 1, 16, 16, 20), (5, 4, 64, 48, 30), (3, 1, 24, 40, 17), (6, 5, 72, 80, 64)]


def module_composition(z, ids, E, head_w, ug_w, ug_b, d_w, norm_w, head_eps, norm_eps):
    """The head as the model code computes it (modules), to tie the reference to it."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from treeflash_export.models.head import ARApproximationHead

    H, I = z.shape[1], d_w.shape[1]
    head = ARApproximationHead(H, I)
    norm = Qwen3RMSNorm(H, eps=norm_eps)
    with torch.no_grad():
        head.ug.weight.copy_(ug_w), head.ug.bias.copy_(ug_b), head.d.weight.copy_(d_w), head.norm.weight.copy_(head_w)
        norm.weight.copy_(norm_w)
        M = ids.shape[1]
        delta = head(E[ids], norm(z)[1:, None, :].expand(-1, M, -1))
        return norm(z[1:, None, :] + delta)


def test_reference_is_the_model_composition():
    args = make_inputs(4, 3, 40, 24, 50)
    assert torch.equal(mk.mlp_expand_reference(*args), module_composition(*args))


@needs_triton
@pytest.mark.parametrize("gemm", ["triton", "torch"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-M{}-H{}-I{}-V{}".format(*s))
def test_kernels_match_reference_fp32(shape, gemm):
    args = make_inputs(*shape, device=DEVICE)
    ref = mk.mlp_expand_reference(*args)
    out = mk.mlp_expand_triton(*args, gemm=gemm)
    assert out.shape == ref.shape == (shape[0] - 1, shape[1], shape[2])
    err = (out - ref).abs().max().item()
    assert err < 1e-4, err  # seen: about 1e-6


@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-M{}-H{}-I{}-V{}".format(*s))
def test_each_kernel_matches_its_reference_fp32(shape):
    z, ids, E, head_w, ug_w, ug_b, d_w, norm_w, head_eps, norm_eps = make_inputs(*shape, device=DEVICE)
    M = shape[1]
    x = mk.expand_prologue(z, ids, E, head_w, norm_w, head_eps, norm_eps)
    x_ref = mk.expand_prologue_reference(z, ids, E, head_w, norm_w, head_eps, norm_eps)
    assert (x - x_ref).abs().max() < 1e-5
    act = mk.swiglu_gemm(x_ref, ug_w, ug_b)
    act_ref = mk.swiglu_reference(x_ref, ug_w, ug_b)
    assert (act - act_ref).abs().max() < 1e-4
    y = mk.down_residual(act_ref, d_w, z, M)
    y_ref = mk.down_residual_reference(act_ref, d_w, z, M)
    assert y.dtype == torch.float32 and (y - y_ref).abs().max() < 1e-4
    out = mk.rms_norm_rows(y_ref, norm_w, norm_eps)
    assert (out - mk.rms_norm(y_ref, norm_w, norm_eps)).abs().max() < 1e-5


@needs_triton
def test_kernels_other_tiles_and_errors():
    args = make_inputs(5, 4, 64, 48, 30, device=DEVICE)
    ref = mk.mlp_expand_reference(*args)
    out = mk.mlp_expand_triton(*args, tiles=mk.GemmTiles(block_m=16, block_n=32, block_k=16))
    assert (out - ref).abs().max().item() < 1e-4
    bad = list(args)
    bad[6] = bad[6][:, :-1]  # d_weight [H, I-1]
    with pytest.raises(ValueError, match="d_weight"):
        mk.mlp_expand_triton(*bad)
    with pytest.raises(ValueError, match="gemm"):
        mk.mlp_expand_triton(*args, gemm="cublas")


def test_custom_op_fake_and_cpu_path():
    from treeflash_kernels.ops import mlp_expand

    args = make_inputs(4, 3, 40, 24, 50)
    assert torch.equal(mlp_expand(*args), mk.mlp_expand_reference(*args))  # CPU: the reference
    torch.library.opcheck(mlp_expand, args)  # schema, fake (meta) implementation, dispatch


@needs_triton
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_kernel_compiles_for_hopper(dtype):
    """The PTX TensorRT's ahead-of-time plugins embed: compiled for sm_90 with no GPU present."""
    from treeflash_kernels.aot import KERNELS, compile_kernel

    for name in KERNELS:
        k = compile_kernel(name, dtype, hidden=4096, arch=90)
        assert ".target sm_90" in k.ptx and f".entry {k.name}(" in k.ptx, name
        assert k.num_warps * 32 <= 1024 and k.shared <= 227 * 1024, name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.float16, 2e-2), (torch.bfloat16, 1e-1)])
@pytest.mark.parametrize("shape", SHAPES + [(16, 16, 512, 1536, 1000)], ids=lambda s: "B{}-M{}-H{}-I{}-V{}".format(*s))
def test_kernels_match_reference_cuda(shape, dtype, tol):
    """Compiled kernels on the GPU vs the float32 reference (tolerances per dtype; outputs are RMS-normalised)."""
    args = make_inputs(*shape, dtype=dtype, device="cuda")
    ref = mk.mlp_expand_reference(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args])
    for gemm in ("triton", "torch"):
        out = mk.mlp_expand_triton(*args, gemm=gemm)
        err = (out.float() - ref).abs().max().item()
        assert err < tol, (gemm, err)


@needs_triton
def test_kernel_bench_runs_side_by_side():
    import json

    from click.testing import CliRunner

    from treeflash_kernels.bench import main as bench_main

    args = ["--hidden", "48", "--intermediate", "40", "--block", "3", "--top-m", "2", "--vocab", "100",
            "--dtype", "float32", "--repeat", "1", "--warmup", "0", "--json"]
    r = CliRunner().invoke(bench_main, args)
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert [x["impl"] for x in report["results"]] == ["eager", "triton", "triton-cublas"]
    assert all(x["max_abs_diff_vs_eager"] < 1e-4 and x["seconds"] > 0 for x in report["results"])
    assert report["floor_ms"] > 0 and report["bandwidth_GBps"] > 0 and report["shape"]["rows"] == 4
    r = CliRunner().invoke(bench_main, args[:-1] + ["--impls", "eager,fast"])
    assert r.exit_code == 2 and "unknown --impls" in r.output
