"""`treeflash-export triton-repo`: an artifact folder -> a Triton Inference Server model repository.

Layout written (whole, atomically):

    REPO/README.md                    how to start a server on this repository (generated facts)
    REPO/treeflash/config.pbtxt       decoupled Python-backend model running the whole round loop
    REPO/treeflash/1/model.py         imports the adapter, treeflash_runtime.serving.triton_model
    REPO/treeflash/1/artifact/        the artifact itself (hard links where possible, else copies)
    REPO/treeflash_<graph>/           tensorrt artifacts only: one tensorrt_plan model per engine
        config.pbtxt, 1/model.plan

Every config.pbtxt is rendered from data (the graphs' I/O specs and SERVING_INPUTS /
SERVING_OUTPUTS below) by a small protobuf text-format writer: nothing is filled into a
template, so nothing can be left unfilled. This module never imports the runtime; the
runtime imports the serving I/O spec from here, so names and dtypes have one source. The
model.py written here only names the runtime's adapter, which the server's Python environment
imports from the installed package.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .artifact import Artifact, ArtifactError, load_artifact
from ..errors import TreeFlashError
from ..fsutil import atomic_folder
from .graphs import GraphSpec

MODEL_NAME = "treeflash"
GRAPHS = ("verify", "draft", "expand")
ARTIFACT_SUBDIR = "1/artifact"  # inside the treeflash model folder
BACKENDS = ("auto", "onnxruntime", "tensorrt", "torch")

# dtype names of the I/O specs -> Triton's DataType enum.
TRITON_DTYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16",
                 "int64": "TYPE_INT64", "int32": "TYPE_INT32", "uint64": "TYPE_UINT64",
                 "bool": "TYPE_BOOL", "string": "TYPE_STRING"}
# The same names -> NumPy dtypes of request and response arrays (strings travel as bytes objects).
NUMPY_DTYPES = {"float32": "float32", "int32": "int32", "uint64": "uint64", "bool": "bool", "string": "object"}


@dataclass(frozen=True)
class ServingTensor:
    """One input or output of the `treeflash` model. dims exclude the batch axis (max_batch_size 1:
    every tensor travels with a leading axis of 1, as TensorRT-LLM's clients send them)."""

    name: str
    dtype: str  # a key of TRITON_DTYPES
    dims: tuple[int, ...]
    optional: bool = False
    doc: str = ""


# Names and dtypes follow TensorRT-LLM's tensorrt_llm_bls / ensemble models, so their clients work.
SERVING_INPUTS = (
    ServingTensor("text_input", "string", (-1,), doc="the prompt: one UTF-8 string"),
    ServingTensor("max_tokens", "int32", (-1,), doc="new tokens to generate at most: one value >= 1"),
    ServingTensor("stream", "bool", (1,), True, "true: one response per round; false (default): one response"),
    ServingTensor("temperature", "float32", (1,), True, "the verifier's temperature; 0 (default) is greedy"),
    ServingTensor("top_p", "float32", (1,), True, "the verifier's nucleus mass (default 1)"),
    ServingTensor("random_seed", "uint64", (1,), True, "seed of the verifier's sampling (default 0)"),
    ServingTensor("end_id", "int32", (1,), True, "token id that ends generation instead of the model's EOS "
                  "ids; -1: none"),
    ServingTensor("stop_words", "string", (-1,), True, "strings that end generation; the text is cut after "
                  "the first one"),
)
SERVING_OUTPUTS = (
    ServingTensor("text_output", "string", (-1,), doc="streamed: the new text of this response; else the "
                  "whole text"),
    ServingTensor("output_ids", "int32", (-1,), doc="the token ids of this response (new tokens only)"),
    ServingTensor("new_tokens", "int32", (1,), doc="tokens generated so far"),
    ServingTensor("rounds", "int32", (1,), doc="speculative rounds so far"),
    ServingTensor("mean_accepted", "float32", (1,), doc="tokens gained per round so far (block efficiency)"),
    ServingTensor("stop_reason", "string", (1,), doc="empty until the last response: stop_token, stop_word "
                  "or max_new_tokens"),
)


class PbEnum(str):
    """A protobuf enum value: written without quotes."""


def to_pbtxt(message: dict, indent: int = 0) -> str:
    """Protobuf text format of a message given as a dict (repeated fields as lists)."""
    return "\n".join(_lines(message, indent)) + "\n"


def _scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, PbEnum):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (int, float)):
        return repr(v)
    raise TypeError(f"cannot write {v!r} in a config.pbtxt")


