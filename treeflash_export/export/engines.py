"""Engine builds from the exported ONNX graphs: TensorRT (11 API) and TensorRT-RTX.

Kept thin on purpose: everything that decides shapes and names comes from the
graph's I/O spec. Both are strongly typed: precision comes from the ONNX dtypes,
there are no FP16/BF16 builder flags to set. TensorRT cannot be installed on the
machines this project is developed on; the TensorRT-RTX builder works without a
GPU (it cannot load or run what it builds there), so CI builds and serialises
every graph with it.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ..errors import TreeFlashError
from .graphs import GraphSpec

# TensorRT-RTX targets consumer GPUs; it has no Hopper target. "CURRENT" would need a GPU.
RTX_TARGETS = ("SM80", "SM86", "SM89", "SM120")
ENGINE_SUFFIX = {"tensorrt": ".plan", "tensorrt-rtx": ".rtx.plan"}
MODULES = {"tensorrt": ("tensorrt", "pip install 'treeflash-export[tensorrt]' (needs an NVIDIA GPU machine)"),
           "tensorrt-rtx": ("tensorrt_rtx", "pip install tensorrt-rtx-cu13")}


def import_trt(flavor: str):
    module, hint = MODULES[flavor]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise TreeFlashError(f"{flavor} is not installed: {hint}") from None


def trt_version(flavor: str) -> str | None:
    try:
        return importlib.import_module(MODULES[flavor][0]).__version__
    except ImportError:
        return None


def _profile_shapes(spec: GraphSpec, name: str) -> tuple[tuple, tuple, tuple] | None:
    shape = next(s.shape for s in spec.inputs if s.name == name)
    if not any(isinstance(d, str) for d in shape):
        return None
    pick = [tuple(spec.dynamic[d][i] if isinstance(d, str) else d for d in shape) for i in range(3)]
    return pick[0], pick[1], pick[2]


def build_engine(onnx_path: Path, spec: GraphSpec, plan_path: Path, *, flavor: str,
                 timing_cache: Path | None = None, plugins: bool = False,
                 workspace_bytes: int = 4 << 30) -> int:
    """Parse the ONNX file, build and serialise one engine; returns the plan size in bytes.
    plugins: the graph has TreeFlash plugin nodes (TensorRT only): register them first."""
    trt = import_trt(flavor)
    logger = trt.Logger(trt.Logger.WARNING)
    if flavor == "tensorrt":
        trt.init_libnvinfer_plugins(logger, "")
    if plugins:  # plugins must be registered before the parser sees their nodes
        if flavor != "tensorrt":
            raise TreeFlashError(f"{flavor} has no plugin API: build --variant reference")
        from treeflash_plugins import load_plugins

        try:
            load_plugins()
        except ImportError as e:
            raise TreeFlashError(str(e)) from None
    builder = trt.Builder(logger)
    flags = 0
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if strongly_typed is not None:  # always on in TensorRT 11 and RTX; explicit for TensorRT 10
        flags |= 1 << int(strongly_typed)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TreeFlashError(f"{flavor} could not parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if flavor == "tensorrt-rtx":
        config.num_compute_capabilities = len(RTX_TARGETS)
        for i, name in enumerate(RTX_TARGETS):
            config.set_compute_capability(getattr(trt.ComputeCapability, name), i)
    cache = None
    if flavor == "tensorrt" and timing_cache is not None:  # a no-op in TensorRT-RTX
        data = timing_cache.read_bytes() if timing_cache.is_file() else b""
        cache = config.create_timing_cache(data)
        config.set_timing_cache(cache, ignore_mismatch=False)
    profile = None
    for s in spec.inputs:
        shapes = _profile_shapes(spec, s.name)
        if shapes is not None:
            profile = profile or builder.create_optimization_profile()
            profile.set_shape(s.name, *shapes)
    if profile is not None:
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise TreeFlashError(f"{flavor} failed to build an engine from {onnx_path.name} (see the log above)")
    data = bytes(plan)
    plan_path.write_bytes(data)
    if cache is not None:
        timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    return len(data)
