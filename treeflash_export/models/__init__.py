"""Model definitions written for tracing: flat tensors in and out, explicit static KV caches."""

from .drafter import DrafterBackbone, TreeFlashDrafter
from .head import ARApproximationHead
from .verifier import TreeVerifier

__all__ = ["ARApproximationHead", "DrafterBackbone", "TreeFlashDrafter", "TreeVerifier"]
