"""ONNX Runtime backend: the exported graphs (reference or plugin variant) on the CPU (or CUDA) execution provider."""

from __future__ import annotations

import numpy as np
import torch

from treeflash_export.export.artifact import Artifact
from treeflash_export.errors import TreeFlashError

from .graph_runner import GraphRunner


class OnnxRuntimeRunner(GraphRunner):
    name = "onnxruntime"

    def __init__(self, artifact: Artifact, *, providers: list[str] | None = None, threads: int | None = None):
        import onnxruntime as ort

        if artifact.dtype == "bfloat16":
            raise TreeFlashError("the ONNX Runtime backend runs float32 and float16 artifacts; this one is "
                                 "bfloat16 (use --backend tensorrt, or rebuild with --dtype float32)")
        super().__init__(artifact, torch.device("cpu"))
        opts = ort.SessionOptions()
        # Three sessions run in turn with torch work between them: spinning worker threads
        # would steal the cores those need.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if threads:
            opts.intra_op_num_threads = threads
        # Plugin graphs (treeflash.MlpExpand nodes) run through the node's function body.
        from treeflash_plugins.onnx_ops import ort_session

        self.sessions = {g: ort_session(artifact.path(g, "onnx"), opts, providers) for g in self.specs}

    def run_graph(self, name, feeds):
        spec = self.specs[name]
        arrays = {k: np.ascontiguousarray(v.numpy()) for k, v in feeds.items()}
        spec.check_inputs(arrays)
        outs = self.sessions[name].run([s.name for s in spec.outputs], arrays)
        return {s.name: torch.from_numpy(o) for s, o in zip(spec.outputs, outs)}
