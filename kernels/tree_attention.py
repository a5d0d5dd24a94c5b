"""Attention over a preallocated KV cache plus a tree of new nodes, with the plain-PyTorch
reference beside the Triton kernel.

The caller has already written the K/V of the n new nodes into slots P..P+n-1 of the
cache (P = ``past_len``, a device tensor, so nothing here needs the host). Query row r
(node r) sees

    slot j < P               always (the committed prefix)
    slot P + i, 0 <= i < n    when tree_mask[r, i] (ancestor-or-self; causal for prefill,
                              all-true for the drafter's block)
    slot >= P + n             never (stale entries of earlier rounds)

Shapes: q [Hq, n, D]; k_cache, v_cache [Hkv, S, D] (one layer of the runtime's
[L, 2, Hkv, S, D] caches, a view); past_len 0-d or [1] int64; tree_mask [n, n] bool;
output [n, Hq * D] (heads side by side, ready for o_proj).

Batched (slots of a serving batch, each with its own cache and length): q [M, Hq, n, D];
k_cache, v_cache [M, Hkv, S, D] (any strides but a contiguous head dim: views of a cache whose
slot ranges share one sequence axis are fine); past_len [M]; tree_mask [M, n, n]; output
[M, n, Hq * D]. Slot m reads only its own cache, up to its own P_m + n. With slot_ids [M] the
caches may hold more ranges ([T, Hkv, S, D], T >= M) and row m reads range slot_ids[m], in place
(a prefill of some slots): no range is copied.

Head dims: the kernel's tl.dot needs a power of two of at least 16 (Triton's NVIDIA backend);
``kernel_fits`` says so, and the dispatcher (treeflash_kernels.ops) sends other shapes to the
reference.

The kernel reads the cache only up to P + n, whatever S is, and maps grouped-query
heads onto their shared K/V head (the G = Hq / Hkv query heads of a group are rows of
one tile, so each K/V tile is loaded once per group, never repeated in memory). The
key range is split across programs (flash-decoding) so that a single query still
spreads over the GPU; a second small kernel merges the splits by their log-sum-exp.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .mlp_expand import _pow2


# The kernel's smallest head dim: tl.dot on NVIDIA GPUs needs every dimension >= 16.
MIN_HEAD_DIM = 16


def kernel_fits(head_dim: int) -> bool:
    """Whether the Triton kernel takes this head dim (a power of two, at least MIN_HEAD_DIM)."""
    return head_dim >= MIN_HEAD_DIM and head_dim == _pow2(head_dim)


def _check(q, k_cache, v_cache, tree_mask, slot_ids=None):
    """The shapes of one call, single ([Hq, n, D]) or batched ([M, Hq, n, D]) alike."""
    lead = q.shape[:-3]
    Hq, n, D = q.shape[-3:]
    Hkv, S, Dk = k_cache.shape[-3:]
    ranges = k_cache.shape[:-3] if slot_ids is None else lead
    if slot_ids is not None and (q.dim() != 4 or k_cache.dim() != 4 or slot_ids.shape != lead):
        raise ValueError(f"tree_attention: slot_ids {tuple(slot_ids.shape)} need batched q {tuple(q.shape)} "
                         f"and caches [T, Hkv, S, D], one id per row")
    if (Dk != D or v_cache.shape != k_cache.shape or Hq % Hkv or ranges != lead
            or q.dim() not in (3, 4)):
        raise ValueError(f"tree_attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} (heads must be a multiple of the K/V heads, head dims and "
                         f"slots equal)")
    if tree_mask.shape != (*lead, n, n):
        raise ValueError(f"tree_attention: tree_mask must be {[*lead, n, n]}, got {list(tree_mask.shape)}")


def visible_keys(past_len: torch.Tensor, tree_mask: torch.Tensor, bound: int) -> torch.Tensor:
    """[n, bound] bool (batched: past_len [M], tree_mask [M, n, n] -> [M, n, bound]): which of
    cache slots 0..bound-1 each of the n new nodes sees."""
    if tree_mask.dim() == 2:
        return visible_keys(past_len.reshape(1), tree_mask[None], bound)[0]
    M, n = tree_mask.shape[:2]
    cols = torch.arange(bound, device=tree_mask.device)
    rel = cols[None, :] - past_len.reshape(M, 1)  # [M, bound]
    in_tree = (rel >= 0) & (rel < n)
    tree_cols = torch.gather(tree_mask, 2, rel.clamp(0, n - 1)[:, None, :].expand(M, n, bound))
    return (rel < 0)[:, None, :] | (tree_cols & in_tree[:, None, :])


def tree_attention_reference(q, k_cache, v_cache, past_len, tree_mask, key_bound: int = 0,
                             slot_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The definition, in plain PyTorch (SDPA with a boolean mask, grouped-query heads native).

    key_bound: a static upper bound on every P + n known to the caller (0 = the capacity S); slots
    past it are not even looked at. It changes the cost, and the rounding only: the keys seen are the same.
    slot_ids: the rows' cache ranges (batched only); only their first key_bound slots are gathered."""
    _check(q, k_cache, v_cache, tree_mask, slot_ids)
    if q.dim() == 3:
        return tree_attention_reference(q[None], k_cache[None], v_cache[None], past_len.reshape(1), tree_mask[None],
                                        key_bound)[0]
    bound = key_bound or k_cache.shape[2]
    k, v = k_cache[:, :, :bound], v_cache[:, :, :bound]
    if slot_ids is not None:
        k, v = k[slot_ids], v[slot_ids]
    mask = visible_keys(past_len, tree_mask, bound)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    return out.transpose(1, 2).flatten(2)


