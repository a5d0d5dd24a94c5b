"""The kernels as PyTorch custom ops: ``torch.ops.treeflash.mlp_expand`` (the MLP expansion)
and ``torch.ops.treeflash.tree_attention`` (attention over the KV cache plus a tree).

On CUDA (with triton installed) it runs the Triton kernels; elsewhere the plain
PyTorch reference. Its fake (meta) implementation gives shapes to tracing, so the
ONNX exporter sees one node, which treeflash_plugins translates into a single
``treeflash.MlpExpand`` node (the ``plugin`` graph variant).
"""

from __future__ import annotations

import torch

from . import tree_attention as ta
from .mlp_expand import check_shapes, mlp_expand_reference, mlp_expand_triton, triton

OP_NAME = "treeflash::mlp_expand"


@torch.library.custom_op(OP_NAME, mutates_args=())
def mlp_expand(z: torch.Tensor, parent_ids: torch.Tensor, embed_weight: torch.Tensor,
               head_norm_weight: torch.Tensor, ug_weight: torch.Tensor, ug_bias: torch.Tensor,
               d_weight: torch.Tensor, norm_weight: torch.Tensor, head_eps: float, norm_eps: float) -> torch.Tensor:
    """z [B, H] pre-norm drafter states, parent_ids [B-1, M] (row 0 = the root) -> [B-1, M, H]
    normalised states whose LM-head logits are the conditional logits."""
    args = (z, parent_ids, embed_weight, head_norm_weight, ug_weight, ug_bias, d_weight, norm_weight)
    if z.is_cuda and triton is not None:
        return mlp_expand_triton(*args, head_eps, norm_eps)
    return mlp_expand_reference(*args, head_eps, norm_eps)


@mlp_expand.register_fake
def _(z, parent_ids, embed_weight, head_norm_weight, ug_weight, ug_bias, d_weight, norm_weight, head_eps, norm_eps):
    check_shapes(z, parent_ids, embed_weight, head_norm_weight, ug_weight, ug_bias, d_weight, norm_weight)
    return z.new_empty(parent_ids.shape[0], parent_ids.shape[1], z.shape[1])


@torch.library.custom_op("treeflash::tree_attention", mutates_args=())
def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, past_len: torch.Tensor,
                   tree_mask: torch.Tensor, key_bound: int = 0) -> torch.Tensor:
    """q [Hq, n, D] over cache slots < past_len plus the n new nodes (already in slots past_len..)
    under tree_mask -> [n, Hq * D]. On CUDA (with triton) the kernel, which reads only up to
    past_len + n; elsewhere the reference, which reads up to key_bound (0 = the whole cache)."""
    if q.is_cuda and ta.triton is not None:
        return ta.tree_attention_triton(q, k_cache, v_cache, past_len, tree_mask)
    return ta.tree_attention_reference(q, k_cache, v_cache, past_len, tree_mask, key_bound)


@tree_attention.register_fake
def _(q, k_cache, v_cache, past_len, tree_mask, key_bound=0):
    ta._check(q, k_cache, v_cache, tree_mask)
    return q.new_empty(q.shape[1], q.shape[0] * q.shape[2])
