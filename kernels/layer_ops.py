"""The elementwise work of a decoder layer in three kernels, with the plain-PyTorch reference
beside each (the runtime's fast path; the GEMMs stay with cuBLAS).

- ``add_rms_norm``: the residual add and the next RMSNorm, x' = x + d, h = norm(x').
- ``qk_norm_rope``: from the merged q/k/v projection's output [n, (Hq + 2 Hkv) D]: per-head
  RMSNorm of q and k (Qwen3; skipped for Llama), RoPE (rotate-half convention), q returned
  as [Hq, n, D], k and v written straight into the cache at each row's slot (slot < 0: not
  written, for padding rows).
- ``silu_mul``: SwiGLU's activation over the merged gate/up projection's output [n, 2I].

A Hugging Face layer dispatches about 56 operators besides views (each norm alone is seven);
with these a layer dispatches 9: 5 GEMMs, the attention op and 3 of these kernels, plus the
add + norm that closes it.

Rounding follows the modules: each operation of the Hugging Face composition rounds to
the model's dtype (the norm's output before the weight, silu before the product, both RoPE
products before their sum), and the kernels round at the same points. So in 16-bit the
fused path differs from the modules only by the order of a row's sum of squares; in
float32 the rounding points vanish.
"""

from __future__ import annotations

import torch

from .mlp_expand import _pow2, rms_norm

# ----------------------------------------------------------------------------- reference


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, n, D] rotated by cos/sin [n, D], the rotate-half convention (the pairs are
    (i, i + D/2)); written here apart from the models' own, so the tests compare two versions."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """x, delta [n, H] (delta None: no add) -> (x + delta, RMSNorm(x + delta))."""
    s = x if delta is None else x + delta
    return s, rms_norm(s, weight, eps)


