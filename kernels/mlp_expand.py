"""The MLP expansion (TreeFlash stage 2 before the LM head) as Triton kernels, with the
plain-PyTorch reference beside them.

For every (block position d, parent candidate m) pair, row r = d * M + m:

    e      = RMSNorm_e(E[parent[r]])                    (head norm, eps 1e-6)
    h      = norm(z[d + 1])                             (the drafter's final norm)
    [u, g] = W_ug [e ; h] + b_ug
    y      = z[d + 1] + W_d (silu(g) * u)
    out[r] = norm(y)                                    -> lm_head gives the conditional logits

Position 0's parents are all the root token (the caller puts it in ``parent_ids``).

Four kernels, one per stage. The split follows the data: the two GEMMs stream the
head's weights (the whole cost at real sizes), the two row-wise stages are
reductions over H that a GEMM tile cannot see whole.
- ``expand_prologue_kernel``: gather + both norms -> x [R, 2H] (the GEMM's input)
- ``swiglu_gemm_kernel``: x W_ug^T + b with the SwiGLU epilogue -> act [R, I]
  (u and g tiles computed side by side, so the [R, 2I] product is never stored)
- ``down_residual_kernel``: act W_d^T + z[d + 1] -> y [R, H] (float32)
- ``rms_norm_kernel``: norm(y) -> out [R, H]
Every kernel's non-constexpr parameters are ordered (input pointers, int32 sizes,
output pointers), the calling convention of TensorRT's ahead-of-time plugins, so
the same kernels serve this launcher and the plugins (treeflash_plugins).
All accumulation is float32.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------- reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm: normalise in float32, cast back, then scale."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def mlp_expand_reference(z, parent_ids, embed_weight, head_norm_weight, ug_weight, ug_bias, d_weight,
                         norm_weight, head_eps: float, norm_eps: float) -> torch.Tensor:
    """z [B, H] (pre-norm), parent_ids [B-1, M] -> normalised states [B-1, M, H].

    The same composition as treeflash_export.models (head + final norm), written
    out: this is what every kernel and graph variant is checked against."""
    M = parent_ids.shape[1]
    H = z.shape[1]
    e = rms_norm(F.embedding(parent_ids, embed_weight), head_norm_weight, head_eps)  # [B-1, M, H]
    h = rms_norm(z, norm_weight, norm_eps)[1:, None, :].expand(-1, M, H)
    u, g = F.linear(torch.cat([e, h], dim=-1), ug_weight, ug_bias).chunk(2, dim=-1)
    delta = F.linear(F.silu(g) * u, d_weight)
    return rms_norm(z[1:, None, :] + delta, norm_weight, norm_eps)


def check_shapes(z, parent_ids, embed_weight, head_norm_weight, ug_weight, ug_bias, d_weight, norm_weight) -> None:
    B, H = z.shape
    if parent_ids.dim() != 2 or parent_ids.shape[0] != B - 1:
        raise ValueError(f"mlp_expand: parent_ids must be [B-1, M] = [{B - 1}, M], got {tuple(parent_ids.shape)}")
    I2 = ug_weight.shape[0]
    want = {"embed_weight": (embed_weight.shape[0], H), "head_norm_weight": (H,), "ug_weight": (I2, 2 * H),
            "ug_bias": (I2,), "d_weight": (H, I2 // 2), "norm_weight": (H,)}
    got = {"embed_weight": embed_weight, "head_norm_weight": head_norm_weight, "ug_weight": ug_weight,
           "ug_bias": ug_bias, "d_weight": d_weight, "norm_weight": norm_weight}
    for name, shape in want.items():
        if tuple(got[name].shape) != shape:
            raise ValueError(f"mlp_expand: {name} has shape {tuple(got[name].shape)}, expected {shape}")
    if I2 % 2:
        raise ValueError(f"mlp_expand: ug_weight rows ({I2}) must be even (u and g halves)")


# ----------------------------------------------------------------------------- kernels

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch reference still works; the kernels need `pip install triton`
    triton = None


def interpreting() -> bool:
    """Whether Triton runs launches in its interpreter (TRITON_INTERPRET=1). Triton 3.4 and later
    read the setting through ``triton.knobs``; earlier releases read the variable itself."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_interpreted_on_cpu = False  # set by interpreted_on_cpu(): tests run whole generations through the kernels


def runs_triton(x) -> bool:
    """Whether the dispatchers take the Triton kernels for tensor x: on CUDA with triton installed,
    or on the CPU inside interpreted_on_cpu() (Triton's interpreter; test-sized models only)."""
    return triton is not None and (x.is_cuda or (_interpreted_on_cpu and x.device.type == "cpu"))


@contextlib.contextmanager
def interpreted_on_cpu():
    """Within: CPU tensors go through the Triton kernels too, in Triton's interpreter (which must be
    on: TRITON_INTERPRET=1), so a CPU test can run a generation through every kernel. About 10^4
    times slower than PyTorch: tiny models and a few tokens."""
    global _interpreted_on_cpu
    if triton is None or not interpreting():
        raise RuntimeError("interpreted_on_cpu needs triton with TRITON_INTERPRET=1")
    _interpreted_on_cpu = True
    try:
        yield
    finally:
        _interpreted_on_cpu = False


