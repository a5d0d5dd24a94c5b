"""The runner contract every backend implements, and the name -> class registry.

The round loop (``treeflash_runtime.loop``) calls only these methods, so the
ONNX Runtime and TensorRT backends slot in without touching it. Tensors cross
the contract on the runner's device.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch

from treeflash_export.config import TreeConfig
from treeflash_export.errors import TreeFlashError
from treeflash_export.tree import Tree

# name -> (module, class, what to install when the import fails). Imported lazily.
BACKENDS: dict[str, tuple[str, str, str]] = {
    "torch": ("treeflash_runtime.backends.torch_backend", "TorchRunner", "torch"),
    "onnxruntime": ("treeflash_runtime.backends.onnxruntime_backend", "OnnxRuntimeRunner",
                    "onnxruntime (pip install 'treeflash-export[onnx]')"),
    "tensorrt": ("treeflash_runtime.backends.tensorrt_backend", "TensorRTRunner",
                 "tensorrt (pip install 'treeflash-export[tensorrt]' on an NVIDIA GPU machine)"),
}


class Runner(ABC):
    """One loaded model pair on one backend, with its caches of capacity ``capacity``.

    Shapes: F = feature width (T * H), V = vocabulary, N = tree size, B = block size.
    """

    name: str = "?"
    device: torch.device
    vocab_size: int
    block_size: int
    capacity: int
    mask_token_id: int
    has_head: bool  # the drafter has an AR-approximation head (TreeFlash mode possible)

    @abstractmethod
    def reset(self) -> None:
        """Forget all cached state (a new generation starts)."""

    @abstractmethod
    def prefill(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt tokens [n] -> (logits of the last position [V], features [n, F]); fills KV slots 0..n-1."""

    @abstractmethod
    def propose(self, root: int, ctx_features: torch.Tensor, ctx_start: int, past_len: int,
                tree: TreeConfig) -> Tree:
        """Draft one tree: add context features [c, F] (positions ctx_start..past_len-1) to the
        drafter cache, run the block [root, MASK...] at positions past_len.., expand, build the tree."""

    @abstractmethod
    def verify(self, tree: Tree, past_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One verifier pass over the tree -> (logits [N, V], features [N, F]); writes KV slots
        past_len..past_len+N-1."""

    kv: torch.Tensor  # the verifier cache [L, 2, Hkv, S, D], allocated by reset()

    def commit(self, past_len: int, path: torch.Tensor) -> None:
        """Move the KV of the accepted nodes ``path`` (tree indices, in order) to slots past_len..

        No RoPE fix-up is needed: an accepted node at depth d already sits at position P + d."""
        tau = path.shape[0]
        # Gather first (a copy), then write: source and destination slots may overlap.
        self.kv[:, :, :, past_len : past_len + tau] = self.kv[:, :, :, past_len + path]


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
