"""The drafter's LM head: which vocabulary rows the expansion ranks (the draft vocabulary) and the
dtype it multiplies them in. The verifier's own head is untouched: it decides the output."""

from __future__ import annotations

import torch


def draft_head_default(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype the expansion's LM head rows are kept and multiplied in: bf16 on a CPU with bf16
    instructions (AVX512-BF16 or AMX) where the model runs in fp32, else the model's own. The
    expansion multiplies a few rows (the drafter's block, M parent rows per position) by the whole
    draft vocabulary's rows, so it reads the head's weights for little arithmetic; in bf16 it reads
    half as much through faster kernels. The drafter's numbers decide only which tokens the tree
    holds; the verifier, in the model's dtype, decides the output, so the output is unchanged."""
    if device.type != "cpu" or dtype != torch.float32:
        return dtype
    cpu = torch.cpu
    fast = any(bool(getattr(cpu, name, lambda: False)()) for name in ("_is_avx512_bf16_supported",
                                                                      "_is_amx_tile_supported"))
    return torch.bfloat16 if fast else dtype


class DraftHead:
    """The LM head rows the expansion ranks: ``ids`` (ascending token ids, None for the whole
    vocabulary) and ``rows``, their rows as a copy in ``dtype`` (None: the verifier's head itself, the
    whole vocabulary in the model's dtype). ``size`` is their number either way.

    lm_head: the verifier's head; drafter: a TreeFlashDrafter or None; size: None = the drafter's own
    list (draft-vocab.json; the whole vocabulary without one), 0 = the whole vocabulary, N = its
    first N (treeflash_export.models.draft_vocab)."""

    def __init__(self, lm_head: torch.nn.Module, drafter, vocab_size: int, size: int | None, dtype: torch.dtype):
        from treeflash_export.models import draft_vocab

        self.lm_head, self.dtype = lm_head, dtype
        device = lm_head.weight.device
        order = drafter.vocab_order if drafter is not None else None
        ids = draft_vocab.select(order, size, vocab_size) if drafter is not None else None
        self.ids = None if ids is None else ids.to(device)
        self.size = vocab_size if ids is None else len(ids)
        self.rows = self.bias = None
        if ids is None and (drafter is None or dtype == lm_head.weight.dtype):
            return
        pick = (lambda t: t) if ids is None else (lambda t: t.index_select(0, self.ids))
        self.rows = pick(lm_head.weight).to(dtype)
        self.bias = None if lm_head.bias is None else pick(lm_head.bias).to(dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The drafter's logits over its draft vocabulary (the whole vocabulary without one), in x's
        dtype (computed in the head's)."""
        if self.rows is None:
            return self.lm_head(x)
        return torch.nn.functional.linear(x.to(self.rows.dtype), self.rows, self.bias).to(x.dtype)
