"""TensorRT plugins for the MLP expansion, written with TensorRT's Python plugin API
(``tensorrt.plugin``) and ahead-of-time implementations: each plugin returns the PTX
of one Triton kernel (compiled by treeflash_kernels.aot) and its launch parameters,
which TensorRT embeds in the engine, so serialised engines run with no Python.

TensorRT's constraint: an ahead-of-time plugin launches exactly one kernel and owns
no scratch memory, so the single ``MlpExpand`` node of the exported graphs is split
(treeflash_plugins.onnx_ops.split_for_tensorrt) into one plugin per kernel, with the
intermediates (x [R, 2H], act [R, I], y [R, H] float32) as tensors between them.

Import this module only through ``treeflash_plugins.load_plugins()``. It needs
TensorRT 10.8 or newer (11 is the target) and triton; neither can be installed on
the machines this project is developed on, so this file has not been run there.
"""

from __future__ import annotations

from typing import Tuple

import tensorrt as trt
import tensorrt.plugin as trtp

from treeflash_kernels.aot import compile_kernel
from treeflash_kernels.mlp_expand import DEFAULT_TILES

DTYPES = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}
F = "FP32|FP16|BF16"  # the graph's float dtype, matched position-wise across I/O
F32 = "FP32"


def _static(expr, what: str) -> int:
    if not expr.is_constant:
        raise ValueError(f"treeflash plugins need a static {what}")
    return int(expr.constant_value())


def _launch(kernel, grid_x, grid_y=1) -> trtp.KernelLaunchParams:
    p = trtp.KernelLaunchParams()
    p.grid_x = grid_x
    p.grid_y = grid_y
    p.block_x = kernel.num_warps * 32
    p.shared_mem = kernel.shared
    return p


def _result(kernel, params, *sizes):
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(s) for s in sizes])
    return kernel.name.encode(), kernel.ptx.encode(), params, extra


def _rows(parent_ids: trtp.TensorDesc):
    return parent_ids.shape_expr[0] * parent_ids.shape_expr[1]


# ---------------------------------------------------------------- ExpandPrologue -> x [R, 2H]

@trtp.register("treeflash::ExpandPrologue")
def _prologue_desc(z: trtp.TensorDesc, parent_ids: trtp.TensorDesc, embed_weight: trtp.TensorDesc,
                   head_norm_weight: trtp.TensorDesc, norm_weight: trtp.TensorDesc, head_eps: float,
                   norm_eps: float) -> trtp.TensorDesc:
    return trtp.from_shape_expr((_rows(parent_ids), z.shape_expr[1] * 2), dtype=z.dtype)


@trtp.autotune("treeflash::ExpandPrologue")
def _prologue_tune(z, parent_ids, embed_weight, head_norm_weight, norm_weight, outputs):
    return [trtp.AutoTuneCombination(f"{F}, INT64, {F}, {F}, {F}, {F}")]


@trtp.aot_impl("treeflash::ExpandPrologue")
def _prologue_aot(z: trtp.TensorDesc, parent_ids: trtp.TensorDesc, embed_weight: trtp.TensorDesc,
                  head_norm_weight: trtp.TensorDesc, norm_weight: trtp.TensorDesc, head_eps: float, norm_eps: float,
                  outputs: Tuple[trtp.TensorDesc], tactic: int):
    H = _static(z.shape_expr[1], "hidden size")
    k = compile_kernel("expand_prologue", DTYPES[z.dtype], hidden=H, head_eps=head_eps, norm_eps=norm_eps)
    R = _rows(parent_ids)
    return _result(k, _launch(k, R), R, parent_ids.shape_expr[1], H)


# ---------------------------------------------------------------- SwigluGemm -> act [R, I]

@trtp.register("treeflash::SwigluGemm")
def _swiglu_desc(x: trtp.TensorDesc, ug_weight: trtp.TensorDesc, ug_bias: trtp.TensorDesc) -> trtp.TensorDesc:
    return trtp.from_shape_expr((x.shape_expr[0], ug_weight.shape_expr[0] // 2), dtype=x.dtype)


@trtp.autotune("treeflash::SwigluGemm")
def _swiglu_tune(x, ug_weight, ug_bias, outputs):
    return [trtp.AutoTuneCombination(f"{F}, {F}, {F}, {F}")]


@trtp.aot_impl("treeflash::SwigluGemm")
def _swiglu_aot(x: trtp.TensorDesc, ug_weight: trtp.TensorDesc, ug_bias: trtp.TensorDesc,
                outputs: Tuple[trtp.TensorDesc], tactic: int):
    K = _static(x.shape_expr[1], "hidden size")
    I = _static(ug_weight.shape_expr[0], "intermediate size") // 2
    t = DEFAULT_TILES
    k = compile_kernel("swiglu_gemm", DTYPES[x.dtype], hidden=K // 2, tiles=t)
    R = x.shape_expr[0]
    return _result(k, _launch(k, trtp.cdiv(R, t.block_m), (I + t.block_n - 1) // t.block_n), R, I, K)


# ---------------------------------------------------------------- DownResidual -> y [R, H] float32

@trtp.register("treeflash::DownResidual")
def _down_desc(act: trtp.TensorDesc, d_weight: trtp.TensorDesc, z: trtp.TensorDesc, top_m: int) -> trtp.TensorDesc:
    return trtp.from_shape_expr((act.shape_expr[0], z.shape_expr[1]), dtype=trt.float32)


@trtp.autotune("treeflash::DownResidual")
def _down_tune(act, d_weight, z, outputs):
    return [trtp.AutoTuneCombination(f"{F}, {F}, {F}, {F32}")]


@trtp.aot_impl("treeflash::DownResidual")
def _down_aot(act: trtp.TensorDesc, d_weight: trtp.TensorDesc, z: trtp.TensorDesc, top_m: int,
              outputs: Tuple[trtp.TensorDesc], tactic: int):
    H = _static(z.shape_expr[1], "hidden size")
    I = _static(act.shape_expr[1], "intermediate size")
    t = DEFAULT_TILES
    k = compile_kernel("down_residual", DTYPES[act.dtype], hidden=H, tiles=t)
    R = act.shape_expr[0]
    return _result(k, _launch(k, trtp.cdiv(R, t.block_m), (H + t.block_n - 1) // t.block_n), R, H, I, top_m)


# ---------------------------------------------------------------- RmsNorm -> out [R, H]

@trtp.register("treeflash::RmsNorm")
def _norm_desc(y: trtp.TensorDesc, norm_weight: trtp.TensorDesc, eps: float) -> trtp.TensorDesc:
    return trtp.from_shape_expr((y.shape_expr[0], y.shape_expr[1]), dtype=norm_weight.dtype)


@trtp.autotune("treeflash::RmsNorm")
def _norm_tune(y, norm_weight, outputs):
    return [trtp.AutoTuneCombination(f"{F32}, {F}, {F}")]


@trtp.aot_impl("treeflash::RmsNorm")
def _norm_aot(y: trtp.TensorDesc, norm_weight: trtp.TensorDesc, eps: float, outputs: Tuple[trtp.TensorDesc],
              tactic: int):
    H = _static(y.shape_expr[1], "hidden size")
    k = compile_kernel("rms_norm", DTYPES[norm_weight.dtype], hidden=H, norm_eps=eps)
    R = y.shape_expr[0]
    return _result(k, _launch(k, R), R, H)


PLUGIN_IDS = ("treeflash::ExpandPrologue", "treeflash::SwigluGemm", "treeflash::DownResidual", "treeflash::RmsNorm")