def _lines(message: dict, indent: int) -> list[str]:
    pad, out = "  " * indent, []
    for key, val in message.items():
        if isinstance(val, dict):
            out += [f"{pad}{key} {{", *_lines(val, indent + 1), f"{pad}}}"]
        elif isinstance(val, list) and val and all(isinstance(v, dict) for v in val):
            out.append(f"{pad}{key} [")
            for i, v in enumerate(val):
                out += [f"{pad}  {{", *_lines(v, indent + 2), f"{pad}  }}" + ("," if i < len(val) - 1 else "")]
            out.append(f"{pad}]")
        elif isinstance(val, (list, tuple)):
            out.append(f"{pad}{key}: [ {', '.join(_scalar(v) for v in val)} ]")
        else:
            out.append(f"{pad}{key}: {_scalar(val)}")
    return out


def _param(key: str, value: str) -> dict:
    return {"key": key, "value": {"string_value": value}}


def plan_model_config(name: str, spec: GraphSpec, instances: int) -> dict:
    """A tensorrt_plan model for one engine: shapes exactly as the engine has them (no batch axis,
    dynamic axes -1) and a warm-up request with zeros at the optimisation profile's opt shape."""

    def dims(shape, pick=None):
        return [d if isinstance(d, int) else (-1 if pick is None else spec.dynamic[d][pick]) for d in shape]

    def tensors(specs):
        return [{"name": s.name, "data_type": PbEnum(TRITON_DTYPES[s.dtype]), "dims": dims(s.shape)} for s in specs]

    return {
        "name": name,
        "platform": "tensorrt_plan",
        "max_batch_size": 0,
        "input": tensors(spec.inputs),
        "output": tensors(spec.outputs),
        "instance_group": [{"count": instances, "kind": PbEnum("KIND_GPU")}],
        "model_warmup": [{
            "name": "zeros_at_opt_shape",
            "batch_size": 1,
            "inputs": [{"key": s.name, "value": {"data_type": PbEnum(TRITON_DTYPES[s.dtype]), "dims": dims(s.shape, 1),
                                                 "zero_data": True}} for s in spec.inputs],
        }],
    }


def python_model_config(backend: str, instances: int, max_batch: int = 8, tree_size_by_batch: str = "",
                        tree: str = "auto") -> dict:
    """backend torch: one instance serves up to max_batch requests at once with in-flight batching
    (KIND_MODEL: the model takes the instance's GPU when the server has one, else the CPU); the
    graph backends serve one generation at a time per instance. tree (torch): 'auto', the
    self-tuning tree chooses per batch bucket within the artifact's tree, or 'manifest', the
    artifact's settings (and tree_size_by_batch, which implies it)."""
    def tensors(specs):
        return [{"name": s.name, "data_type": PbEnum(TRITON_DTYPES[s.dtype]), "dims": list(s.dims),
                 **({"optional": True} if s.optional else {})} for s in specs]

    return {
        "name": MODEL_NAME,
        "backend": "python",
        "max_batch_size": 1,
        "model_transaction_policy": {"decoupled": True},
        "input": tensors(SERVING_INPUTS),
        "output": tensors(SERVING_OUTPUTS),
        # Graph backends: one generation at a time per instance (each holds its own caches); more
        # instances serve requests side by side at the cost of one copy of the model each. torch:
        # one instance batches many requests in flight (its execute queues them and returns).
        "instance_group": [{"count": instances, "kind": PbEnum(
            {"tensorrt": "KIND_GPU", "torch": "KIND_MODEL"}.get(backend, "KIND_CPU"))}],
        "parameters": [_param("backend", backend), _param("artifact", ARTIFACT_SUBDIR),
                       _param("verify_checksums", "true")]
                      + ([_param("max_batch", str(max_batch)), _param("tree_size_by_batch", tree_size_by_batch),
                          _param("tree", "manifest" if tree_size_by_batch else tree)]
                         if backend == "torch" else []),
    }


