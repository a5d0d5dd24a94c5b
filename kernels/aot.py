"""Ahead-of-time compilation of the MLP-expansion kernels (PTX + cubin for a named GPU).

TensorRT's ahead-of-time plugins embed a kernel's PTX in the engine, so serialised
engines run with no Python. Compiling needs no GPU: the same call proves on a CPU
machine that every kernel compiles for Hopper (sm_90).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

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


@dataclass(frozen=True)
class CompiledKernel:
    name: str  # the kernel's entry symbol in the PTX
    ptx: str
    num_warps: int
    shared: int  # dynamic shared memory per block, bytes
    arch: int


def compile_kernel(name: str, dtype: str, *, hidden: int, arch: int = 90, head_eps: float = 1e-6,
                   norm_eps: float = 1e-6, tiles: GemmTiles = DEFAULT_TILES) -> CompiledKernel:
    """triton.compile one kernel for CUDA sm_<arch>. Where launches are interpreted
    (TRITON_INTERPRET=1) Triton cannot also generate code in the same process, so it
    compiles in a child process."""
    if mk.triton is None:
        raise RuntimeError("compiling the kernels needs triton: pip install triton")
    request = dict(name=name, dtype=dtype, hidden=hidden, arch=arch, head_eps=head_eps, norm_eps=norm_eps,
                   tiles=asdict(tiles))
    if not mk.interpreting():
        return _compile(**request)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "treeflash_kernels.aot", json.dumps(request)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {name} for sm_{arch} failed:\n{proc.stderr[-4000:]}")
    return CompiledKernel(**json.loads(proc.stdout))


def ast_source(fn, signature: dict, constexprs: dict):
    """Triton's compile input for one kernel; Triton 3.2 names the constexpr values ``constants``,
    3.3 and later ``constexprs``."""
    import inspect

    from triton.compiler import ASTSource

    key = "constexprs" if "constexprs" in inspect.signature(ASTSource).parameters else "constants"
    return ASTSource(fn=fn, signature=signature, **{key: constexprs})


def _compile(name, dtype, hidden, arch, head_eps, norm_eps, tiles) -> CompiledKernel:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    tiles = GemmTiles(**tiles)
    attr, args = KERNELS[name]
    t = TRITON_DTYPES[dtype]
    types = {"T": f"*{t}", "F32": "*fp32", "I64": "*i64", "i32": "i32"}
    consts, options = mk.launch_meta(name, getattr(torch, dtype), hidden, tiles=tiles, head_eps=head_eps,
                                     norm_eps=norm_eps)
    signature = {a: types[k] for a, k in args} | {c: "constexpr" for c in consts}
    k = triton.compile(ast_source(getattr(mk, attr), signature, consts), target=GPUTarget("cuda", arch, 32),
                       options=options)
    return CompiledKernel(k.metadata.name, k.asm["ptx"], k.metadata.num_warps, k.metadata.shared, arch)


if __name__ == "__main__":  # the child process of compile_kernel
    print(json.dumps(asdict(_compile(**json.loads(sys.argv[1])))))
