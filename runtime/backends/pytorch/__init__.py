"""The PyTorch backend, split along the round: the slot state (state), the round's stage functions
(stages), the drafter's LM head (draft_head), the CUDA graph cache (graphs), the stage timer and
cost probe (probe), and the runner that composes them (runner)."""

from .draft_head import draft_head_default
from .runner import TorchRunner, fast_kernels_default
from .stages import expansion_depth

__all__ = ["TorchRunner", "draft_head_default", "expansion_depth", "fast_kernels_default"]
