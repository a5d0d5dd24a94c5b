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
from .common import apply_rope, attend, attend_slots, write_kv
from .fused import FusedLayer, norm_args
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

    def _heads(self, x):
        """[*, n, heads * D] -> [*, heads, n, D]"""
        return x.unflatten(-1, (-1, self.head_dim)).transpose(-3, -2)

    def _q(self, h, cos, sin):
        return apply_rope(self._heads(self.q_norm(self.q_proj(h).unflatten(-1, (-1, self.head_dim))).flatten(-2)),
                          cos, sin)

    def _kv(self, x, cos, sin):
        k = apply_rope(self._heads(self.k_norm(self.k_proj(x).unflatten(-1, (-1, self.head_dim))).flatten(-2)),
                       cos, sin)
        return k, self._heads(self.v_proj(x))

    def forward(self, h, ctx, ctx_rope, blk_rope, prefix, key_mask):
        """h: [*, B, H] normed block states; ctx: [*, c, H] fused new context; prefix: [2, Hkv, P, D]
        cached context K/V, or None. Returns (output [*, B, H], the new context K/V [2, *, Hkv, c, D])."""
        k_ctx, v_ctx = self._kv(ctx, *ctx_rope)
        q = self._q(h, *blk_rope)
        k_blk, v_blk = self._kv(h, *blk_rope)
        keys, values = [k_ctx, k_blk], [v_ctx, v_blk]
        if prefix is not None:
            keys.insert(0, prefix[0])
            values.insert(0, prefix[1])
        k, v = torch.cat(keys, dim=-2), torch.cat(values, dim=-2)
        return self.o_proj(attend(q, k, v, key_mask)), torch.stack([k_ctx, v_ctx])


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
        self.fused: list[FusedLayer] | None = None  # set by use_layer_kernels (the runtime's fast path)

    def _apply(self, fn, recurse=True):
        """Under ``.to(dtype)``, ``.half()`` and the like, RoPE's inverse frequencies stay float32,
        as in the verifier and in drafters loaded by from_pretrained (which never casts them).
        Rounded to bfloat16 they turn the angle between tokens 512 apart by up to 0.6 rad more or
        less than in training, and by more than 0.1 rad in 21 of Qwen3's 64 frequencies at 8,192
        apart. Device moves still apply to them."""
        kept = {name: buf.float() for name, buf in self.rotary_emb.named_buffers(recurse=False) if not buf.is_meta}
        super()._apply(fn, recurse)
        for name, buf in kept.items():
            setattr(self.rotary_emb, name, buf.to(getattr(self.rotary_emb, name).device))
        return self

    def reset_rope(self) -> None:
        """Computes RoPE's inverse frequencies (float32, on the weights' device) afresh: they are
        buffers no checkpoint holds, so a drafter built on the meta device and then given its
        weights (checkpoints.load_drafter) needs them made here."""
        self.rotary_emb = Qwen3RotaryEmbedding(self.cfg.hf_config).to(self.fc.weight.device)

    def use_layer_kernels(self, on: bool = True) -> None:
        """forward_cached runs the layers through merged projections and the layer kernels
        (models.fused), or (off) through the modules, as the verifier's do."""
        self.fused = [FusedLayer(layer, self.cfg.num_heads) for layer in self.layers] if on else None

    def new_cache(self, capacity: int, *, device=None, dtype=None) -> torch.Tensor:
        w = self.fc.weight
        c = self.cfg
        return torch.zeros(c.num_layers, 2, c.num_kv_heads, capacity, c.head_dim,
                           device=device or w.device, dtype=dtype or w.dtype)

    def _rope(self, x, positions):
        cos, sin = self.rotary_emb(x, positions[None])
        return cos[0], sin[0]

    def forward(
        self,
        ctx_features: torch.Tensor,  # [*, c, T*H] verifier taps of newly committed tokens
        ctx_positions: torch.Tensor,  # [c] their absolute positions
        block_embeds: torch.Tensor,  # [*, B, H] verifier embeddings of [root, MASK x (B-1)]
        block_positions: torch.Tensor,  # [B] = P .. P+B-1
        cache: torch.Tensor | None,  # [L, 2, Hkv, S, D] context K/V of earlier tokens (read only), or
                                     # None when the context starts at 0 (training, with a batch dim *)
        ctx_start,  # int (eager: cache sliced) or 0-d tensor (traced: slots >= ctx_start masked)
        ctx_count=None,  # traced only: 0-d tensor, valid rows of ctx_features (the rest is padding)
        key_mask=None,  # training only (cache None): [B, c + B] bool, for several blocks in one call
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns z [B, H] (the residual stream after the last layer, pre-norm) and the new
        context K/V [L, 2, Hkv, c, D], which the caller writes to slots ctx_start..ctx_start+c-1."""
        c, B = ctx_features.shape[-2], block_embeds.shape[-2]
        dev = block_embeds.device
        ctx = self.hidden_norm(self.fc(ctx_features))
        ctx_rope = self._rope(ctx, ctx_positions)
        blk_rope = self._rope(block_embeds, block_positions)
        if cache is None:
            prefix = [None] * len(self.layers)
            if key_mask is None:
                key_mask = torch.ones(B, c + B, dtype=torch.bool, device=dev)
        elif isinstance(ctx_start, int):
            prefix = cache[:, :, :, :ctx_start]
            key_mask = torch.ones(B, ctx_start + c + B, dtype=torch.bool, device=dev)
        else:
            prefix = cache
            old = torch.arange(cache.shape[3], device=dev) < ctx_start
            new = torch.arange(c, device=dev) < ctx_count
            key_mask = torch.cat([old, new, torch.ones(B, dtype=torch.bool, device=dev)])[None].expand(B, -1)
        x = block_embeds
        new_kv = []
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            out, kv = layer.self_attn(h, ctx, ctx_rope, blk_rope, prefix[i], key_mask)
            new_kv.append(kv)
            x = x + out
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x, torch.stack(new_kv)

    def forward_cached(
        self,
        ctx_features: torch.Tensor,  # [C, T*H] verifier taps of committed tokens; rows >= ctx_count are padding
        ctx_start: torch.Tensor,  # 0-d int64: position (and cache slot) of the first row
        ctx_count: torch.Tensor,  # 0-d int64: valid rows
        block_embeds: torch.Tensor | None,  # [B, H] embeddings of [root, MASK x (B-1)], or None (ingest only)
        cache: torch.Tensor,  # [L, 2, Hkv, S, D], written in place
        key_bound: int = 0,  # a static bound on the keys for the CPU reference attention (0 = S)
        slot_ids: torch.Tensor | None = None,  # batched, ingest only: [M] the cache ranges (None = 0..M-1)
        slot_size: int = 0,  # with slot_ids: cache slots per range
    ) -> torch.Tensor | None:
        """The runtime's form (no host value read, so it can be captured in a CUDA graph).

        Context K/V of all C rows go to slots ctx_start.. (padding rows land past the committed
        length P = ctx_start + ctx_count, where nothing reads them). With a block, its K/V then
        go to slots P..P+B-1 (overwriting the padding; the next round's context overwrites them
        in turn) and the block attends to slots 0..P+B-1 in place: the committed context and the
        whole block, non-causally. Returns z [B, H] (pre-norm), or None without a block.

        Batched (the slots of a serving batch, one pass for all): ctx_features [M, C, T*H],
        ctx_start and ctx_count [M], block_embeds [M, B, H], and the cache [L, 2, Hkv, M * S, D]
        with slot m's range at m * S.. on the sequence axis; returns z [M, B, H]. The single form
        is the batch of one."""
        if ctx_features.dim() == 2:
            z = self.forward_cached(ctx_features[None], ctx_start.reshape(1), ctx_count.reshape(1),
                                    None if block_embeds is None else block_embeds[None], cache, key_bound)
            return None if z is None else z[0]
        M, C = ctx_features.shape[:2]
        dev = ctx_features.device
        if slot_ids is not None and block_embeds is not None:
            raise ValueError("drafter: slot_ids serve context ingestion (prefill) only")
        base = (torch.arange(M, device=dev) if slot_ids is None else slot_ids) * (slot_size or cache.shape[3] // M)
        rows = torch.arange(C, device=dev)
        ctx_pos = ctx_start[:, None] + rows  # [M, C]
        ctx_slots = (base[:, None] + ctx_pos).flatten()
        blk = None
        if block_embeds is not None:
            B = block_embeds.shape[1]
            past_len = ctx_start + ctx_count
            blk_pos = past_len[:, None] + torch.arange(B, device=dev)  # [M, B]
            see_block = torch.ones(M, B, B, dtype=torch.bool, device=dev)
            blk = (block_embeds.flatten(0, 1), blk_pos.flatten(), (base[:, None] + blk_pos).flatten(), past_len,
                   see_block)
        if self.fused is not None:
            ctx_write = torch.where(rows < ctx_count[:, None], base[:, None] + ctx_pos, -1).flatten()
            x = self._fused_cached(ctx_features.flatten(0, 1), ctx_pos.flatten(), ctx_write, blk, cache, M, key_bound)
        else:
            x = self._cached_layers(ctx_features.flatten(0, 1), ctx_pos.flatten(), ctx_slots, blk, cache, M,
                                    key_bound)
        return None if x is None else x.unflatten(0, (M, -1))

    def _cached_layers(self, ctx_features, ctx_pos, ctx_slots, blk, cache, M, key_bound):
        """forward_cached through the modules, rows flat over the slots."""
        ctx = self.hidden_norm(self.fc(ctx_features))
        ctx_rope = self._rope(ctx, ctx_pos)
        if blk is not None:
            x, blk_pos, blk_slots, past_len, see_block = blk
            blk_rope = self._rope(x, blk_pos)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            write_kv(cache[i], ctx_slots, *attn._kv(ctx, *ctx_rope))
            if blk is None:  # ingesting context only (the prompt)
                continue
            h = layer.input_layernorm(x)
            write_kv(cache[i], blk_slots, *attn._kv(h, *blk_rope))
            out = attend_slots(attn._q(h, *blk_rope), cache[i], past_len, see_block, M, cache.shape[3] // M, key_bound)
            x = x + attn.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return None if blk is None else x

    def _fused_cached(self, ctx_features, ctx_pos, ctx_write, blk, cache, M, key_bound):
        """forward_cached with the layer kernels, rows flat over the slots. Context rows and block
        rows share each layer's q/k/v GEMM and its norm-RoPE-write kernel (the context rows' q goes
        unused); padding rows get slot -1 (not written), so no two rows of one launch write the
        same slot."""
        from treeflash_kernels.ops import add_rms_norm

        _, ctx = add_rms_norm(self.fc(ctx_features), None, *norm_args(self.hidden_norm))
        if blk is None:  # ingesting context only (the prompt): k/v of the context rows
            cos, sin = self._rope(ctx, ctx_pos)
            for i, fl in enumerate(self.fused):
                fl.qkv(ctx, cos, sin, cache[i, 0], cache[i, 1], ctx_write)
            return None
        block_rows, blk_pos, blk_slots, past_len, see_block = blk
        C = ctx.shape[0]
        cos, sin = self._rope(ctx, torch.cat([ctx_pos, blk_pos]))
        write = torch.cat([ctx_write, blk_slots])
        norms = [layer.input_layernorm for layer in self.layers]
        x, h = add_rms_norm(block_rows, None, *norm_args(norms[0]))
        for i, fl in enumerate(self.fused):
            q = fl.qkv(torch.cat([ctx, h]), cos, sin, cache[i, 0], cache[i, 1], write)[:, C:]
            out = attend_slots(q, cache[i], past_len, see_block, M, cache.shape[3] // M, key_bound)
            x, h = add_rms_norm(x, fl.attn.o_proj(out), *fl.post_norm)
            mlp_out = fl.mlp(h)
            if i + 1 < len(norms):
                x, h = add_rms_norm(x, mlp_out, *norm_args(norms[i + 1]))
            else:
                x = x + mlp_out
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
        # The tokens it learnt to rank, most frequent first (a folder's draft-vocab.json), or None: see
        # models.draft_vocab. Not a weight: loading sets it.
        self.vocab_order: list[int] | None = None
