"""The kernels as PyTorch custom ops: ``torch.ops.treeflash.mlp_expand`` (the MLP expansion),
``torch.ops.treeflash.tree_attention`` (attention over the KV cache plus a tree) and the layer
ops ``add_rms_norm``, ``qk_norm_rope`` and ``silu_mul`` (treeflash_kernels.layer_ops), and
``topk_logprobs`` (the expansion's last step, treeflash_kernels.topk_logprobs).

On CUDA (with triton installed), or on CPU tensors inside mlp_expand.interpreted_on_cpu(), it runs
the Triton kernels; elsewhere the plain
PyTorch reference. Its fake (meta) implementation gives shapes to tracing, so the
ONNX exporter sees one node, which treeflash_plugins translates into a single
``treeflash.MlpExpand`` node (the ``plugin`` graph variant).
"""

from __future__ import annotations

import torch

from . import layer_ops as lo
from . import topk_logprobs as tk
from . import tree_attention as ta
from .mlp_expand import check_shapes, mlp_expand_reference, mlp_expand_triton, runs_triton

OP_NAME = "treeflash::mlp_expand"


@torch.library.custom_op(OP_NAME, mutates_args=())
def mlp_expand(z: torch.Tensor, parent_ids: torch.Tensor, embed_weight: torch.Tensor,
               head_norm_weight: torch.Tensor, ug_weight: torch.Tensor, ug_bias: torch.Tensor,
               d_weight: torch.Tensor, norm_weight: torch.Tensor, head_eps: float, norm_eps: float) -> torch.Tensor:
    """z [B, H] pre-norm drafter states, parent_ids [B-1, M] (row 0 = the root) -> [B-1, M, H]
    normalised states whose LM-head logits are the conditional logits."""
    args = (z, parent_ids, embed_weight, head_norm_weight, ug_weight, ug_bias, d_weight, norm_weight)
    if runs_triton(z):
        # The GEMMs through cuBLAS: measured on the H100 at Qwen3-8B's shapes (treeflash-kernel-bench),
        # Triton + cuBLAS 0.341 ms against 0.367 ms for the Triton GEMMs (DESIGN.md section 6).
        return mlp_expand_triton(*args, head_eps, norm_eps, gemm="torch")
    return mlp_expand_reference(*args, head_eps, norm_eps)


@mlp_expand.register_fake
def _(z, parent_ids, embed_weight, head_norm_weight, ug_weight, ug_bias, d_weight, norm_weight, head_eps, norm_eps):
    check_shapes(z, parent_ids, embed_weight, head_norm_weight, ug_weight, ug_bias, d_weight, norm_weight)
    return z.new_empty(parent_ids.shape[0], parent_ids.shape[1], z.shape[1])


@torch.library.custom_op("treeflash::tree_attention", mutates_args=())
def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, past_len: torch.Tensor,
                   tree_mask: torch.Tensor, key_bound: int = 0, slot_ids: torch.Tensor | None = None) -> torch.Tensor:
    """q [Hq, n, D] over cache slots < past_len plus the n new nodes (already in slots past_len..)
    under tree_mask -> [n, Hq * D]; batched, q [M, Hq, n, D] over caches [M, Hkv, S, D] (or, with
    slot_ids [M], ranges slot_ids of caches [T, Hkv, S, D], read in place) with past_len [M] and
    tree_mask [M, n, n] -> [M, n, Hq * D]. On CUDA (with triton, and a head dim the kernel takes)
    the kernel, which reads only up to past_len + n; elsewhere the reference, which reads up to
    key_bound (0 = the whole cache)."""
    if runs_triton(q) and ta.kernel_fits(q.shape[-1]):
        return ta.tree_attention_triton(q, k_cache, v_cache, past_len, tree_mask, slot_ids=slot_ids)
    return ta.tree_attention_reference(q, k_cache, v_cache, past_len, tree_mask, key_bound, slot_ids)


@tree_attention.register_fake
def _(q, k_cache, v_cache, past_len, tree_mask, key_bound=0, slot_ids=None):
    ta._check(q, k_cache, v_cache, tree_mask, slot_ids)
    Hq, n, D = q.shape[-3:]
    return q.new_empty(*q.shape[:-3], n, Hq * D)


