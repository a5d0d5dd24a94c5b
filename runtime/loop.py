"""The generation loop over a runner's rounds (draft -> expand -> build tree -> verify ->
accept -> commit; each backend runs a round its own way behind ``Runner.round``).

Bookkeeping per round (P = committed length, i.e. tokens whose verifier KV is final):
- ``root`` is the last emitted token, not yet in the verifier cache; it is node 0
  of the tree at position P.
- the drafter context gains the verifier features of the tokens committed in the
  previous round (positions ctx_start..P-1).
- after acceptance, the path root..b* (tau = depth(b*) + 1 nodes) is committed to
  slots P..P+tau-1, its drafted tokens plus the bonus y[b*] are emitted, and the
  bonus becomes the next root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from treeflash_export.config import SamplingConfig, TreeConfig
from treeflash_export.errors import ConfigError

from .backends.base import Runner


@dataclass
class GenerationStats:
    mode: str
    backend: str
    prompt_tokens: int = 0
    rounds: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # tokens gained per round
    new_tokens: int = 0
    prefill_s: float = 0.0
    elapsed_s: float = 0.0
    tuning: dict | None = None  # the self-tuning tree's report (settings used, choices, costs), when it chose

    @property
    def mean_accepted(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(mean_accepted=self.mean_accepted, tokens_per_s=self.tokens_per_s)
        return d


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    stats: GenerationStats
    stop_reason: str  # "stop_token" | "max_new_tokens" | "stopped" (on_tokens returned True)


def checked_tree(runner: Runner, tree: TreeConfig) -> TreeConfig:
    """The tree setting as this runner will use it (resolved), after checking that the runner can."""
    if tree.mode != "ar":
        if runner.block_size < 2:
            raise ConfigError(f"mode {tree.mode!r} needs a drafter; this runner has none (use mode 'ar')")
        tree.validate(block_size=runner.block_size, vocab_size=runner.draft_vocab_size or runner.vocab_size,
                      has_head=runner.has_head)
    return tree.resolved(runner.block_size)


def required_capacity(prompt_len: int, max_new_tokens: int, tree_size: int) -> int:
    """Cache slots needed: the last round starts at P <= prompt + max_new - 1 and writes N tree slots."""
    return prompt_len + max_new_tokens - 1 + max(tree_size, 1)


def check_capacity(runner: Runner, prompt_len: int, sampling: SamplingConfig, tree: TreeConfig) -> None:
    if prompt_len < 1:
        raise ConfigError("the prompt is empty")
    S = runner.capacity
    if prompt_len > S:
        raise ConfigError(f"the prompt is {prompt_len} tokens but the cache holds {S}: "
                          f"shorten the prompt or raise --max-seq-len")
    need = required_capacity(prompt_len, sampling.max_new_tokens, tree.tree_size)
    if need > S:
        raise ConfigError(
            f"prompt ({prompt_len}) + max new tokens ({sampling.max_new_tokens}) + tree ({tree.tree_size}) "
            f"needs {need} cache slots but the cache holds {S}: lower --max-new-tokens or raise --max-seq-len"
        )


class Emitter:
    """Collects emitted tokens, applies stop tokens and the token budget, and streams."""

    def __init__(self, sampling: SamplingConfig, on_tokens: Callable[[list[int]], None] | None):
        self.tokens: list[int] = []
        self.stop = set(sampling.stop_token_ids)
        self.budget = sampling.max_new_tokens
        self.on_tokens = on_tokens
        self.reason = ""

    def emit(self, new: list[int]) -> bool:
        """Returns True when generation must end."""
        take = []
        for t in new:
            take.append(t)
            if t in self.stop:
                self.reason = "stop_token"
                break
            if len(self.tokens) + len(take) >= self.budget:
                self.reason = "max_new_tokens"
                break
        self.tokens.extend(take)
        # A callback that returns True ends generation after these tokens (stop words, cancelled streams).
        if self.on_tokens is not None and take and self.on_tokens(take) and not self.reason:
            self.reason = "stopped"
        return bool(self.reason)


def generate(
    runner: Runner,
    prompt_ids: list[int] | torch.Tensor,
    tree: TreeConfig,
    sampling: SamplingConfig,
    on_tokens: Callable[[list[int]], bool | None] | None = None,
    tuner=None,
) -> GenerationResult:
    """Speculative (or, with mode 'ar', plain) generation over one runner. tuner: a self-tuning tree
    (treeflash_runtime.tuner.online.TreeTuner) that picks each round's tree instead of ``tree``."""
    sampling.validate()
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=runner.device).reshape(-1)
    P = int(prompt.shape[0])
    if tuner is not None:
        # The largest tree the tuner may pick must fit, whichever it starts with; checked before the
        # tuner's first choice (which may measure the cost model).
        check_capacity(runner, P, sampling, dataclasses.replace(tree, tree_size=tuner.max_tree_size))
        tuner.new_generation()
        tree = tuner.next_tree()
    tree = checked_tree(runner, tree)
    if tuner is None:
        check_capacity(runner, P, sampling, tree)
    stats = GenerationStats(mode=tree.mode, backend=runner.name, prompt_tokens=P)
    out = Emitter(sampling, on_tokens)

    try:
        with contextlib.nullcontext() if tuner is None else tuner.driving(runner):
            t0 = time.perf_counter()
            first = runner.begin(prompt, tree, sampling)
            stats.prefill_s = time.perf_counter() - t0
            done = out.emit([first])
            while not done:
                if tuner is not None and stats.rounds:
                    runner.set_tree(tuner.next_tree())
                t_round = time.perf_counter()
                gained = runner.round()
                if tuner is not None:
                    tuner.round_took(time.perf_counter() - t_round)
                    tuner.after_round(runner, gained=len(gained), tokens=gained)
                stats.rounds += 1
                stats.accept_lengths.append(len(gained))
                done = out.emit(gained)
    finally:
        # The generation's slot is free again (request slots: slot 0 of one occupied), so that a cost
        # probe of the self-tuning tree may take it before the next generation.
        free = getattr(runner, "release", None)
        if free is not None:
            free(0, 1)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    stats.elapsed_s = time.perf_counter() - t0
    stats.new_tokens = len(out.tokens)
    if tuner is not None:
        stats.mode = tuner.fixed_mode or "auto"
        stats.tuning = tuner.report()
    return GenerationResult(out.tokens, stats, out.reason)
