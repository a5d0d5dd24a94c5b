"""One generation (``generate``): the engine loop (treeflash_runtime.engine) with one request, and
its statistics.

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

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from treeflash_export.config import SamplingConfig, TreeConfig

from .backends.base import Runner
from .engine import Engine, fixed_plans
from .scheduler import FAILED, Request


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


def generate(
    runner: Runner,
    prompt_ids: list[int] | torch.Tensor,
    tree: TreeConfig,
    sampling: SamplingConfig,
    on_tokens: Callable[[list[int]], bool | None] | None = None,
    tuner=None,
) -> GenerationResult:
    """Speculative (or, with mode 'ar', plain) generation of one prompt: an engine with one request.
    tuner: a self-tuning tree (treeflash_runtime.tuner.online.TreeTuner) that plans each round
    instead of ``tree``."""
    sampling.validate()
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1).tolist()
    if tuner is not None:
        tuner.new_generation()
        policy = tuner
    else:
        policy = fixed_plans(runner, tree)
        tree = policy.trees[1]
    stats = GenerationStats(mode=tree.mode, backend=runner.name, prompt_tokens=len(prompt))
    request = Request(prompt, sampling, on_tokens=on_tokens)
    engine = Engine(runner, policy, max_active=1)
    engine.check(request)  # a request refused by a cheap check never waits for a tuner's measurement
    engine.prepare()  # a tuner's first measurement, before the generation's clock starts
    t0 = time.perf_counter()
    engine.run([request])
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    if request.state == FAILED:
        raise RuntimeError(request.error)
    stats.elapsed_s = time.perf_counter() - t0
    stats.prefill_s = (request.first_token_at or time.perf_counter()) - t0
    stats.rounds = len(request.accept_lengths)
    stats.accept_lengths = list(request.accept_lengths)
    stats.new_tokens = len(request.tokens)
    if tuner is not None:
        stats.mode = tuner.fixed_mode or "auto"
        stats.tuning = tuner.report()
    return GenerationResult(request.tokens, stats, request.stop_reason)
