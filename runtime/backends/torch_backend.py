"""PyTorch backend: the traceable model definitions run eagerly (CPU or CUDA)."""

from __future__ import annotations

import torch

from treeflash_export.config import TreeConfig
from treeflash_export.errors import ConfigError
from treeflash_export.models import TreeVerifier
from treeflash_export.models.expand import marginal_tables, treeflash_tables
from treeflash_export.tree import Tables, Tree, build_tree, chain_tree

from .base import Runner


class TorchRunner(Runner):
    name = "torch"

    def __init__(self, verifier_hf, drafter=None, *, capacity: int, fused: bool = True):
        """verifier_hf: a Hugging Face causal LM; drafter: a TreeFlashDrafter or None (plain decoding only).
        fused: the TreeFlash head through torch.ops.treeflash.mlp_expand (the Triton kernels on CUDA,
        the PyTorch reference elsewhere) rather than the module composition."""
        self.drafter = drafter
        self.fused = fused
        tap_ids = drafter.cfg.target_layer_ids if drafter is not None else ()
        self.verifier = TreeVerifier(verifier_hf, tap_ids)
        w = self.verifier.lm_head.weight
        self.device, self.dtype = w.device, w.dtype
        self.vocab_size = self.verifier.vocab_size
        self.block_size = drafter.cfg.block_size if drafter is not None else 1
        self.mask_token_id = drafter.cfg.mask_token_id if drafter is not None else -1
        self.has_head = drafter is not None and drafter.ar_approximation is not None
        self.capacity = int(capacity)
        if self.capacity < 2:
            raise ConfigError(f"--max-seq-len {capacity} is too small")
        self.kv = None
        self.draft_kv = None

    def reset(self) -> None:
        self.kv = self.verifier.new_cache(self.capacity)
        if self.drafter is not None:
            self.draft_kv = self.drafter.model.new_cache(self.capacity)

    @torch.inference_mode()
    def prefill(self, tokens):
        logits, feats = self.verify(chain_tree(tokens), 0)
        return logits[-1], feats

    @torch.inference_mode()
    def verify(self, tree: Tree, past_len: int):
        logits, feats, new_kv = self.verifier(tree.tokens, past_len + tree.depths, tree.mask, self.kv, past_len)
        self.kv[:, :, :, past_len : past_len + tree.size] = new_kv
        return logits, feats

    def draft_block(self, root: int, ctx_features, ctx_start: int, past_len: int) -> torch.Tensor:
        """Stage 1: the drafter backbone over [root, MASK x (B-1)] -> z [B, H] (pre-norm)."""
        B, dev = self.block_size, self.device
        block = torch.full((B,), self.mask_token_id, dtype=torch.long, device=dev)
        block[0] = root
        embeds = self.verifier.embed_tokens(block)
        ctx_pos = torch.arange(ctx_start, past_len, device=dev)
        blk_pos = torch.arange(past_len, past_len + B, device=dev)
        z, new_kv = self.drafter.model(ctx_features, ctx_pos, embeds, blk_pos, self.draft_kv, ctx_start)
        self.draft_kv[:, :, :, ctx_start:past_len] = new_kv
        return z

    def tables(self, root: int, z: torch.Tensor, tree: TreeConfig) -> Tables:
        """Stage 2: transition tables for the mode (see treeflash_export.models.expand)."""
        norm = self.drafter.model.norm
        logits = self.verifier.lm_head(norm(z))
        if tree.mode == "treeflash":
            return treeflash_tables(
                z, logits, torch.tensor([root], device=self.device), head=self.drafter.ar_approximation, norm=norm,
                embed_tokens=self.verifier.embed_tokens, lm_head=self.verifier.lm_head,
                top_m=tree.top_m, top_k=tree.top_k, temperature=tree.drafter_temperature, fused=self.fused,
            )
        return marginal_tables(logits, tree.top_k, tree.drafter_temperature)

    @torch.inference_mode()
    def propose(self, root: int, ctx_features, ctx_start: int, past_len: int, tree: TreeConfig) -> Tree:
        z = self.draft_block(root, ctx_features, ctx_start, past_len)
        return build_tree(self.tables(root, z, tree), root, tree.tree_size)
