"""TensorRT backend: the artifact's engines on one CUDA stream.

Caches and all graph inputs/outputs are torch CUDA tensors whose addresses are
bound to the engines (set_tensor_address), so K/V stay in place on the GPU; the
runtime writes new K/V and compacts accepted K/V with device copies. Inside a
round the host only reads what the loop needs to branch on (the accepted path).
Written against the TensorRT 10/11 Python API; it cannot run on machines without
an NVIDIA GPU and TensorRT, where its tests are skipped.
"""

from __future__ import annotations

import torch

from treeflash_export.export.artifact import Artifact, ArtifactError
from treeflash_export.export.engines import import_trt
from treeflash_export.errors import TreeFlashError

from .graph_runner import TORCH_DTYPES, GraphRunner


class TensorRTRunner(GraphRunner):
    name = "tensorrt"

    def __init__(self, artifact: Artifact, *, device: str = "cuda"):
        if artifact.manifest["build"]["target"] != "tensorrt":
            raise ArtifactError(f"artifact {artifact.root} has no TensorRT engines (built with --target "
                                f"{artifact.manifest['build']['target']}); rebuild with --target tensorrt")
        trt = import_trt("tensorrt")
        # The version first: engines from another TensorRT cannot run on any device of this machine.
        built = artifact.manifest["versions"].get("tensorrt")
        if built != trt.__version__:
            raise ArtifactError(f"engines were built with TensorRT {built}, this machine has {trt.__version__}: "
                                f"rebuild the artifact here (engines are not portable across versions)")
        if not torch.cuda.is_available():
            raise TreeFlashError("the TensorRT backend needs a CUDA GPU; torch sees none")
        super().__init__(artifact, torch.device(device))
        self.trt = trt
        logger = trt.Logger(trt.Logger.WARNING)
        trt.init_libnvinfer_plugins(logger, "")  # plugins load before any engine is deserialised
        if artifact.manifest["build"].get("variant") == "plugin":
            from treeflash_plugins import load_plugins

            load_plugins()
        runtime = trt.Runtime(logger)
        self.engines, self.contexts = {}, {}
        for g in self.specs:
            engine = runtime.deserialize_cuda_engine(artifact.path(g, "engine").read_bytes())
            if engine is None:
                raise ArtifactError(f"cannot deserialise engine for {g!r}: corrupt, or built for another GPU")
            self.engines[g] = engine
            self.contexts[g] = engine.create_execution_context()
        self.stream = torch.cuda.Stream(device=self.device)

    def run_graph(self, name, feeds):
        spec, ctx = self.specs[name], self.contexts[name]
        spec.check_inputs(feeds)
        dims = {}
        for s in spec.inputs:
            t = feeds[s.name].contiguous()
            feeds[s.name] = t
            for want, got in zip(s.shape, t.shape):
                if isinstance(want, str):
                    dims[want] = got
            ctx.set_input_shape(s.name, tuple(t.shape))
            ctx.set_tensor_address(s.name, t.data_ptr())
        outs = {}
        for s in spec.outputs:
            shape = tuple(dims[d] if isinstance(d, str) else d for d in s.shape)
            outs[s.name] = torch.empty(shape, dtype=TORCH_DTYPES[s.dtype], device=self.device)
            ctx.set_tensor_address(s.name, outs[s.name].data_ptr())
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise TreeFlashError(f"TensorRT failed to run the {name} engine")
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return outs
