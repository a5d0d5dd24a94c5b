"""The artifact folder: its manifest, checksums, and the checks a runtime does before trusting it.

Layout:
    manifest.json            written last; its presence marks a complete build
    onnx/<graph>.onnx(.data) the traced graphs (external data beside large ones)
    engines/<graph>.plan     TensorRT engines (target tensorrt), or <graph>.rtx.plan (tensorrt-rtx)
    tokenizer/               the verifier's tokenizer, so the runtime needs no checkpoint
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..config import TreeConfig
from ..errors import TreeFlashError
from .graphs import GraphSpec, Shapes

FORMAT = "treeflash-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class ArtifactError(TreeFlashError):
    """The artifact folder is incomplete, corrupted, or does not match what was asked for."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_table(root: Path) -> dict[str, dict]:
    """Checksum and size of every file under root except the manifest."""
    table = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            table[p.relative_to(root).as_posix()] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    return table


@dataclass
class Artifact:
    root: Path
    manifest: dict

    @property
    def tree(self) -> TreeConfig:
        return TreeConfig(**self.manifest["tree"])

    @property
    def shapes(self) -> Shapes:
        return Shapes(**self.manifest["shapes"])

    @property
    def dtype(self) -> str:
        return self.manifest["build"]["dtype"]

    def spec(self, graph: str) -> GraphSpec:
        return GraphSpec.from_dict(self.manifest["graphs"][graph]["spec"])

    def path(self, graph: str, kind: str) -> Path:
        rel = self.manifest["graphs"][graph].get(kind)
        if not rel:
            raise ArtifactError(f"artifact {self.root} has no {kind} for graph {graph!r} "
                                f"(built with --target {self.manifest['build']['target']})")
        return self.root / rel

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(self.manifest.get("stop_token_ids", ()))


def load_artifact(root: str | Path, *, verify_checksums: bool = True) -> Artifact:
    """Read and check an artifact folder; every problem is one ArtifactError line."""
    root = Path(root)
    if not root.is_dir():
        raise ArtifactError(f"artifact folder {root} does not exist")
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"{root} has no {MANIFEST}: not a complete artifact (an interrupted build?); "
                            f"rebuild it with treeflash-export build")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{mpath} is unreadable: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{mpath} is not a TreeFlash artifact manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"artifact format version {manifest.get('format_version')} is not supported "
                            f"by this treeflash-export (expects {FORMAT_VERSION}); rebuild the artifact")
    for rel, info in manifest.get("files", {}).items():
        p = root / rel
        if not p.is_file():
            raise ArtifactError(f"artifact file {rel} is missing from {root}")
        if p.stat().st_size != info["bytes"]:
            raise ArtifactError(f"artifact file {rel} has {p.stat().st_size} bytes, manifest says {info['bytes']}")
        if verify_checksums and sha256_file(p) != info["sha256"]:
            raise ArtifactError(f"artifact file {rel} does not match its checksum: the folder is corrupted; rebuild it")
    return Artifact(root, manifest)


def check_tree_request(artifact: Artifact, requested: dict) -> None:
    """Tree settings given on the command line must match the ones the graphs were built with."""
    built = artifact.manifest["tree"]
    for key, value in requested.items():
        if value is not None and built.get(key) != value:
            raise ArtifactError(
                f"artifact was built with {key.replace('_', '-')} {built.get(key)}, not {value}: "
                f"omit the option or rebuild with treeflash-export build --{key.replace('_', '-')} {value}"
            )