if triton is not None:

    @triton.jit
    def _gemm_tile(R, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """This program's output tile: row and column indices and their bounds masks."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        return rows, cols, rows < R, cols < N

    @triton.jit
    def expand_prologue_kernel(z_ptr, ids_ptr, embed_ptr, head_w_ptr, norm_w_ptr, R, M, H, x_ptr,
                               HEAD_EPS: tl.constexpr, NORM_EPS: tl.constexpr, BLOCK_H: tl.constexpr):
        r = tl.program_id(0)
        cols = tl.arange(0, BLOCK_H)
        ok = cols < H
        token = tl.load(ids_ptr + r).to(tl.int64)
        e = tl.load(embed_ptr + token * H + cols, mask=ok, other=0.0).to(tl.float32)
        e = e * tl.rsqrt(tl.sum(e * e, axis=0) / H + HEAD_EPS)
        e = e.to(x_ptr.dtype.element_ty) * tl.load(head_w_ptr + cols, mask=ok, other=0.0)
        row = (r // M + 1).to(tl.int64)
        h = tl.load(z_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
        h = h * tl.rsqrt(tl.sum(h * h, axis=0) / H + NORM_EPS)
        h = h.to(x_ptr.dtype.element_ty) * tl.load(norm_w_ptr + cols, mask=ok, other=0.0)
        out = x_ptr + r.to(tl.int64) * 2 * H
        tl.store(out + cols, e, mask=ok)
        tl.store(out + H + cols, h, mask=ok)

    @triton.jit
    def swiglu_gemm_kernel(x_ptr, w_ptr, b_ptr, R, I, K, act_ptr, PRECISION: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """act[r, n] = silu(g) * u with u = x W[n]^T + b[n], g = x W[I + n]^T + b[I + n]; x [R, K], W [2I, K]."""
        rows, cols, row_ok, col_ok = _gemm_tile(R, I, BLOCK_M, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * K
        wu_cols = w_ptr + cols.to(tl.int64)[None, :] * K
        wg_cols = w_ptr + (cols.to(tl.int64) + I)[None, :] * K
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            wu = tl.load(wu_cols + k[:, None], mask=w_mask, other=0.0)
            wg = tl.load(wg_cols + k[:, None], mask=w_mask, other=0.0)
            acc_u = tl.dot(a, wu, acc_u, input_precision=PRECISION)
            acc_g = tl.dot(a, wg, acc_g, input_precision=PRECISION)
        acc_u += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.load(b_ptr + I + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        act = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(act_ptr + rows.to(tl.int64)[:, None] * I + cols[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def down_residual_kernel(act_ptr, w_ptr, z_ptr, R, H, K, M, y_ptr, PRECISION: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """y[r, n] = act[r] . W[n] + z[r // M + 1, n]; act [R, K], W [H, K], y float32 [R, H]."""
        rows, cols, row_ok, col_ok = _gemm_tile(R, H, BLOCK_M, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        a_rows = act_ptr + rows.to(tl.int64)[:, None] * K
        w_cols = w_ptr + cols.to(tl.int64)[None, :] * K
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        ok = row_ok[:, None] & col_ok[None, :]
        z_rows = (rows // M + 1).to(tl.int64)
        acc += tl.load(z_ptr + z_rows[:, None] * H + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], acc, mask=ok)

    @triton.jit
    def rms_norm_kernel(y_ptr, w_ptr, R, H, out_ptr, EPS: tl.constexpr, BLOCK_H: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        ok = cols < H
        y = tl.load(y_ptr + r * H + cols, mask=ok, other=0.0).to(tl.float32)
        y = y * tl.rsqrt(tl.sum(y * y, axis=0) / H + EPS)
        out = y.to(out_ptr.dtype.element_ty) * tl.load(w_ptr + cols, mask=ok, other=0.0)
        tl.store(out_ptr + r * H + cols, out, mask=ok)


@dataclass(frozen=True)
class GemmTiles:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


# Chosen for skinny GEMMs (R = (B-1) * M rows, a few hundred) streaming large weights.
DEFAULT_TILES = GemmTiles()


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def launch_meta(kernel: str, dtype: torch.dtype, hidden: int, *, tiles: GemmTiles = DEFAULT_TILES,
                head_eps: float = 1e-6, norm_eps: float = 1e-6) -> tuple[dict, dict]:
    """(constexpr arguments, launch options) of one kernel: the single source for the launchers
    below and for ahead-of-time compilation (treeflash_kernels.aot, the TensorRT plugins)."""
    if kernel in ("swiglu_gemm", "down_residual"):
        # float32 inputs multiply in full precision (TF32 would break fp32 parity); 16-bit ones natively.
        consts = {"PRECISION": "ieee" if dtype == torch.float32 else "tf32", "BLOCK_M": tiles.block_m,
                  "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k}
        return consts, {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    # Row-wise kernels: one program holds a whole row of H.
    block_h = _pow2(hidden)
    options = {"num_warps": 4 if block_h <= 2048 else 8, "num_stages": 1}
    if kernel == "expand_prologue":
        return {"HEAD_EPS": head_eps, "NORM_EPS": norm_eps, "BLOCK_H": block_h}, options
    if kernel == "rms_norm":
        return {"EPS": norm_eps, "BLOCK_H": block_h}, options
    raise KeyError(kernel)


# Stage references: what each kernel computes, in plain PyTorch (float32 where the kernel keeps float32).


def expand_prologue_reference(z, parent_ids, embed_weight, head_norm_weight, norm_weight, head_eps, norm_eps):
    M, H = parent_ids.shape[1], z.shape[1]
    e = rms_norm(F.embedding(parent_ids, embed_weight), head_norm_weight, head_eps)
    h = rms_norm(z, norm_weight, norm_eps)[1:, None, :].expand(-1, M, H)
    return torch.cat([e, h], dim=-1).reshape(-1, 2 * H)


def swiglu_reference(x, ug_weight, ug_bias):
    u, g = F.linear(x, ug_weight, ug_bias).chunk(2, dim=-1)
    return F.silu(g) * u


def down_residual_reference(act, d_weight, z, top_m: int):
    return (z[1:].repeat_interleave(top_m, dim=0) + F.linear(act, d_weight)).float()


# Stage launchers: one kernel each (the same kernels and launch grids as the TensorRT plugins).


def _need_triton():
    if triton is None:
        raise RuntimeError("the Triton kernels need triton: pip install triton")


def expand_prologue(z, parent_ids, embed_weight, head_norm_weight, norm_weight, head_eps, norm_eps):
    _need_triton()
    (Bm1, M), H = parent_ids.shape, z.shape[1]
    R = Bm1 * M
    x = torch.empty(R, 2 * H, device=z.device, dtype=z.dtype)
    consts, options = launch_meta("expand_prologue", z.dtype, H, head_eps=head_eps, norm_eps=norm_eps)
    expand_prologue_kernel[(R,)](z.contiguous(), parent_ids.reshape(-1).contiguous(), embed_weight,
                                 head_norm_weight, norm_weight, R, M, H, x, **consts, **options)
    return x


def swiglu_gemm(x, ug_weight, ug_bias, tiles: GemmTiles = DEFAULT_TILES):
    _need_triton()
    (R, K), I, t = x.shape, ug_weight.shape[0] // 2, tiles
    act = torch.empty(R, I, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(R, t.block_m), triton.cdiv(I, t.block_n))
    consts, options = launch_meta("swiglu_gemm", x.dtype, K // 2, tiles=t)
    swiglu_gemm_kernel[grid](x, ug_weight, ug_bias, R, I, K, act, **consts, **options)
    return act


def down_residual(act, d_weight, z, top_m: int, tiles: GemmTiles = DEFAULT_TILES):
    _need_triton()
    (R, I), H, t = act.shape, d_weight.shape[0], tiles
    y = torch.empty(R, H, device=act.device, dtype=torch.float32)
    grid = (triton.cdiv(R, t.block_m), triton.cdiv(H, t.block_n))
    consts, options = launch_meta("down_residual", act.dtype, H, tiles=t)
    down_residual_kernel[grid](act, d_weight, z.contiguous(), R, H, I, top_m, y, **consts, **options)
    return y


def rms_norm_rows(y, weight, eps: float):
    """RMSNorm of float32 rows y [R, H] into weight's dtype."""
    _need_triton()
    R, H = y.shape
    out = torch.empty(R, H, device=y.device, dtype=weight.dtype)
    consts, options = launch_meta("rms_norm", weight.dtype, H, norm_eps=eps)
    rms_norm_kernel[(R,)](y, weight, R, H, out, **consts, **options)
    return out


def mlp_expand_triton(z, parent_ids, embed_weight, head_norm_weight, ug_weight, ug_bias, d_weight, norm_weight,
                      head_eps: float, norm_eps: float, *, gemm: str = "triton",
                      tiles: GemmTiles = DEFAULT_TILES) -> torch.Tensor:
    """The four kernels in turn. gemm="torch" runs the two GEMM stages through torch.matmul
    (cuBLAS on CUDA) instead, keeping the row-wise kernels."""
    _need_triton()
    if gemm not in ("triton", "torch"):
        raise ValueError(f"gemm must be 'triton' or 'torch', not {gemm!r}")
    check_shapes(z, parent_ids, embed_weight, head_norm_weight, ug_weight, ug_bias, d_weight, norm_weight)
    Bm1, M = parent_ids.shape
    x = expand_prologue(z, parent_ids, embed_weight, head_norm_weight, norm_weight, head_eps, norm_eps)
    if gemm == "triton":
        y = down_residual(swiglu_gemm(x, ug_weight, ug_bias, tiles), d_weight, z, M, tiles)
    else:
        y = down_residual_reference(swiglu_reference(x, ug_weight, ug_bias), d_weight, z, M)
    return rms_norm_rows(y, norm_weight, norm_eps).view(Bm1, M, -1)