def qk_norm_rope_reference(qkv, q_weight, k_weight, eps: float, cos, sin, k_cache, v_cache, slots, num_heads: int):
    """qkv [n, (Hq + 2 Hkv) D]; q_weight, k_weight [D] or None (no per-head norm); cos, sin [n, D];
    k_cache, v_cache [Hkv, S, D] (views into the runtime's cache, written in place); slots [n] int64,
    negative for padding rows (not written); slot S - 1 must not be a real row's. Returns q [Hq, n, D]."""
    n, D = qkv.shape[0], k_cache.shape[-1]
    Hkv = k_cache.shape[0]
    q, k, v = qkv.view(n, -1, D).split([num_heads, Hkv, Hkv], dim=1)
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    q = apply_rope(q, cos, sin).contiguous()
    k = apply_rope(k, cos, sin)
    keep = slots >= 0
    # Rows with a negative slot write the cache's last slot back unchanged (a gather, then a masked
    # write): a scratch slot, so no real row's slot is written twice (the order of duplicate writes
    # is undefined on a GPU). The runner's caches keep spare slots past their capacity.
    idx = torch.where(keep, slots, k_cache.shape[1] - 1)
    k_cache.index_copy_(1, idx, torch.where(keep[None, :, None], k, k_cache.index_select(1, idx)))
    v_cache.index_copy_(1, idx, torch.where(keep[None, :, None], v, v_cache.index_select(1, idx)))
    return q


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2I] (gate columns first, as the merged projection stores them) -> silu(gate) * up [n, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# ----------------------------------------------------------------------------- kernels

try:
    import triton
    import triton.language as tl
except ImportError:  # the references still work; the kernels need `pip install triton`
    triton = None

if triton is not None:

    @triton.jit
    def _rstd(sum_sq, width, EPS: tl.constexpr):
        """1 / sqrt(sum_sq / width + eps), each step correctly rounded: compiled Triton's `/` and
        `rsqrt` are approximate in float32 (the interpreter's NumPy is not), and these kernels feed
        the verifier's logits, whose argmax is the greedy output. One scalar per row: no cost."""
        mean = tl.math.div_rn(sum_sq, tl.cast(width, tl.float32))
        return tl.math.div_rn(tl.full((), 1.0, tl.float32), tl.math.sqrt_rn(mean + EPS))

    @triton.jit
    def add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, H, s_ptr, h_ptr, EPS: tl.constexpr, HAS_DELTA: tl.constexpr,
                            BLOCK_H: tl.constexpr):
        """One program per row: s = x + d (rounded, stored when HAS_DELTA), h = norm(s) * w."""
        r = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        ok = cols < H
        dt = h_ptr.dtype.element_ty
        s = tl.load(x_ptr + r * H + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_DELTA:
            s += tl.load(d_ptr + r * H + cols, mask=ok, other=0.0).to(tl.float32)
            s = s.to(dt)
            tl.store(s_ptr + r * H + cols, s, mask=ok)
            s = s.to(tl.float32)
        y = (s * _rstd(tl.sum(s * s, axis=0), H, EPS)).to(dt).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(h_ptr + r * H + cols, (y * w).to(dt), mask=ok)

    @triton.jit
    def _norm_rope_row(x, xr, w_ptr, cos, sin, dims, perm, EPS: tl.constexpr, HAS_NORM: tl.constexpr,
                       HEAD_DIM: tl.constexpr, dt: tl.constexpr):
        """One head's row x (float32) and its half-rotated copy xr -> normed, rotated (float32)."""
        if HAS_NORM:
            rstd = _rstd(tl.sum(x * x, axis=0), HEAD_DIM, EPS)
            x = ((x * rstd).to(dt).to(tl.float32) * tl.load(w_ptr + dims).to(tl.float32)).to(dt).to(tl.float32)
            xr = ((xr * rstd).to(dt).to(tl.float32) * tl.load(w_ptr + perm).to(tl.float32)).to(dt).to(tl.float32)
        sign = tl.where(dims < HEAD_DIM // 2, -1.0, 1.0)
        return (x * cos).to(dt).to(tl.float32) + (sign * xr * sin).to(dt).to(tl.float32)

    @triton.jit
    def qk_norm_rope_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, slots_ptr, Hq, Hkv, stride_kh, stride_ks,
                            q_ptr, k_ptr, v_ptr, EPS: tl.constexpr, HAS_NORM: tl.constexpr,
                            HEAD_DIM: tl.constexpr):
        """One program per (row, head) over the Hq + 2 Hkv heads of the merged projection."""
        node = tl.program_id(0)
        head = tl.program_id(1)
        n = tl.num_programs(0)
        dt = q_ptr.dtype.element_ty
        dims = tl.arange(0, HEAD_DIM)
        perm = (dims + HEAD_DIM // 2) % HEAD_DIM
        row = qkv_ptr + (node.to(tl.int64) * (Hq + 2 * Hkv) + head) * HEAD_DIM
        x = tl.load(row + dims).to(tl.float32)
        slot = tl.load(slots_ptr + node)
        if head < Hq + Hkv:
            xr = tl.load(row + perm).to(tl.float32)
            cos = tl.load(cos_ptr + node * HEAD_DIM + dims).to(tl.float32)
            sin = tl.load(sin_ptr + node * HEAD_DIM + dims).to(tl.float32)
            if head < Hq:
                y = _norm_rope_row(x, xr, qw_ptr, cos, sin, dims, perm, EPS, HAS_NORM, HEAD_DIM, dt)
                tl.store(q_ptr + (head.to(tl.int64) * n + node) * HEAD_DIM + dims, y.to(dt))
            else:
                y = _norm_rope_row(x, xr, kw_ptr, cos, sin, dims, perm, EPS, HAS_NORM, HEAD_DIM, dt)
                if slot >= 0:
                    tl.store(k_ptr + (head - Hq).to(tl.int64) * stride_kh + slot * stride_ks + dims, y.to(dt))
        elif slot >= 0:
            tl.store(v_ptr + (head - Hq - Hkv).to(tl.int64) * stride_kh + slot * stride_ks + dims, x.to(dt))

    @triton.jit
    def silu_mul_kernel(gu_ptr, I, out_ptr, BLOCK: tl.constexpr):
        """Program (row, column block): out = silu(gate) * up, silu rounded first as the modules do."""
        r = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < I
        dt = out_ptr.dtype.element_ty
        g = tl.load(gu_ptr + r * 2 * I + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + r * 2 * I + I + cols, mask=ok, other=0.0).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
        tl.store(out_ptr + r * I + cols, (act * u).to(dt), mask=ok)


def _need_triton():
    if triton is None:
        raise RuntimeError("the layer kernels need triton: pip install triton")


def _row_options(width: int) -> dict:
    """Launch options. FP contraction off: the kernels round where the modules do, and with it on the
    compiler turns a 16-bit product followed by a sum into one fused multiply-add, skipping the
    product's rounding (seen in the sm_90 PTX of qk_norm_rope: fma.rn.f16 for RoPE's two products and
    their sum; on an H200 21% of q's elements then differed from the modules' by 1-3 rounding steps).
    These kernels move bytes, so the unfused instructions should cost little; not timed on a GPU."""
    return {"num_warps": 1 if width <= 256 else 4 if width <= 2048 else 8, "enable_fp_fusion": False}


def add_rms_norm_triton(x, delta, weight, eps: float):
    _need_triton()
    n, H = x.shape
    x = x.contiguous()
    h = torch.empty_like(x)
    s = torch.empty_like(x) if delta is not None else x
    d = delta.contiguous() if delta is not None else x
    add_rms_norm_kernel[(n,)](x, d, weight, H, s, h, EPS=eps, HAS_DELTA=delta is not None, BLOCK_H=_pow2(H),
                              **_row_options(H))
    return s, h


def qk_norm_rope_triton(qkv, q_weight, k_weight, eps: float, cos, sin, k_cache, v_cache, slots, num_heads: int):
    _need_triton()
    n, D = qkv.shape[0], k_cache.shape[-1]
    Hkv = k_cache.shape[0]
    if k_cache.stride(2) != 1 or v_cache.stride() != k_cache.stride() or D != _pow2(D):
        raise ValueError("qk_norm_rope: K/V rows must be contiguous with equal strides and a power-of-two head dim")
    q = torch.empty(num_heads, n, D, device=qkv.device, dtype=qkv.dtype)
    has_norm = q_weight is not None
    qkv_norm_w = (q_weight, k_weight) if has_norm else (cos, cos)  # unread placeholders without a norm
    qk_norm_rope_kernel[(n, num_heads + 2 * Hkv)](
        qkv.contiguous(), *qkv_norm_w, cos.contiguous(), sin.contiguous(), slots.contiguous(), num_heads, Hkv,
        k_cache.stride(0), k_cache.stride(1), q, k_cache, v_cache, EPS=eps, HAS_NORM=has_norm, HEAD_DIM=D,
        **_row_options(D))
    return q


def silu_mul_triton(gate_up):
    _need_triton()
    n, I2 = gate_up.shape
    I = I2 // 2
    out = torch.empty(n, I, device=gate_up.device, dtype=gate_up.dtype)
    block = min(1024, _pow2(I))
    silu_mul_kernel[(n, triton.cdiv(I, block))](gate_up.contiguous(), I, out, BLOCK=block, **_row_options(block))
    return out