def needs_plugins(art: Artifact) -> bool:
    return art.manifest["build"].get("variant", "reference") == "plugin"


def resolve_backend(art: Artifact, backend: str) -> str:
    target = art.manifest["build"]["target"]
    if backend not in BACKENDS:
        raise TreeFlashError(f"unknown --backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "tensorrt" if target == "tensorrt" else "onnxruntime"
    if backend == "torch":  # the models over the artifact's source checkpoints (folders or hub ids), any dtype
        return backend
    if backend == "tensorrt" and target != "tensorrt":
        raise ArtifactError(f"--backend tensorrt needs TensorRT engines, but {art.root} was built with --target "
                            f"{target}: rebuild it with --target tensorrt, or use --backend onnxruntime")
    if backend == "onnxruntime" and art.dtype == "bfloat16":
        raise ArtifactError(f"{art.root} is bfloat16, which the ONNX Runtime backend does not run: use "
                            f"--backend tensorrt, or rebuild with --dtype float32")
    return backend


def _link_or_copy(src, dst) -> None:
    """A hard link on the same filesystem (no second copy of the weights), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def server_readme(art: Artifact, backend: str, plan_models: list[str]) -> str:
    lines = [
        "# Triton model repository for a TreeFlash artifact",
        "",
        f"Written by `treeflash-export triton-repo` from an artifact built with --target "
        f"{art.manifest['build']['target']}, --dtype {art.dtype}, --mode {art.tree.mode}, "
        f"--tree-size {art.tree.tree_size}, --max-seq-len {art.shapes.capacity}.",
        "",
        f"- `{MODEL_NAME}`: decoupled Python-backend model; runs the whole speculative loop on the "
        f"`{backend}` backend in process, from its own copy of the artifact (`{MODEL_NAME}/{ARTIFACT_SUBDIR}`).",
        "  Its Python backend must import `treeflash_runtime`: install treeflash-export into the Python "
        "environment the server's Python backend uses.",
        ("  torch: each instance batches requests in flight (`max_batch` parameter: request slots, each "
         "with its own cache of the artifact's --max-seq-len), on its GPU when the server has one, else on "
         "the CPU; it serves the artifact's source checkpoints, whose paths the manifest records."
         if backend == "torch" else
         "  One generation at a time per instance: more instances serve requests side by side, each with "
         "its own copy of the model (in-flight batching: `--backend torch`)."),
    ]
    if plan_models:
        trt = art.manifest["versions"].get("tensorrt")
        lines += [
            f"- {', '.join(f'`{m}`' for m in plan_models)}: one tensorrt_plan model per engine "
            f"(max_batch_size 0; the engines' own static shapes). The engines were built with TensorRT {trt}: "
            f"serve them with a Triton release whose TensorRT is exactly {trt} (engines are not portable "
            f"across TensorRT versions).",
        ]
    if needs_plugins(art):
        lines += [
            "",
            "## Plugins",
            "",
            "These engines contain TreeFlash's TensorRT plugins (built with --variant plugin). The "
            f"`{MODEL_NAME}` model registers them itself (`treeflash_plugins.load_plugins()`, needs "
            "`tensorrt` >= 10.8 with `tensorrt.plugin` and `triton` in the Python backend's environment) "
            "before it deserialises the engines. The tensorrt_plan models are loaded by Triton's C++ "
            "TensorRT backend, where no Python plugin registration runs: they load only if the server "
            "finds the plugin creators (for example when the engines embed their ahead-of-time plugin "
            "kernels). If they fail to load, delete their folders: the treeflash model does not use them.",
        ]
    return "\n".join(lines) + "\n"


# The treeflash model's 1/model.py: Triton's Python backend loads the class this file names.
MODEL_PY = '''"""The `treeflash` model (written by `treeflash-export triton-repo`): Triton's Python backend
takes the class below, the adapter installed with the treeflash-export package."""

from treeflash_runtime.serving.triton_model import TritonPythonModel  # noqa: F401
'''

_PLACEHOLDER = re.compile(r"\$\{|\{\{|\}\}|%\(|<[A-Z_]+>|TODO")


def _check_whole(path: Path) -> None:
    """Generated text must not carry anything that looks like an unfilled template slot."""
    text = path.read_text()
    m = _PLACEHOLDER.search(text)
    if m:
        raise TreeFlashError(f"internal error: {path.name} has a placeholder-like {m.group(0)!r}")


def write_triton_repo(artifact_dir: str | Path, out: str | Path, *, backend: str = "auto", instances: int = 1,
                      max_batch: int = 8, tree_size_by_batch: str = "", force: bool = False,
                      log: Callable[[str], None] = print, tree: str = "auto") -> Path:
    out = Path(out)
    if instances < 1:
        raise TreeFlashError(f"--instances must be >= 1, got {instances}")
    if max_batch < 1:
        raise TreeFlashError(f"--max-batch must be >= 1, got {max_batch}")
    if tree not in ("auto", "manifest"):
        raise TreeFlashError(f"--tree {tree!r}: use auto or manifest")
    if tree_size_by_batch and not re.fullmatch(r"\s*\d+\s*:\s*\d+\s*(,\s*\d+\s*:\s*\d+\s*)*,?\s*", tree_size_by_batch):
        raise TreeFlashError(f"--tree-size-by-batch {tree_size_by_batch!r} is not BATCH:TREE_SIZE,... (e.g. 1:64,4:32)")
    art = load_artifact(artifact_dir)  # checksums first: never publish a corrupted artifact
    backend = resolve_backend(art, backend)
    if out.exists() and not force:
        raise TreeFlashError(f"{out} already exists; pass --force to replace it or choose another --out")
    if out.resolve() == art.root.resolve() or art.root.resolve() in out.resolve().parents:
        raise TreeFlashError(f"--out {out} is inside the artifact folder; choose a folder outside it")
    plan_models = []
    with atomic_folder(out) as tmp:
        written = []
        if art.manifest["build"]["target"] == "tensorrt":
            for g in GRAPHS:
                name = f"{MODEL_NAME}_{g}"
                (tmp / name / "1").mkdir(parents=True)
                _link_or_copy(art.path(g, "engine"), tmp / name / "1" / "model.plan")
                written.append(tmp / name / "config.pbtxt")
                written[-1].write_text(to_pbtxt(plan_model_config(name, art.spec(g), instances)))
                plan_models.append(name)
                log(f"    {name}: tensorrt_plan model")
        model = tmp / MODEL_NAME
        (model / "1").mkdir(parents=True)
        written.append(model / "config.pbtxt")
        written[-1].write_text(to_pbtxt(python_model_config(backend, instances, max_batch, tree_size_by_batch, tree)))
        written.append(model / "1" / "model.py")
        written[-1].write_text(MODEL_PY)
        shutil.copytree(art.root, model / ARTIFACT_SUBDIR, copy_function=_link_or_copy)
        log(f"    {MODEL_NAME}: decoupled Python model over the {backend} backend"
            + (f", up to {max_batch} requests batched in flight per instance" if backend == "torch" else ""))
        written.append(tmp / "README.md")
        written[-1].write_text(server_readme(art, backend, plan_models))
        for path in written:
            _check_whole(path)
        load_artifact(model / ARTIFACT_SUBDIR)  # the copy is complete and intact
    log(f"Triton model repository written to {out}")
    return out
