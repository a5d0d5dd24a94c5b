"""Ahead-of-time compilation of the MLP-expansion kernels (PTX + cubin for a named GPU).

TensorRT's ahead-of-time plugins embed a kernel's PTX in the engine, so serialised
engines run with no Python. Compiling needs no GPU: the same call proves on a CPU
machine that every kernel compiles for Hopper (sm_90).
"""

from __future__ import annotations

from . import mlp_expand as mk
from .mlp_expand import DEFAULT_TILES, GemmTiles

TRITON_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}

# name -> (kernel, [(arg, type)] in the AOT calling convention: input pointers, int32 sizes, output pointers).
# "T" is the graph's float dtype; "F32" a float32 buffer; "I64" the int64 parent ids.
KERNELS = {
    "expand_prologue": ("expand_prologue_kernel",
                        [("z_ptr", "T"), ("ids_ptr", "I64"), ("embed_ptr", "T"), ("head_w_ptr", "T"),
                         ("norm_w_ptr", "T"), ("R", "i32"), ("M", "i32"), ("H", "i32"), ("x_ptr", "T")]),
    "swiglu_gemm": ("swiglu_gemm_kernel",
                    [("x_ptr", "T"), ("w_ptr", "T"), ("b_ptr", "T"), ("R", "i32"), ("I", "i32"), ("K", "i32"),
                     ("act_ptr", "T")]),
    "down_residual": ("down_residual_kernel",
                      [("act_ptr", "T"), ("w_ptr", "T"), ("z_ptr", "T"), ("R", "i32"), ("H", "i32"), ("K", "i32"),
                       ("M", "i32"), ("y_ptr", "F32")]),
    "rms_norm": ("rms_norm_kernel", [("y_ptr", "F32"), ("w_ptr", "T"), ("R", "i32"), ("H", "i32"),
                                     ("out_ptr", "T")]),
}


def constexprs(name: str, dtype: str, *, hidden: int, head_eps: float = 1e-6, norm_eps: float = 1e-6,
               tiles: GemmTiles = DEFAULT_TILES) -> dict:
    import torch

    prec = mk.dot_precision(getattr(torch, dtype))
    gemm = {"PRECISION": prec, "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k}
    block_h = mk._pow2(hidden)
    return {
        "expand_prologue": {"HEAD_EPS": head_eps, "NORM_EPS": norm_eps, "BLOCK_H": block_h},
        "swiglu_gemm": gemm,
        "down_residual": gemm,
        "rms_norm": {"EPS": norm_eps, "BLOCK_H": block_h},
    }[name]


def num_warps(name: str, hidden: int, tiles: GemmTiles = DEFAULT_TILES) -> tuple[int, int]:
    """(num_warps, num_stages) the launcher in mlp_expand uses for this kernel."""
    if name in ("swiglu_gemm", "down_residual"):
        return tiles.num_warps, tiles.num_stages
    return mk.row_warps(hidden), 1


def compile_kernel(name: str, dtype: str, *, hidden: int, arch: int = 90, head_eps: float = 1e-6,
                   norm_eps: float = 1e-6, tiles: GemmTiles = DEFAULT_TILES):
    """triton.compile one kernel for CUDA sm_<arch>; returns the CompiledKernel (asm['ptx'], metadata)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if mk.triton is None:
        raise RuntimeError("compiling the kernels needs triton: pip install triton")
    attr, args = KERNELS[name]
    fn = getattr(mk, attr)
    if not isinstance(fn, JITFunction):  # TRITON_INTERPRET=1 wraps kernels for the interpreter
        fn = JITFunction(fn.fn)
    t = TRITON_DTYPES[dtype]
    types = {"T": f"*{t}", "F32": "*fp32", "I64": "*i64", "i32": "i32"}
    consts = constexprs(name, dtype, hidden=hidden, head_eps=head_eps, norm_eps=norm_eps, tiles=tiles)
    signature = {a: types[k] for a, k in args} | {c: "constexpr" for c in consts}
    warps, stages = num_warps(name, hidden, tiles)
    src = ASTSource(fn=fn, signature=signature, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
