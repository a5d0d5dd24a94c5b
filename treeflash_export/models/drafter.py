"""The DFlash drafter backbone (and the TreeFlash head beside it) with an explicit context cache.

Block queries attend, non-causally, to the context keys (verifier features of
committed tokens, fused by fc + hidden_norm) and to the block's own keys. Only
context K/V persist: the cache holds one slot per committed position.
Module and parameter names follow the released TreeFlash layout
(``model.layers.*``, ``model.fc``, ``model.hidden_norm``, ``model.norm``,
``ar_approximation.*``) so checkpoints load without renaming.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from ..config import DrafterConfig
from .common import apply_rope, attend, write_slots
from .head import ARApproximationHead


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.head_dim = D
        self.q_proj = nn.Linear(H, cfg.num_heads * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * D, H, bias=cfg.attention_bias)
        self.q_norm = Qwen3RMSNorm(D, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(D, eps=cfg.rms_norm_eps)

    def _kv(self, x, cos, sin):
        n = x.shape[0]
        k = apply_rope(self.k_norm(self.k_proj(x).view(n, -1, self.head_dim)).transpose(0, 1), cos, sin)
        v = self.v_proj(x).view(n, -1, self.head_dim).transpose(0, 1)
        return k, v

    def forward(self, h, ctx, ctx_rope, blk_rope, layer_cache, ctx_start, key_len, key_mask):
        """h: [B, H] normed block states; ctx: [c, H] fused context; layer_cache: [2, Hkv, S, D]."""
        B = h.shape[0]
        k_ctx, v_ctx = self._kv(ctx, *ctx_rope)
        write_slots(layer_cache[0], ctx_start, k_ctx)
        write_slots(layer_cache[1], ctx_start, v_ctx)
        q = apply_rope(self.q_norm(self.q_proj(h).view(B, -1, self.head_dim)).transpose(0, 1), *blk_rope)
        k_blk, v_blk = self._kv(h, *blk_rope)
        k = torch.cat([layer_cache[0, :, :key_len], k_blk], dim=1)
        v = torch.cat([layer_cache[1, :, :key_len], v_blk], dim=1)
        return self.o_proj(attend(q, k, v, key_mask))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = Qwen3MLP(cfg.hf_config)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class DrafterBackbone(nn.Module):
    """Cache layout: [num_layers, 2 (k, v), num_kv_heads, capacity S, head_dim]."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = Qwen3RMSNorm(H, eps=cfg.rms_norm_eps)
        self.norm = Qwen3RMSNorm(H, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(cfg.hf_config)

    def new_cache(self, capacity: int, *, device=None, dtype=None) -> torch.Tensor:
        w = self.fc.weight
        c = self.cfg
        return torch.zeros(c.num_layers, 2, c.num_kv_heads, capacity, c.head_dim,
                           device=device or w.device, dtype=dtype or w.dtype)

    def _rope(self, x, positions):
        cos, sin = self.rotary_emb(x[None], positions[None])
        return cos[0], sin[0]

    def forward(
        self,
        ctx_features: torch.Tensor,  # [c, T*H] verifier taps of newly committed tokens
        ctx_positions: torch.Tensor,  # [c] their absolute positions
        block_embeds: torch.Tensor,  # [B, H] verifier embeddings of [root, MASK x (B-1)]
        block_positions: torch.Tensor,  # [B] = P .. P+B-1
        cache: torch.Tensor,  # [L, 2, Hkv, S, D]; context K/V written at ctx_start..ctx_start+c-1
        ctx_start,  # int or 0-d tensor: context slots already filled
    ) -> torch.Tensor:
        """Returns z [B, H], the residual stream after the last layer (pre-norm)."""
        c = ctx_features.shape[0]
        ctx = self.hidden_norm(self.fc(ctx_features))
        ctx_rope = self._rope(ctx, ctx_positions)
        blk_rope = self._rope(block_embeds, block_positions)
        if isinstance(ctx_start, int):
            key_len = ctx_start + c
            key_mask = torch.ones(block_embeds.shape[0], key_len + block_embeds.shape[0],
                                  dtype=torch.bool, device=block_embeds.device)
        else:  # static shapes: the whole cache, slots past the context masked out
            key_len = cache.shape[3]
            valid = torch.arange(key_len, device=block_embeds.device) < ctx_start + c
            ones = torch.ones(block_embeds.shape[0], dtype=torch.bool, device=block_embeds.device)
            key_mask = torch.cat([valid, ones])[None, :].expand(block_embeds.shape[0], -1)
        x = block_embeds
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            x = x + layer.self_attn(h, ctx, ctx_rope, blk_rope, cache[i], ctx_start, key_len, key_mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x


class TreeFlashDrafter(nn.Module):
    """Backbone under ``model.`` plus the optional head under ``ar_approximation.``."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.model = DrafterBackbone(cfg)
        self.ar_approximation = (
            ARApproximationHead(cfg.hidden_size, cfg.intermediate_size) if cfg.has_head else None
        )
