"""The training configuration that every stage reads (sources, data generation, chat data, the
loop), and the names of the training sources with the parser of their mix: the bottom of the
training package, which imports none of its siblings."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ..errors import ConfigError

CHAT_SOURCES = ("chat-stdlib", "chat-prose", "chat-self")
SOURCES = ("code", *CHAT_SOURCES, "data")


def parse_mix(text: str) -> dict[str, float]:
    """'code:0.4,chat-stdlib:0.3' -> {name: weight}; a name without a weight weighs 1. Weights are
    relative (counts work too: 'code:2,chat-prose:1')."""
    mix: dict[str, float] = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, _, weight = item.partition(":")
        name = name.strip()
        if name not in SOURCES:
            raise ConfigError(f"unknown training source {name!r}; choose from {', '.join(SOURCES)}")
        if name in mix:
            raise ConfigError(f"training source {name!r} is named twice in the mix")
        try:
            mix[name] = float(weight) if weight.strip() else 1.0
        except ValueError:
            raise ConfigError(f"the weight of {name!r} in the mix is {weight!r}, not a number") from None
        if not mix[name] > 0:
            raise ConfigError(f"the weight of {name!r} in the mix must be > 0")
    if not mix:
        raise ConfigError("the mix names no training source")
    return mix


@dataclass(frozen=True)
class TrainConfig:
    block_size: int = 8
    draft_layers: int = 1
    intermediate_size: int | None = None  # None = the verifier's (lets layers start from the verifier's)
    num_taps: int = 3  # tapped verifier layers (target_layer_ids spread over the verifier)
    train_prompts: int = 10240
    heldout_prompts: int = 96
    prompt_tokens: int = 48
    continuation_tokens: int = 96
    gen_batch: int = 256
    gen_temperature: float = 0.0  # 0: greedy continuations; > 0: sampled, seeded per prompt
    # Training sources and their shares ("name:weight,..."; sources.py). "" = the default:
    # code, or the --data files when given. train() stores it normalised, so resumes compare it.
    mix: str = ""
    instruction_tokens: int = 48  # chat sources: the budget of each instruction the verifier writes
    instruction_temperature: float = 0.7  # chat sources: 0 = greedy instructions; > 0 sampled, seeded
    steps: int = 4800
    batch_size: int = 8  # sequences per micro-batch and process
    grad_accum: int = 1  # micro-batches per optimiser step (global batch = batch_size x processes x this)
    anchors: int = 16  # random anchors per sequence per step, all trained in one drafter call
    loss_vocab: str = "data"  # "data": softmax over the tokens of the training data; "full": all
    lr: float = 1e-3
    warmup: int = 100
    decay_gamma: float = 4.0
    eval_every: int = 100
    save_every: int = 100
    seed: int = 0

    def validate(self) -> None:
        if self.block_size < 2:
            raise ConfigError("--block-size must be >= 2")
        if self.continuation_tokens < self.block_size + 1:
            raise ConfigError("--continuation-tokens must exceed the block size")
        for name in ("steps", "batch_size", "grad_accum", "anchors", "train_prompts", "heldout_prompts", "eval_every",
                     "save_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if self.loss_vocab not in ("data", "full"):
            raise ConfigError("--loss-vocab must be data or full")
        if not self.gen_temperature >= 0:
            raise ConfigError("--gen-temperature must be >= 0 (0 = greedy)")
        if self.instruction_tokens < 1:
            raise ConfigError("--instruction-tokens must be >= 1")
        if not self.instruction_temperature >= 0:
            raise ConfigError("--instruction-temperature must be >= 0 (0 = greedy)")
        if self.mix:
            parse_mix(self.mix)

    def data_key(self, verifier: str, split: str, source: str = "", *, chat: tuple = ()) -> str:
        """Names the cached data of one source's split. The prompt count is not part of it: a cache
        of more or fewer prompts of the same stream is reused for its leading prompts; nor is the
        mix, which only decides how many prompts each source gives.

        `source` is the content hash of --data files ("" = the standard-library code); `chat` the
        settings of a chat source (dataset._source_split). Fields are appended only when they
        differ from the original greedy code data, whose caches keep their names."""
        fields = (verifier, self.num_taps, split, self.prompt_tokens, self.continuation_tokens, self.seed)
        if source:
            fields += ("files", source)
        if chat:
            fields += ("chat", *chat)
        if self.gen_temperature:
            fields += ("temperature", self.gen_temperature)
        return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]
