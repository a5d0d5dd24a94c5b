"""The `treeflash` model of a Triton model repository: the repository's 1/model.py (written by
`treeflash-export triton-repo`) imports this class; it runs inside Triton's Python backend,
whose `triton_python_backend_utils` exists only there.

A thin adapter: Triton tensors in, replies of serving.service out. The round loop, request
checks and streaming live in serving.service. Decoupled: every request gets
its responses through its own response sender, the last one flagged final; a bad request gets
one error response and the model goes on serving.
"""

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from treeflash_export.errors import TreeFlashError

from .service import BatchedService, Service


def _response(reply):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, array)
                                                      for name, array in reply.outputs().items()])


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        backend = params["backend"]
        folder = Path(args["model_repository"]) / params["artifact"]
        verify = params.get("verify_checksums", "true") == "true"
        self.logger = pb_utils.Logger
        if backend == "torch":  # in-flight batching on this instance's device: the GPU if there is one
            import torch

            from ..backends.slots import parse_tree_size_by_batch

            device = f"cuda:{args['model_instance_device_id']}" if torch.cuda.is_available() else "cpu"
            self.service = BatchedService.from_artifact(
                folder, device=device, verify_checksums=verify, max_batch=int(params["max_batch"]),
                tree_size_by_batch=parse_tree_size_by_batch(params.get("tree_size_by_batch", "")),
                tune=params.get("tree", "manifest") == "auto")
            self.service.warm_up()
            self.service.start()  # the engine loop serves from a background thread from here on
            return
        device = f"cuda:{args['model_instance_device_id']}" if backend == "tensorrt" else "cpu"
        self.service = Service.from_artifact(folder, backend, device=device, verify_checksums=verify)
        self.service.warm_up()

    def finalize(self):
        if isinstance(getattr(self, "service", None), BatchedService):
            self.service.stop()

    def execute(self, requests):
        batched = isinstance(self.service, BatchedService)
        for request in requests:
            sender = request.get_response_sender()
            inputs = {t.name(): t.as_numpy() for t in request.inputs()}

            def send(reply, sender=sender):
                sender.send(_response(reply), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if reply.final else 0)

            def fail(message, sender=sender):
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

            try:
                if batched:  # queued for the engine; execute returns at once
                    self.service.submit(inputs, send, fail, cancelled=getattr(sender, "is_cancelled", None))
                else:
                    self.service.handle(inputs, send)
            except TreeFlashError as exc:
                fail(str(exc))
            except Exception as exc:  # a bug must not take the model down: report it, keep serving
                self.logger.log_error(f"treeflash: request failed: {type(exc).__name__}: {exc}")
                fail(f"internal error: {type(exc).__name__}: {exc}")
        return None
