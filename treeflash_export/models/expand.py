"""Stage 2: from the drafter's block output to transition tables (the `expand` step).

All three modes produce the same table format, so one tree builder serves them:
- treeflash: top-M marginal candidates per position become parents; one batched
  head + LM-head call over all (position, parent) pairs gives K children each.
- marginal: one shared row per depth (M = 1), the marginal top-K, next row 0.
- chain: the marginal argmax of each position (M = K = 1), a path of B nodes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..tree import Tables, link_next_rows
from .head import ARApproximationHead


def top_logprobs(logits: torch.Tensor, k: int, temperature: float,
                 kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> the top k of log_softmax(logits / T) as (values float32, ids), best first.
    kernel: through ``torch.ops.treeflash.topk_logprobs`` (two Triton kernels on CUDA that read the
    logits once; ties lower id first), the runtime's fast path; else these standard ops."""
    if kernel:
        from treeflash_kernels.ops import topk_logprobs

        return topk_logprobs(logits, k, temperature)
    x = logits.float()
    if temperature != 1.0:  # x / 1.0 is x: the pass is skipped, the result is the same
        x = x / temperature
    top = F.log_softmax(x, dim=-1).topk(k, dim=-1)
    return top.values, top.indices


def _token_ids(indices: torch.Tensor, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    """Indices into the logits' last dimension -> token ids (the draft vocabulary's rows, when the
    logits are over a draft vocabulary; see models.draft_vocab)."""
    return indices if vocab_ids is None else vocab_ids[indices]


def marginal_tables(logits: torch.Tensor, top_k: int, temperature: float, topk_kernel: bool = False,
                    vocab_ids: torch.Tensor | None = None) -> Tables:
    """logits [B, V] of block positions 0..B-1 -> tables with one row per depth (positions 1..B-1).
    topk_kernel: see top_logprobs. vocab_ids [V]: the token id of each logit column, when the logits
    are over a draft vocabulary (None: column = token id)."""
    values, indices = top_logprobs(logits[1:], top_k, temperature, topk_kernel)
    indices = _token_ids(indices, vocab_ids)
    tokens, logprobs = indices[:, None, :], values[:, None, :]
    # Row 0 of the next depth; the last depth's children are leaves. Built from device tensors
    # (no number assigned into a tensor: that is a host-to-device copy, not allowed in a CUDA graph).
    next_row = torch.cat([torch.zeros_like(tokens[:-1]), torch.full_like(tokens[-1:], -1)])
    return Tables(tokens, logprobs, next_row)


def treeflash_tables(
    z: torch.Tensor,  # [B, H] drafter residual stream (pre-norm)
    logits: torch.Tensor,  # [B, V] marginal logits = lm_head(norm(z)) (V: the draft vocabulary's size)
    root: torch.Tensor,  # [1] the root token
    *,
    head: ARApproximationHead,
    norm: nn.Module,
    embed_tokens: nn.Module,
    lm_head: Callable[[torch.Tensor], torch.Tensor],  # hidden states -> logits (a module or a draft head)
    top_m: int,
    top_k: int,
    temperature: float,
    fused: bool = False,
    topk_kernel: bool = False,
    vocab_ids: torch.Tensor | None = None,
) -> Tables:
    """fused: the head and final norm through ``torch.ops.treeflash.mlp_expand`` (Triton kernels on
    CUDA, one custom node in ONNX) instead of the module composition; same math. topk_kernel: the
    conditional logits' top K through the top-k kernels (see top_logprobs). vocab_ids: with a draft
    vocabulary, ``lm_head`` gives its rows' logits and vocab_ids [V] their token ids."""
    B, H = z.shape
    # [B-1, M], parents for positions 1..B-1
    candidates = _token_ids(logits[:-1].topk(top_m, dim=-1).indices, vocab_ids)
    # Position 0 is the known root: it stands in for all M candidates.
    parent_ids = torch.cat([root.reshape(1, 1).expand(1, top_m), candidates[1:]], dim=0)
    if fused:
        from treeflash_kernels.ops import mlp_expand

        states = mlp_expand(z, parent_ids, embed_tokens.weight, head.norm.weight, head.ug.weight, head.ug.bias,
                            head.d.weight, norm.weight, head.norm.variance_epsilon, norm.variance_epsilon)
    else:
        h = norm(z)[1:, None, :].expand(-1, top_m, -1)
        delta = head(embed_tokens(parent_ids), h)
        states = norm(z[1:, None, :] + delta)
    cond_logits = lm_head(states)  # [B-1, M, V]
    values, indices = top_logprobs(cond_logits, top_k, temperature, topk_kernel)
    indices = _token_ids(indices, vocab_ids)
    return Tables(indices, values, link_next_rows(indices, candidates))
