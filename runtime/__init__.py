"""TreeFlash runtime (installed as ``treeflash_runtime``): backends, the round loop, ``treeflash-run``."""

from .loop import GenerationResult, GenerationStats, generate

__all__ = ["GenerationResult", "GenerationStats", "generate"]
