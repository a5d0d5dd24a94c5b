"""The verifier (target LLM) as a traceable function of explicit tensors.

It reuses the Hugging Face model's own submodules (embeddings, projections,
norms, MLP or MoE block, rotary embedding, LM head) and only replaces the
attention plumbing, so that the KV cache is one preallocated tensor and the
tree mask is an input. One forward serves prefill (a causal "tree" that is a
chain), tree verification and plain decoding (a one-node tree).
"""

from __future__ import annotations

import torch
from torch import nn

from .common import apply_rope, attend, write_slots


class TreeVerifier(nn.Module):
    """Wraps a Hugging Face causal LM of the Llama / Qwen2 / Qwen3 families.

    Cache layout: [num_layers, 2 (k, v), num_kv_heads, capacity S, head_dim].
    """

    def __init__(self, hf_model: nn.Module, tap_layer_ids: tuple[int, ...] | list[int]):
        super().__init__()
        cfg = hf_model.config
        self.config = cfg
        backbone = hf_model.model
        self.embed_tokens = backbone.embed_tokens
        self.layers = backbone.layers
        self.norm = backbone.norm
        self.rotary_emb = backbone.rotary_emb
        self.lm_head = hf_model.lm_head
        self.tap_layer_ids = tuple(int(i) for i in tap_layer_ids)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(self.lm_head.weight.shape[0])

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def new_cache(self, capacity: int, *, device=None, dtype=None) -> torch.Tensor:
        w = self.lm_head.weight
        return torch.zeros(
            self.num_layers, 2, self.num_kv_heads, capacity, self.head_dim,
            device=device or w.device, dtype=dtype or w.dtype,
        )

    def forward(
        self,
        tokens: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64, absolute positions
        tree_mask: torch.Tensor,  # [n, n] bool, ancestor-or-self (a causal mask for prefill)
        cache: torch.Tensor,  # [L, 2, Hkv, S, D], updated in place at slots past_len..past_len+n-1
        past_len,  # int or 0-d int64 tensor: committed length P
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns logits [n, V] and the tapped hidden states [n, T*H]."""
        n = tokens.shape[0]
        if tree_mask.shape != (n, n) or positions.shape != (n,):
            raise ValueError(f"verifier: tokens {tuple(tokens.shape)}, positions {tuple(positions.shape)} "
                             f"and tree_mask {tuple(tree_mask.shape)} disagree")
        # Keys visible to this call: the committed prefix plus the n new slots.
        key_len = past_len + n if isinstance(past_len, int) else cache.shape[3]
        cols = torch.arange(key_len, device=tokens.device)
        rel = cols - past_len
        in_tree = (rel >= 0) & (rel < n)
        tree_part = tree_mask[:, rel.clamp(0, n - 1)] & in_tree[None, :]
        mask = (cols < past_len)[None, :] | tree_part  # [n, key_len]

        x = self.embed_tokens(tokens)[None]  # [1, n, H]
        cos, sin = self.rotary_emb(x, positions[None])
        cos, sin = cos[0], sin[0]  # [n, D]
        taps = {}
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            x = x + self._attention(layer.self_attn, h[0], cos, sin, cache[i], past_len, mask, key_len)[None]
            mlp_out = layer.mlp(layer.post_attention_layernorm(x))
            if isinstance(mlp_out, tuple):  # some MoE blocks also return router logits
                mlp_out = mlp_out[0]
            x = x + mlp_out
            if i in self.tap_layer_ids:
                taps[i] = x[0]
        logits = self.lm_head(self.norm(x))[0]
        if not self.tap_layer_ids:  # plain decoding: no drafter to feed
            return logits, x.new_zeros(n, 0)
        features = torch.cat([taps[i] for i in self.tap_layer_ids], dim=-1)
        return logits, features

    def _attention(self, attn, h, cos, sin, layer_cache, past_len, mask, key_len):
        n = h.shape[0]
        q = attn.q_proj(h).view(n, -1, self.head_dim)
        k = attn.k_proj(h).view(n, -1, self.head_dim)
        v = attn.v_proj(h).view(n, -1, self.head_dim)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3 normalises per head before RoPE
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        q = apply_rope(q.transpose(0, 1), cos, sin)
        k = apply_rope(k.transpose(0, 1), cos, sin)
        write_slots(layer_cache[0], past_len, k)
        write_slots(layer_cache[1], past_len, v.transpose(0, 1))
        out = attend(q, layer_cache[0, :, :key_len], layer_cache[1, :, :key_len], mask)
        return attn.o_proj(out)
