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

from .common import apply_rope, attend, attend_slots, write_kv
from .fused import FusedLayer, norm_args


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
        self.fused: list[FusedLayer] | None = None  # set by use_layer_kernels (the runtime's fast path)

    def use_layer_kernels(self, on: bool = True) -> None:
        """forward_cached runs the layers through merged projections and the layer kernels
        (models.fused), or (off) through the modules. The modules' weights become views of the
        merged ones (no extra memory)."""
        self.fused = [FusedLayer(layer, self.num_heads) for layer in self.layers] if on else None

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
        cache: torch.Tensor,  # [L, 2, Hkv, S, D], read only
        past_len,  # int (eager: the cache is sliced) or 0-d int64 tensor (traced: slots >= P masked)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns logits [n, V], tapped hidden states [n, T*H] and the new K/V [L, 2, Hkv, n, D].

        Keys are [cache slots 0..P-1 ; the n new tokens under tree_mask]. The caller writes the
        new K/V into slots P..P+n-1 (and later compacts the accepted ones), so the graph never
        scatters into the cache.
        """
        n = _check_inputs(tokens, positions, tree_mask)
        if isinstance(past_len, int):
            prefix = cache[:, :, :, :past_len]
            prefix_mask = torch.ones(n, past_len, dtype=torch.bool, device=tokens.device)
        else:
            prefix = cache
            cols = torch.arange(cache.shape[3], device=tokens.device)
            prefix_mask = (cols < past_len)[None, :].expand(n, -1)
        mask = torch.cat([prefix_mask, tree_mask], dim=1)  # [n, P or S + n]
        new_kv = []

        def attention(i, q, k, v):
            new_kv.append(torch.stack([k, v]))
            return attend(q, torch.cat([prefix[i][0], k], dim=1), torch.cat([prefix[i][1], v], dim=1), mask)

        logits, feats = self._layers(tokens, positions, attention)
        return logits, feats, torch.stack(new_kv)

    def forward_cached(
        self,
        tokens: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        tree_mask: torch.Tensor,  # [n, n] bool
        cache: torch.Tensor,  # [L, 2, Hkv, S, D], written in place: slots past_len..past_len+n-1
        past_len: torch.Tensor,  # 0-d int64 on the cache's device: slots < past_len are the prefix
        *,
        key_bound: int = 0,  # a static bound on past_len + n for the CPU reference (0 = S)
        logit_rows: torch.Tensor | None = None,  # [r] rows whose logits are wanted (None = all n)
        slot_ids: torch.Tensor | None = None,  # batched only: [M] the cache ranges the rows use (None = 0..M-1)
        slot_size: int = 0,  # batched only, with slot_ids: cache slots per range
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The runtime's form: new K/V go straight into the cache (node i at slot past_len + i) and
        attention reads the cache in place, up to past_len + n, heads grouped natively. No host
        value is read, so the call can be captured in a CUDA graph. Returns logits [n or r, V] and
        taps [n, T*H].

        Batched (the slots of a serving batch, one pass for all): tokens and positions [M, n],
        tree_mask [M, n, n], past_len [M], logit_rows [M, r], and the cache [L, 2, Hkv, M * S, D]:
        slot m's S cache slots lie at m * S.. on the sequence axis, so writes keep the single
        form's slot indices (offset by m * S) and each slot attends to its own range up to its own
        length. Returns logits [M, n or r, V] and taps [M, n, T*H]. With slot_ids the rows use cache
        ranges slot_ids[m] of a cache of several more (each slot_size long), as a prefill of some slots
        does."""
        from treeflash_kernels.ops import tree_attention

        if tokens.dim() == 2:
            return self._slots_cached(tokens, positions, tree_mask, cache, past_len, key_bound, logit_rows, slot_ids,
                                      slot_size)
        slots = past_len + torch.arange(_check_inputs(tokens, positions, tree_mask), device=tokens.device)

        def attend(i, q):
            return tree_attention(q, cache[i, 0], cache[i, 1], past_len, tree_mask, key_bound)

        return self._cached_layers(tokens, positions, cache, slots, attend, logit_rows)

    def _slots_cached(self, tokens, positions, tree_mask, cache, past_len, key_bound, logit_rows, slot_ids=None,
                      slot_size=0):
        """forward_cached over M slots: one flat pass of M * n rows; only the cache writes (slot
        offsets) and attention (per slot) see the slot axis."""
        M, n = tokens.shape
        _check_inputs(tokens[0], positions[0], tree_mask[0])
        S = slot_size or cache.shape[3] // M
        ids = torch.arange(M, device=tokens.device)
        ranges = ids if slot_ids is None else slot_ids
        slots = ((ranges * S + past_len)[:, None] + torch.arange(n, device=tokens.device)).flatten()

        def attend(i, q):
            return attend_slots(q, cache[i], past_len, tree_mask, M, S, key_bound, slot_ids)

        rows = None if logit_rows is None else (ids[:, None] * n + logit_rows).flatten()
        logits, taps = self._cached_layers(tokens.flatten(), positions.flatten(), cache, slots, attend, rows)
        return logits.unflatten(0, (M, -1)), taps.unflatten(0, (M, n))

    def _cached_layers(self, tokens, positions, cache, slots, attend, logit_rows):
        """The layers of forward_cached: K/V written at slots [n], attend(i, q [Hq, n, D]) -> [n, Hq*D]."""
        if self.fused is not None:
            return self._fused_layers(tokens, positions, cache, slots, attend, logit_rows)

        def attention(i, q, k, v):
            write_kv(cache[i], slots, k, v)
            return attend(i, q)

        return self._layers(tokens, positions, attention, logit_rows)

    def _layers(self, tokens, positions, attention, logit_rows=None):
        """The decoder stack; attention(i, q, k, v) -> [n, Hq*D] is the only part that differs
        between the exported form and the runtime's in-place form."""
        x = self.embed_tokens(tokens)[None]  # [1, n, H]
        cos, sin = self.rotary_emb(x, positions[None])
        cos, sin = cos[0], sin[0]  # [n, D]
        taps = {}
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(x)[0], cos, sin)
            x = x + attn.o_proj(attention(i, q, k, v))[None]
            mlp_out = layer.mlp(layer.post_attention_layernorm(x))
            if isinstance(mlp_out, tuple):  # some MoE blocks also return router logits
                mlp_out = mlp_out[0]
            x = x + mlp_out
            if i in self.tap_layer_ids:
                taps[i] = x[0]
        rows = x[0] if logit_rows is None else x[0, logit_rows]
        return self._with_taps(self.lm_head(self.norm(rows)), taps, x[0])

    def _with_taps(self, logits, taps, x):
        """(logits, the tapped layers' outputs side by side [n, T*H]; [n, 0] for plain decoding)."""
        if not self.tap_layer_ids:  # plain decoding: no drafter to feed
            return logits, x.new_zeros(x.shape[0], 0)
        return logits, torch.cat([taps[i] for i in self.tap_layer_ids], dim=-1)

    def _fused_layers(self, tokens, positions, cache, slots, attend, logit_rows):
        """forward_cached's layers with the kernels: per layer one add+norm before attention (the
        previous layer's closing add), q/k/v in one GEMM then one kernel (norms, RoPE, cache
        write), attention, o_proj, add+norm, gate/up in one GEMM, SwiGLU, down."""
        from treeflash_kernels.ops import add_rms_norm

        x = self.embed_tokens(tokens)  # [n, H]
        cos, sin = self.rotary_emb(x[None], positions[None])
        cos, sin = cos[0], sin[0]
        norms = [layer.input_layernorm for layer in self.layers] + [self.norm]
        x, h = add_rms_norm(x, None, *norm_args(norms[0]))
        taps = {}
        for i, fl in enumerate(self.fused):
            q = fl.qkv(h, cos, sin, cache[i, 0], cache[i, 1], slots)
            out = attend(i, q)
            x, h = add_rms_norm(x, fl.attn.o_proj(out), *fl.post_norm)
            x, h = add_rms_norm(x, fl.mlp(h), *norm_args(norms[i + 1]))  # the next layer's norm, or the final one
            if i in self.tap_layer_ids:
                taps[i] = x
        return self._with_taps(self.lm_head(h if logit_rows is None else h[logit_rows]), taps, x)

    def _qkv(self, attn, h, cos, sin):
        """h [n, H] -> q [Hq, n, D], k, v [Hkv, n, D], RoPE applied."""
        n = h.shape[0]
        q = attn.q_proj(h).view(n, -1, self.head_dim)
        k = attn.k_proj(h).view(n, -1, self.head_dim)
        v = attn.v_proj(h).view(n, -1, self.head_dim)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3 normalises per head before RoPE
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        return apply_rope(q.transpose(0, 1), cos, sin), apply_rope(k.transpose(0, 1), cos, sin), v.transpose(0, 1)


def _check_inputs(tokens, positions, tree_mask) -> int:
    n = tokens.shape[0]
    if tree_mask.shape != (n, n) or positions.shape != (n,):
        raise ValueError(f"verifier: tokens {tuple(tokens.shape)}, positions {tuple(positions.shape)} "
                         f"and tree_mask {tuple(tree_mask.shape)} disagree")
    return n
