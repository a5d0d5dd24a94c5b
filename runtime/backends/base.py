"""The runner contract every backend implements, and the name -> class registry.

A runner holds request slots (packed: the occupied ones are 0..occupied-1) and executes what the
engine (treeflash_runtime.engine) gives it: ``admit`` a request into the next free slot,
``prefill`` its prompt chunk by chunk, ``step`` one round of a RoundPlan over the occupied slots
(returning a RoundReport), ``release`` a slot. The PyTorch backend keeps a whole round on the
device with many slots; the graph backends (ONNX Runtime, TensorRT) hold one slot and drive their
graphs stage by stage from the host (``StagedRunner``).
"""

from __future__ import annotations

import importlib
import math
import time
from abc import ABC, abstractmethod

import torch

from treeflash_export.config import SamplingConfig, TreeConfig
from treeflash_export.errors import ConfigError, TreeFlashError
from treeflash_export.tree import Tree, chain_tree

from ..plan import RoundPlan, RoundReport
from ..sampling import accept, choose_tokens_keyed, sampling_kind

# name -> (module, class, what to install when the import fails). Imported lazily.
BACKENDS: dict[str, tuple[str, str, str]] = {
    "torch": ("treeflash_runtime.backends.pytorch", "TorchRunner", "torch"),
    "onnxruntime": ("treeflash_runtime.backends.onnxruntime_backend", "OnnxRuntimeRunner",
                    "onnxruntime (pip install 'treeflash-export[onnx]')"),
    "tensorrt": ("treeflash_runtime.backends.tensorrt_backend", "TensorRTRunner",
                 "tensorrt (pip install 'treeflash-export[tensorrt]' on an NVIDIA GPU machine)"),
}


class Runner(ABC):
    """One loaded model pair on one backend: ``max_batch`` request slots, each with caches of
    capacity ``capacity``. Shapes: F = feature width (T * H), V = vocabulary, N = tree size,
    B = block size."""

    name: str = "?"
    device: torch.device
    vocab_size: int
    draft_vocab_size: int | None = None  # the tokens the drafter may propose, where fewer than vocab_size
    block_size: int
    capacity: int
    mask_token_id: int
    has_head: bool  # the drafter has an AR-approximation head (TreeFlash mode possible)
    max_batch: int = 1
    buckets: list[int] = [1]  # the slot counts a round runs as (a round over b occupied slots runs the next)
    occupied: int = 0
    max_tree_size: int = 64  # the largest tree a plan may ask for
    deployment: dict[int, TreeConfig] = {}  # the tree each bucket was built or captured for, if fixed
    use_graphs: bool = False
    fast_kernels: bool = False
    compiled: bool = False

    @abstractmethod
    def admit(self, slot: int, sampling: SamplingConfig) -> None:
        """Slot ``slot`` (the next free one) takes a new request with these sampling settings."""

    @abstractmethod
    def prefill(self, slot: int, tokens: torch.Tensor, last: bool) -> int | None:
        """The next chunk [c] of the slot's prompt into its caches; on the last chunk the slot turns
        active and its first new token is returned (else None)."""

    def prefill_many(self, chunks: list[tuple[int, torch.Tensor, bool]]) -> list[int | None]:
        """Several slots' next chunks (slot, tokens, last): one after another unless a backend batches them."""
        return [self.prefill(slot, tokens, last) for slot, tokens, last in chunks]

    @abstractmethod
    def step(self, plan: RoundPlan) -> RoundReport:
        """One round (draft, expand, build the tree, verify, accept, commit; or one plain decoding
        step) over the occupied slots."""

    @abstractmethod
    def release(self, slot: int) -> None:
        """Frees ``slot``; the last occupied slot moves into it."""

    def bucket_for(self, occupied: int) -> int:
        return next(b for b in self.buckets if b >= occupied)

    # One sequence without an engine (benchmarks, tests): slot 0, rounds of one tree.
    def begin(self, prompt: torch.Tensor, tree: TreeConfig, sampling: SamplingConfig) -> int:
        """Frees every slot, prefills ``prompt`` [n] in slot 0 and returns its first new token; the
        rounds that follow (``round``) run ``tree`` (resolved)."""
        from ..plan import PREFILL_CHUNK

        while self.occupied:
            self.release(self.occupied - 1)
        self._plan = RoundPlan(tree=tree)
        self.admit(0, sampling)
        n = int(prompt.shape[0])
        first = None
        for start in range(0, n, PREFILL_CHUNK):
            first = self.prefill(0, prompt[start : start + PREFILL_CHUNK], last=start + PREFILL_CHUNK >= n)
        return first

    def round(self) -> list[int]:
        """One round of begin's tree in slot 0: the tokens gained."""
        return self.step(self._plan).gained[0]


