"""Small pieces shared by the verifier wrapper and the drafter: RoPE, attention, cache writes."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [heads, n, d]; cos/sin: [n, d] (the Hugging Face rotate-half convention)."""
    return x * cos + rotate_half(x) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention with a boolean mask (True = attend).

    q: [*, hq, n, d]; k, v: [*, hkv, s, d]; mask: [n, s] -> [*, n, hq * d], with * empty (the
    runtime's graphs) or one batch dimension (training, where the mask may be [b, n, s]: one
    per row, for left-padded prompts).
    Every query row must see at least one key (each sees itself in all our uses).
    """
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    if q.dim() == 3:  # 4-D (batch 1) because that is the form the ONNX exporter translates
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask[None, None])[0]
    else:
        mask = mask[:, None] if mask.dim() == 3 else mask[None, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(-3, -2).flatten(-2)


def write_kv(layer_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """layer_cache [2, Hkv, S, D] (a view into the runtime's cache); k, v [Hkv, n, D] go to slots [n]
    (a device tensor, so the write can be captured in a CUDA graph)."""
    layer_cache[0].index_copy_(1, slots, k)
    layer_cache[1].index_copy_(1, slots, v)


def attend_slots(q: torch.Tensor, layer_cache: torch.Tensor, past_len: torch.Tensor, tree_mask: torch.Tensor,
                 slots: int, slot_size: int, key_bound: int = 0, slot_ids: torch.Tensor | None = None) -> torch.Tensor:
    """q [Hq, M * n, D], the rows of M = ``slots`` request slots -> [M * n, Hq * D]: each slot's rows
    attend to its own range of layer_cache [2, Hkv, T * slot_size, D] (slot m's at m * slot_size, or
    slot_ids[m]'s, read in place) up to its own past_len plus its n rows under tree_mask [M, n, n]."""
    from treeflash_kernels.ops import tree_attention

    k, v = (layer_cache[j].unflatten(1, (-1, slot_size)).transpose(0, 1) for j in (0, 1))  # [T, Hkv, S, D] views
    if slot_ids is None:
        k, v = k[:slots], v[:slots]
    q = q.reshape(q.shape[0], slots, -1, q.shape[-1]).transpose(0, 1)
    return tree_attention(q, k, v, past_len, tree_mask, key_bound, slot_ids).flatten(0, 1)