# The decoder layer's elementwise work (treeflash_kernels.layer_ops): the runtime's fast path.


@torch.library.custom_op("treeflash::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [n, H] (delta None: no add) -> (x + delta, RMSNorm(x + delta) * weight)."""
    if runs_triton(x):
        s, h = lo.add_rms_norm_triton(x, delta, weight, eps)
    else:
        s, h = lo.add_rms_norm_reference(x, delta, weight, eps)
    return (s.clone() if delta is None else s), h  # outputs never alias inputs (custom-op rule)


@add_rms_norm.register_fake
def _(x, delta, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("treeflash::qk_norm_rope", mutates_args=("k_cache", "v_cache"))
def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Merged q/k/v rows [n, (Hq + 2 Hkv) D] -> q [Hq, n, D] (normed per head, rotated); k (the
    same) and v written into k_cache / v_cache [Hkv, S, D] at slots [n] (negative: not written)."""
    fn = lo.qk_norm_rope_triton if runs_triton(qkv) else lo.qk_norm_rope_reference
    return fn(qkv, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slots, num_heads)


@qk_norm_rope.register_fake
def _(qkv, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slots, num_heads):
    return qkv.new_empty(num_heads, qkv.shape[0], k_cache.shape[-1])


@torch.library.custom_op("treeflash::silu_mul", mutates_args=())
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2I], gate columns first -> silu(gate) * up [n, I]."""
    return lo.silu_mul_triton(gate_up) if runs_triton(gate_up) else lo.silu_mul_reference(gate_up)


@silu_mul.register_fake
def _(gate_up):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


@torch.library.custom_op("treeflash::topk_logprobs", mutates_args=())
def topk_logprobs(logits: torch.Tensor, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> top k of log_softmax(logits / T): (values [..., k] float32, ids [..., k] int64)."""
    return tk.topk_logprobs_fast(logits, k, temperature)


@topk_logprobs.register_fake
def _(logits, k, temperature):
    shape = (*logits.shape[:-1], k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.long)


# ---------------------------------------------------------------- under torch.vmap (request slots)
#
# The slot runner maps the expansion over its slots with torch.vmap. These rules keep one launch for
# all slots where the op's shapes allow it, instead of vmap's fallback of one call per slot.


def _unbatched_calls(op, info, in_dims, args):
    """The generic rule: one call per batch element, stacked (outputs along dim 0)."""
    outs = [op(*[a.select(d, i) if d is not None else a for a, d in zip(args, in_dims)])
            for i in range(info.batch_size)]
    if isinstance(outs[0], tuple):
        return tuple(torch.stack(o) for o in zip(*outs)), tuple(0 for _ in outs[0])
    return torch.stack(outs), 0


@torch.library.register_vmap(OP_NAME)
def _mlp_expand_vmap(info, in_dims, z, parent_ids, *rest):
    """Slots' blocks side by side as one block: z [b, B, H] -> [b * B, H]; each slot's parent rows
    padded by one filler row so row r still pairs z[r + 1] with parent_ids[r]; the filler rows'
    outputs (which mix two slots) are dropped."""
    if in_dims[0] is None or in_dims[1] is None or any(d is not None for d in in_dims[2:]):
        return _unbatched_calls(mlp_expand, info, in_dims, (z, parent_ids, *rest))
    z, parent_ids = z.movedim(in_dims[0], 0), parent_ids.movedim(in_dims[1], 0)
    b, B, H = z.shape
    M = parent_ids.shape[-1]
    rows = torch.cat([parent_ids, parent_ids[:, :1]], dim=1).reshape(b * B, M)[:-1]
    out = mlp_expand(z.reshape(b * B, H), rows, *rest)  # [b * B - 1, M, H]
    return torch.cat([out, out[:1]]).reshape(b, B, M, H)[:, : B - 1], 0


@torch.library.register_vmap("treeflash::topk_logprobs")
def _topk_logprobs_vmap(info, in_dims, logits, k, temperature):
    """The op takes any leading dims: the batch is one more."""
    return topk_logprobs(logits.movedim(in_dims[0], 0), k, temperature), (0, 0)