class StagedRunner(Runner):
    """A one-slot runner whose stages are separate calls driven from the host: the graph backends
    (ONNX Runtime, TensorRT), whose graphs return new K/V instead of writing the caches. The round
    is written here once; subclasses provide the stages. Node reports and probes are not offered
    (the self-tuning tree runs on the PyTorch backend)."""

    kv: torch.Tensor  # the verifier cache [L, 2, Hkv, S, D], allocated by reset()

    @abstractmethod
    def reset(self) -> None:
        """A new request starts: no cached state may carry over (caches may be kept for reuse where
        no stale slot is ever read)."""

    @abstractmethod
    def encode(self, tokens: torch.Tensor, past_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt tokens [n] at positions past_len.. -> (logits of the last position [V], features
        [n, F]); fills KV slots past_len..past_len+n-1."""

    @abstractmethod
    def propose(self, root: int, ctx_features: torch.Tensor, ctx_start: int, past_len: int,
                tree: TreeConfig) -> Tree:
        """Draft one tree: add context features [c, F] (positions ctx_start..past_len-1) to the
        drafter cache, run the block [root, MASK...] at positions past_len.., expand, build the tree."""

    @abstractmethod
    def verify(self, tree: Tree, past_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One verifier pass over the tree -> (logits [N, V], features [N, F]); writes KV slots
        past_len..past_len+N-1."""

    def commit(self, past_len: int, path: torch.Tensor) -> None:
        """Move the KV of the accepted nodes ``path`` (tree indices, in order) to slots past_len..

        No RoPE fix-up is needed: an accepted node at depth d already sits at position P + d."""
        tau = path.shape[0]
        # Gather first (a copy), then write: source and destination slots may overlap.
        self.kv[:, :, :, past_len : past_len + tau] = self.kv[:, :, :, past_len + path]

    def admit(self, slot, sampling):
        if slot != 0 or self.occupied:
            raise ConfigError(f"the {self.name} backend serves one request at a time")
        self.reset()
        settings = [torch.tensor([x], device=self.device) for x in (sampling.temperature, sampling.top_p, sampling.seed)]
        kind = sampling_kind(sampling.temperature, sampling.top_p)
        # Keyed sampling, as the torch backend's: the token at position t draws from (seed, t) alone.
        self._pick = lambda logits, positions: choose_tokens_keyed(logits[None], *settings, positions[None], kind)[0]
        self._past, self._ctx_start, self._ctx, self._root = 0, 0, None, None
        self.occupied = 1

    def prefill(self, slot, tokens, last):
        logits, feats = self.encode(tokens, self._past)
        self._ctx = feats if self._ctx is None else torch.cat([self._ctx, feats])
        self._past += int(tokens.shape[0])
        if not last:
            return None
        self._root = int(self._pick(logits[None], torch.tensor([self._past], device=self.device))[0])
        return self._root

    def release(self, slot):
        if slot != 0 or not self.occupied:
            raise ConfigError(f"internal error: slot {slot} is not occupied")
        self.occupied = 0

    def step(self, plan):
        t0 = time.perf_counter()
        P, root, tree = self._past, self._root, plan.tree
        if tree.mode == "ar":
            logits, _ = self.verify(chain_tree(torch.tensor([root], device=self.device)), P)
            self._root = int(self._pick(logits, torch.tensor([P + 1], device=self.device))[0])
            self._past = P + 1
            gained = [self._root]
        else:
            draft = self.propose(root, self._ctx, self._ctx_start, P, tree)
            logits, feats = self.verify(draft, P)
            path, tau, bonus = accept(draft, self._pick(logits, P + 1 + draft.depths))
            path = path[: int(tau)]
            self.commit(P, path)
            self._ctx, self._ctx_start = feats[path], P
            self._past = P + path.shape[0]
            self._root = int(bonus)
            gained = draft.tokens[path[1:]].tolist() + [self._root]
        return RoundReport(tree=tree, gained=[gained], seconds=time.perf_counter() - t0)


def free_memory(device: torch.device) -> int | None:
    """Bytes that new tensors can still take on the device (None where it cannot be told)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def allocate_caches(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device,
                    capacity: int, slots: int = 0, extra: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """Zeroed caches, after checking that they fit: a one-line error names the bytes needed and
    the bytes free instead of an allocator traceback. slots: request slots sharing them (0: one
    sequence, no --max-batch). extra: other bytes the runner will need beside them, by name (the
    captured rounds' workspace), counted in the check but not allocated here."""
    sizes = {name: math.prod(shape) * torch.empty((), dtype=dtype).element_size() for name, shape in shapes.items()}
    sizes.update({name: b for name, b in (extra or {}).items() if b})
    free = free_memory(device)
    need = sum(sizes.values())
    if free is not None and need > free:
        parts = ", ".join(f"{name} {gib(b)}" for name, b in sizes.items())
        what = f"--max-seq-len {capacity}" + (f" x --max-batch {slots}" if slots else "")
        fix = "lower --max-seq-len" + (" or --max-batch" if slots else "")
        raise ConfigError(f"the caches for {what} need {gib(need)} ({parts}) but only {gib(free)} "
                          f"is free on {device}: {fix}")
    return {name: torch.zeros(shape, dtype=dtype, device=device) for name, shape in shapes.items()}


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def available_backends() -> list[str]:
    return list(BACKENDS)


def get_runner_class(name: str) -> type[Runner]:
    try:
        module, cls, pkg = BACKENDS[name]
    except KeyError:
        raise TreeFlashError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}") from None
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        raise TreeFlashError(f"backend {name!r} needs {pkg}: install it ({exc})") from None
