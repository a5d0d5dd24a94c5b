"""TensorRT plugins for TreeFlash's custom ops (installed as ``treeflash_plugins``).

- ``onnx_ops``: the ``treeflash.MlpExpand`` ONNX node (schema, translation from the
  PyTorch custom op, the function body ONNX Runtime runs, the per-kernel split for
  TensorRT). Needs onnx only.
- ``tensorrt_plugins``: the ahead-of-time TensorRT plugins, one per Triton kernel.
  Imported only by ``load_plugins()``.
"""

from __future__ import annotations

_loaded: tuple[str, ...] | None = None


def load_plugins() -> tuple[str, ...]:
    """Register TreeFlash's TensorRT plugins with TensorRT's registry; safe to call any number
    of times (the first call registers, later calls return the same ids). Call it before
    parsing a plugin graph or deserialising an engine built from one, in a Python process."""
    global _loaded
    if _loaded is None:
        try:
            import tensorrt.plugin  # noqa: F401
        except ImportError as e:
            raise ImportError(f"TreeFlash's TensorRT plugins need TensorRT 10.8+ with its Python plugin API "
                              f"and triton ({e}); install the 'tensorrt' extra on an NVIDIA GPU machine") from None
        from . import tensorrt_plugins

        _loaded = tensorrt_plugins.PLUGIN_IDS
    return _loaded
