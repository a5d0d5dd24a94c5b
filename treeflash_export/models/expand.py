"""Stage 2: from the drafter's block output to transition tables (the `expand` step).

All three modes produce the same table format, so one tree builder serves them:
- treeflash: top-M marginal candidates per position become parents; one batched
  head + LM-head call over all (position, parent) pairs gives K children each.
- marginal: one shared row per depth (M = 1), the marginal top-K, next row 0.
- chain: the marginal argmax of each position (M = K = 1), a path of B nodes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tree import Tables, link_next_rows
from .head import ARApproximationHead


def marginal_tables(logits: torch.Tensor, top_k: int, temperature: float) -> Tables:
    """logits [B, V] of block positions 0..B-1 -> tables with one row per depth (positions 1..B-1)."""
    lp = F.log_softmax(logits[1:].float() / temperature, dim=-1)
    top = lp.topk(top_k, dim=-1)
    tokens, logprobs = top.indices[:, None, :], top.values[:, None, :]
    next_row = torch.zeros_like(tokens)
    next_row[-1] = -1
    return Tables(tokens, logprobs, next_row)


def treeflash_tables(
    z: torch.Tensor,  # [B, H] drafter residual stream (pre-norm)
    logits: torch.Tensor,  # [B, V] marginal logits = lm_head(norm(z))
    root_embed: torch.Tensor,  # [H] verifier embedding of the root token
    *,
    head: ARApproximationHead,
    norm: nn.Module,
    embed_tokens: nn.Module,
    lm_head: nn.Module,
    top_m: int,
    top_k: int,
    temperature: float,
) -> Tables:
    B, H = z.shape
    candidates = logits[:-1].topk(top_m, dim=-1).indices  # [B-1, M], parents for positions 1..B-1
    parent_embeds = embed_tokens(candidates)  # [B-1, M, H]
    # Position 0 is the known root: its embedding stands in for all M candidates.
    parent_embeds = torch.cat([root_embed.expand(1, top_m, H).to(parent_embeds.dtype), parent_embeds[1:]], dim=0)
    h = norm(z)[1:, None, :].expand(-1, top_m, -1)
    delta = head(parent_embeds, h)
    cond_logits = lm_head(norm(z[1:, None, :] + delta))  # [B-1, M, V]
    lp = F.log_softmax(cond_logits.float() / temperature, dim=-1)
    top = lp.topk(top_k, dim=-1)
    return Tables(top.indices, top.values, link_next_rows(top.indices, candidates))
