"""Decoder layers on the runtime's fast path: merged projections and the layer kernels.

``FusedLayer`` wraps one Hugging Face-style decoder layer (``self_attn`` with q/k/v/o
projections and optional per-head ``q_norm`` / ``k_norm``, ``mlp`` with gate/up/down
projections, ``input_layernorm``, ``post_attention_layernorm``); the verifier's and the
drafter's layers both have that form. It merges q/k/v into one weight and gate/up into
another, so that a layer runs 5 GEMMs instead of 7, and it routes the elementwise work
between them through ``torch.ops.treeflash`` (``treeflash_kernels.layer_ops``: Triton on
CUDA, the PyTorch references elsewhere, so CPU runs the same code).

The merge keeps one copy of the weights: the modules' own parameters become views into the
merged tensors, so the modules compute exactly what they did and memory does not grow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def norm_args(norm: nn.Module) -> tuple[torch.Tensor, float]:
    """(weight, eps) of an RMSNorm module (Qwen3 / Llama / Qwen2 spell eps variance_epsilon)."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm.weight, float(eps if eps is not None else norm.eps)


def merge_linears(linears: list[nn.Linear], key: str, owner: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [sum of out-features, in] weight (and bias) whose row blocks the modules' parameters
    become views of. Kept on ``owner`` under ``key``, so merging twice reuses the first merge."""
    merged = getattr(owner, key, None)
    if merged is not None and merged[0].data_ptr() == linears[0].weight.data_ptr():
        return merged
    has_bias = [lin.bias is not None for lin in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("projections with and without bias cannot be merged")
    with torch.no_grad():
        weight = torch.cat([lin.weight for lin in linears])
        bias = torch.cat([lin.bias for lin in linears]) if all(has_bias) else None
        start = 0
        for lin in linears:
            rows = lin.weight.shape[0]
            lin.weight = nn.Parameter(weight[start : start + rows], requires_grad=lin.weight.requires_grad)
            if bias is not None:
                lin.bias = nn.Parameter(bias[start : start + rows], requires_grad=lin.bias.requires_grad)
            start += rows
    setattr(owner, key, (weight, bias))
    return weight, bias


def is_swiglu(mlp: nn.Module) -> bool:
    """A dense gate/up/down MLP with SiLU (not a mixture of experts)."""
    act = getattr(mlp, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
    return silu and all(isinstance(getattr(mlp, p, None), nn.Linear) for p in ("gate_proj", "up_proj", "down_proj"))


class FusedLayer:
    def __init__(self, layer: nn.Module, num_heads: int):
        attn = self.attn = layer.self_attn
        self.num_heads = num_heads
        self.qkv_weight, self.qkv_bias = merge_linears([attn.q_proj, attn.k_proj, attn.v_proj], "_treeflash_qkv", attn)
        self.q_norm = self.k_norm = None  # Llama / Qwen2: no per-head norm
        self.qk_eps = 0.0
        if getattr(attn, "q_norm", None) is not None:  # Qwen3
            (self.q_norm, self.qk_eps), (self.k_norm, k_eps) = norm_args(attn.q_norm), norm_args(attn.k_norm)
            if k_eps != self.qk_eps:
                raise ValueError("q_norm and k_norm with different eps are not supported by the layer kernels")
        self.mlp_module = layer.mlp
        self.swiglu = is_swiglu(layer.mlp)
        if self.swiglu:
            self.gate_up, _ = merge_linears([layer.mlp.gate_proj, layer.mlp.up_proj], "_treeflash_gate_up", layer.mlp)
        self.post_norm = norm_args(layer.post_attention_layernorm)

    def qkv(self, h, cos, sin, k_cache, v_cache, slots) -> torch.Tensor:
        """h [n, H] normed -> q [Hq, n, D] (normed, rotated); k, v written to the caches [Hkv, S, D]
        at slots [n] (negative: not written)."""
        from treeflash_kernels.ops import qk_norm_rope

        return qk_norm_rope(F.linear(h, self.qkv_weight, self.qkv_bias), self.q_norm, self.k_norm, self.qk_eps,
                            cos, sin, k_cache, v_cache, slots, self.num_heads)

    def mlp(self, h) -> torch.Tensor:
        """h [n, H] normed -> the MLP's output [n, H] (a mixture of experts runs as its module)."""
        if not self.swiglu:
            out = self.mlp_module(h[None])
            return (out[0] if isinstance(out, tuple) else out)[0]
        from treeflash_kernels.ops import silu_mul

        return self.mlp_module.down_proj(silu_mul(F.linear(h, self.gate_up)))
