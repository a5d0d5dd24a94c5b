"""The TreeFlash AR-approximation head (the "MLP expansion").

delta = d(silu(g) * u), with [u, g] = ug([RMSNorm_e(E[parent]) ; h]) and h the
drafter's normalised hidden state. The conditional logits of a position given
its parent token are lm_head(norm(z + delta)), z being the pre-norm residual.
d starts at zero, so an untrained head reproduces the marginal drafter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

HEAD_NORM_EPS = 1e-6


class ARApproximationHead(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.ug = nn.Linear(2 * hidden_size, 2 * intermediate_size, bias=True)
        self.d = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.norm = Qwen3RMSNorm(hidden_size, eps=HEAD_NORM_EPS)
        with torch.no_grad():
            self.d.weight.zero_()

    def forward(self, parent_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """parent_embeds, hidden: [..., H] (same shape) -> delta [..., H]."""
        if parent_embeds.shape != hidden.shape:
            raise ValueError(f"head: parent embeddings {tuple(parent_embeds.shape)} and hidden states "
                             f"{tuple(hidden.shape)} must have the same shape")
        u, g = self.ug(torch.cat([self.norm(parent_embeds), hidden], dim=-1)).chunk(2, dim=-1)
        return self.d(F.silu(g) * u)