try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still works; the kernel needs `pip install triton`
    triton = None

if triton is not None:

    @triton.jit
    def tree_attention_kernel(q_ptr, k_ptr, v_ptr, len_ptr, mask_ptr, sid_ptr, o_ptr, m_ptr, l_ptr,
                              n, G, Hkv, stride_km, stride_kh, stride_ks,
                              SM_SCALE: tl.constexpr, PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """One program: BLOCK_M rows of one slot's K/V head group (row = head-in-group * n + node)
        over one split of that slot's keys. Writes the split's unnormalised output and its running
        max / sum (float32) for the merge step. q is [M, Hq, n, D] contiguous; K/V rows are
        HEAD_DIM contiguous; program_id(1) = slot * Hkv + K/V head; slot reads cache range sid[slot]."""
        pair = tl.program_id(1)
        slot = pair // Hkv
        kvh = pair % Hkv
        split = tl.program_id(2)
        num_pairs = tl.num_programs(1)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < G * n
        head = pair * G + rows // n  # slot * Hq + the head within the slot
        node = rows % n
        dims = tl.arange(0, HEAD_DIM)
        q_off = (head.to(tl.int64) * n + node)[:, None] * HEAD_DIM + dims[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)
        mask_ptr += slot.to(tl.int64) * n * n

        past = tl.load(len_ptr + slot)
        total = past + n
        # The keys 0..P+n-1 are shared out among the launch's splits from the length on the device
        # (whole BLOCK_N tiles each): every split has work at any P, and the launch stays static.
        split_len = tl.cdiv(tl.cdiv(total, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        start = split * split_len
        stop = tl.minimum(start + split_len, total)
        cache_range = tl.load(sid_ptr + slot).to(tl.int64)
        k_base = k_ptr + cache_range * stride_km + kvh.to(tl.int64) * stride_kh
        v_base = v_ptr + cache_range * stride_km + kvh.to(tl.int64) * stride_kh

        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        for s0 in range(start, stop, BLOCK_N):
            cols = s0 + tl.arange(0, BLOCK_N)
            col_ok = cols < stop
            kv_off = cols.to(tl.int64)[:, None] * stride_ks + dims[None, :]
            k = tl.load(k_base + kv_off, mask=col_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * SM_SCALE
            rel = cols - past
            in_tree = (rel >= 0) & col_ok
            tree_ok = tl.load(mask_ptr + node[:, None] * n + rel[None, :],
                              mask=row_ok[:, None] & in_tree[None, :], other=0)
            seen = ((rel < 0) & col_ok)[None, :] | (tree_ok != 0)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            v = tl.load(v_base + kv_off, mask=col_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new

        part = (split * num_pairs + pair).to(tl.int64) * G * n + rows  # [splits, M * Hkv, G * n] row index
        tl.store(o_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(l_ptr + part, l_i, mask=row_ok)

    @triton.jit
    def merge_splits_kernel(o_ptr, m_ptr, l_ptr, out_ptr, n, G, Hq, rows_per_split, SPLITS: tl.constexpr,
                            HEAD_DIM: tl.constexpr):
        """One program per (slot, head, node) row: the splits' partial outputs weighted by
        exp(m - max), normalised, cast, and stored at out[slot, node, head * D:] ([M, n, Hq * D])."""
        r = tl.program_id(0)  # = (slot * Hkv + kvh) * G * n + g * n + node = (slot * Hq + head) * n + node
        dims = tl.arange(0, HEAD_DIM)
        top = tl.load(m_ptr + r)
        for t in range(1, SPLITS):
            top = tl.maximum(top, tl.load(m_ptr + t * rows_per_split + r))
        num = tl.zeros((HEAD_DIM,), tl.float32)
        den = top * 0.0
        for t in range(SPLITS):
            row = (t * rows_per_split + r).to(tl.int64)
            w = tl.exp(tl.load(m_ptr + row) - top)  # 0 for a split that saw no key (max -inf)
            num += w * tl.load(o_ptr + row * HEAD_DIM + dims)
            den += w * tl.load(l_ptr + row)
        slot_head = r // n
        slot = slot_head // Hq
        head = slot_head % Hq
        node = r % n
        dst = out_ptr + ((slot.to(tl.int64) * n + node) * Hq + head) * HEAD_DIM + dims
        tl.store(dst, tl.math.div_rn(num, den).to(out_ptr.dtype.element_ty))  # correctly rounded, as PyTorch's


def launch_plan(n: int, heads: int, kv_heads: int, capacity: int, head_dim: int, *, splits: int = 0,
                target_programs: int = 264, slots: int = 1) -> dict:
    """Static launch parameters for one (n, heads, capacity) shape: they never depend on P, so a
    captured CUDA graph replays the same launch for any cache length. splits = 0 picks enough key
    splits for about target_programs programs (two per SM on an H100). The kernel divides the
    current P + n keys among them (whole BLOCK_N tiles), so all are busy once P + n reaches
    splits x BLOCK_N; split_len is the most one split can get (at P + n = capacity)."""
    G = heads // kv_heads
    block_m = min(max(16, _pow2(G * n)), 64)
    block_n = 64 if head_dim <= 64 else 32
    row_blocks = -(-(G * n) // block_m)
    max_splits = max(1, -(-capacity // block_n))
    if splits <= 0:
        splits = -(-target_programs // (row_blocks * kv_heads * slots))
    splits = max(1, min(splits, max_splits))
    split_len = -(-(-(-capacity // splits)) // block_n) * block_n  # a multiple of BLOCK_N covering S
    return dict(G=G, block_m=block_m, block_n=block_n, row_blocks=row_blocks, splits=splits, split_len=split_len)


def split_partials(q, k_cache, v_cache, past_len, tree_mask, *, splits: int = 0, slot_ids=None):
    """The first kernel alone, on batched shapes (see the module's docstring): per key split, the
    unnormalised output o [T, M * Hkv, G * n, D], the running max m and sum l [T, M * Hkv, G * n]
    (float32; m = -inf in a split that saw no key), and the plan."""
    if triton is None:
        raise RuntimeError("the tree-attention kernel needs triton: pip install triton")
    _check(q, k_cache, v_cache, tree_mask, slot_ids)
    M, Hq, n, D = q.shape
    _, Hkv, S, _ = k_cache.shape
    if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride() or not kernel_fits(D):
        raise ValueError(f"tree_attention kernel: K/V rows must be contiguous with equal strides and the head dim a "
                         f"power of two >= {MIN_HEAD_DIM} (got {D}); use the reference")
    if slot_ids is None:
        slot_ids = torch.arange(M, device=q.device)
    plan = launch_plan(n, Hq, Hkv, S, D, splits=splits, slots=M)
    G, T = plan["G"], plan["splits"]
    o = torch.empty(T, M * Hkv, G * n, D, device=q.device, dtype=torch.float32)
    m = torch.empty(T, M * Hkv, G * n, device=q.device, dtype=torch.float32)
    l_sum = torch.empty_like(m)
    grid = (plan["row_blocks"], M * Hkv, T)
    tree_attention_kernel[grid](
        q.contiguous(), k_cache, v_cache, past_len.reshape(M), tree_mask.contiguous(), slot_ids, o, m, l_sum,
        n, G, Hkv, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        SM_SCALE=1.0 / math.sqrt(D), PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HEAD_DIM=D,
        BLOCK_M=plan["block_m"], BLOCK_N=plan["block_n"], num_warps=4, num_stages=2,
    )
    return o, m, l_sum, plan


def tree_attention_triton(q, k_cache, v_cache, past_len, tree_mask, *, splits: int = 0,
                          slot_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel, then the log-sum-exp merge of its key splits (fixed shapes: graph-capturable);
    single or batched shapes (see the module's docstring)."""
    if q.dim() == 3:
        return tree_attention_triton(q[None], k_cache[None], v_cache[None], past_len.reshape(1), tree_mask[None],
                                     splits=splits)[0]
    o, m, l_sum, plan = split_partials(q, k_cache, v_cache, past_len, tree_mask, splits=splits, slot_ids=slot_ids)
    M, Hq, n, D = q.shape
    G, T, Hkv = plan["G"], plan["splits"], k_cache.shape[1]
    # Every row sees at least itself, so some split has a finite max and the merge is well defined.
    out = torch.empty(M, n, Hq * D, device=q.device, dtype=q.dtype)
    merge_splits_kernel[(M * Hq * n,)](o, m, l_sum, out, n, G, Hq, M * Hkv * G * n, SPLITS=T, HEAD_DIM=D,
                                       num_warps=1)
    return out
