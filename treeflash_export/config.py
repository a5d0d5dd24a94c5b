"""Frozen configuration dataclasses.

CLI defaults are read from these fields, and the same objects are what later
gets saved into an artifact's manifest, so there is one source of truth for
every default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import CheckpointError, ConfigError

# Decoding modes. "ar" is plain autoregressive decoding over the same backend (the baseline).
MODES = ("treeflash", "marginal", "chain", "ar")
# TensorRT's TopK supports k <= 3840; we keep every graph inside that limit.
MAX_TOPK = 3840
# What the runtime stores per request: the seed in an int64 tensor (as vLLM bounds it), temperature and
# top-p in float32 (a top-p that float32 flushes to 0 would keep no token).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MIN_TOP_P = 1e-6


@dataclass(frozen=True)
class TreeConfig:
    """How the draft tree is built each round.

    tree_size: N, nodes per round including the root.
    top_m: M, candidate parents kept per block position (TreeFlash mode only).
    top_k: K, children per parent row in the transition tables.
    drafter_temperature: temperature of the drafter's log-probabilities used to score paths;
        it changes the tree's shape, never the output distribution.
    """

    mode: str = "treeflash"
    tree_size: int = 64
    top_m: int = 16
    top_k: int = 16
    drafter_temperature: float = 1.0

    def resolved(self, block_size: int) -> "TreeConfig":
        """The settings actually used: chain is a path of B nodes, marginal keeps one row per depth."""
        if self.mode == "chain":
            return dataclasses.replace(self, tree_size=block_size, top_m=1, top_k=1)
        if self.mode == "marginal":
            return dataclasses.replace(self, top_m=1)
        if self.mode == "ar":
            return dataclasses.replace(self, tree_size=1, top_m=1, top_k=1)
        return self

    def validate(self, *, block_size: int, vocab_size: int, has_head: bool) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.mode == "treeflash" and not has_head:
            raise ConfigError(
                "mode 'treeflash' needs a drafter with an AR-approximation head "
                "(treeflash_config.ar_approximation = 'swiglu'); this drafter has none: use --mode marginal or chain"
            )
        if self.mode in ("chain", "ar"):
            return
        limit = min(vocab_size, MAX_TOPK)
        if not 2 <= self.tree_size <= MAX_TOPK:
            raise ConfigError(f"--tree-size {self.tree_size} is out of range: use 2..{MAX_TOPK}")
        if not 1 <= self.top_k <= limit:
            raise ConfigError(f"--top-k {self.top_k} is out of range: use 1..{limit} (vocabulary {vocab_size})")
        if not 1 <= self.top_m <= limit:
            raise ConfigError(f"--top-m {self.top_m} is out of range: use 1..{limit} (vocabulary {vocab_size})")
        if not self.drafter_temperature > 0:
            raise ConfigError(f"drafter temperature must be > 0, got {self.drafter_temperature}")
        if block_size < 2:
            raise ConfigError(f"the drafter's block size is {block_size}; tree decoding needs at least 2")


@dataclass(frozen=True)
class SamplingConfig:
    """What the verifier samples with. temperature 0 is greedy; top_p applies to the verifier only."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def validate(self) -> None:
        if not 0 <= self.temperature < float("inf"):  # NaN fails too
            raise ConfigError(f"--temperature must be >= 0, got {self.temperature}")
        if not MIN_TOP_P <= self.top_p <= 1:
            raise ConfigError(f"--top-p must be in [{MIN_TOP_P:g}, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not SEED_MIN <= self.seed <= SEED_MAX:
            raise ConfigError(f"--seed must fit in int64 ({SEED_MIN}..{SEED_MAX}), got {self.seed}")


@dataclass(frozen=True)
class DrafterConfig:
    """The drafter's shape, read from its Hugging Face config (TreeFlash or DFlash layout)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    ar_approximation: str | None
    num_target_layers: int | None
    attention_bias: bool = False
    hf_config: Any = field(default=None, compare=False, repr=False)

    @property
    def has_head(self) -> bool:
        return self.ar_approximation is not None

    @classmethod
    def from_hf(cls, cfg: Any) -> "DrafterConfig":
        dflash = getattr(cfg, "dflash_config", None) or {}
        treeflash = getattr(cfg, "treeflash_config", None) or {}
        num_layers = int(cfg.num_hidden_layers)
        num_target = getattr(cfg, "num_target_layers", None)
        block_size = getattr(cfg, "block_size", None) or dflash.get("block_size")
        if block_size is None:
            raise CheckpointError("drafter config has no block_size (top level or dflash_config.block_size)")
        layer_ids = dflash.get("target_layer_ids")
        if layer_ids is None:
            if num_target is None:
                raise CheckpointError(
                    "drafter config has neither dflash_config.target_layer_ids nor num_target_layers"
                )
            layer_ids = default_target_layer_ids(int(num_target), num_layers)
        mask_id = dflash.get("mask_token_id")
        if mask_id is None:
            raise CheckpointError("drafter config has no dflash_config.mask_token_id")
        ar = treeflash.get("ar_approximation", getattr(cfg, "ar_approximation", None))
        if ar not in (None, "swiglu"):
            raise CheckpointError(f"treeflash_config.ar_approximation must be 'swiglu' or null, got {ar!r}")
        heads = int(cfg.num_attention_heads)
        return cls(
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
            rms_norm_eps=float(cfg.rms_norm_eps),
            vocab_size=int(cfg.vocab_size),
            block_size=int(block_size),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            mask_token_id=int(mask_id),
            ar_approximation=ar,
            num_target_layers=None if num_target is None else int(num_target),
            attention_bias=bool(getattr(cfg, "attention_bias", False)),
            hf_config=cfg,
        )


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Tapped verifier layers when a config names none: spread from 1 to L-3 (one draft layer: L//2)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]
