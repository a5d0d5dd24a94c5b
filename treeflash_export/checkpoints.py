"""Loading verifiers and drafters from local folders or hub ids, and validating the pair.

Drafter layouts:
- TreeFlash: ``model.layers.*``, ``model.fc``, ``model.hidden_norm``, ``model.norm`` and,
  with a head, ``ar_approximation.{ug,d,norm}``.
- DFlash: the same backbone without the ``model.`` prefix and without a head.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .config import DrafterConfig
from .errors import CheckpointError, TreeFlashError
from .presets import weight_bytes

SUPPORTED_VERIFIERS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype by name; "auto" is bfloat16 on a CUDA device and float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r}; choose one of float32, float16, bfloat16") from None


def pick_device(device: str) -> str:
    """"auto" is CUDA when this torch build sees a GPU, else the CPU; a CUDA device asked for
    without one is an error."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise TreeFlashError(f"--device {device} asked for, but this torch build sees no CUDA GPU")
    return device


def resolve_checkpoint(name_or_path: str | os.PathLike, what: str) -> Path:
    """A local folder, or a hub id found in the local cache (downloaded when the network allows)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{what} folder {path} has no config.json; is it a Hugging Face checkpoint?")
        return path
    text = str(name_or_path)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise CheckpointError(f"{what} {text!r} is not a folder and not a hub id of the form owner/name")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(text, local_files_only=True))
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise CheckpointError(
            f"{what} {text!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
            f"download it first with `huggingface-cli download {text}` or pass a local folder"
        )
    try:
        return Path(snapshot_download(text))
    except Exception as exc:  # network failures, unknown repos, gated repos
        raise CheckpointError(
            f"{what} {text!r} is not cached locally and could not be downloaded ({type(exc).__name__}); "
            f"run `huggingface-cli download {text}` on a machine with network access, or pass a local folder"
        ) from None


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {folder / 'config.json'}: {exc}") from None


def load_verifier(folder: Path, *, dtype: torch.dtype, device: str | torch.device):
    """The Hugging Face causal LM (eval mode, no grad) from a resolved folder."""
    model_type = _read_config(folder).get("model_type")
    if model_type not in SUPPORTED_VERIFIERS:
        raise CheckpointError(
            f"verifier model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_VERIFIERS)}"
        )
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    except Exception as exc:
        raise CheckpointError(f"cannot load verifier from {folder}: {type(exc).__name__}: {exc}") from None
    return model.to(device).eval().requires_grad_(False)


def checkpoint_fingerprint(folder: Path, samples: int = 16, chunk: int = 1 << 16) -> str:
    """Names a checkpoint folder by its content rather than its path, cheaply: every file at its top
    level (config, tokenizer, weights) by name, size and ``samples`` evenly spaced chunks of
    ``chunk`` bytes, the first and last among them (a small file is read whole). A folder moved or
    copied keeps its name; new weights or a new tokenizer at the same path change it (a retrained
    model's weights differ everywhere). What is cached from a model (training data) is keyed by it."""
    h = hashlib.sha256()
    for path in sorted(p for p in Path(folder).iterdir() if p.is_file() and not p.name.startswith(".")):
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            if size <= samples * chunk:
                h.update(f.read())
                continue
            for i in range(samples):
                f.seek((size - chunk) * i // (samples - 1))
                h.update(f.read(chunk))
    return h.hexdigest()[:16]


def _safetensors_header(path: Path) -> bytes:
    """The JSON header of a safetensors file (tensor names, dtypes, shapes, offsets): 8 bytes of
    little-endian length, then the header. Reading it costs one small read, whatever the file size."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100_000_000:
            raise ValueError(f"{path.name}: not a safetensors file (header of {n} bytes)")
        return f.read(n)


def pair_fingerprint(*sources) -> str:
    """A short hash of what a round's costs depend on: the shapes and dtypes of the pair, not the
    values of its weights (timing does not depend on them), so it is cheap and survives copies.

    Each source is one of:
    - a folder or a file path: *.json files by content (configs, tokenizers), *.safetensors by their
      header (names, dtypes, shapes) and size, any other file (ONNX, engines, .bin) by name, size
      and modification time; folders recursively, hidden entries skipped;
    - a state dict (a mapping whose values have .shape and .dtype): names, shapes and dtypes;
    - any other mapping (e.g. a config dict): its JSON.
    """
    h = hashlib.sha256()

    def add(tag: str, payload: bytes) -> None:
        h.update(f"{tag}:{len(payload)}:".encode())
        h.update(payload)

    def add_file(path: Path, name: str) -> None:
        if path.suffix == ".json":
            add(f"json {name}", path.read_bytes())
        elif path.suffix == ".safetensors":
            add(f"safetensors {name} {path.stat().st_size}", _safetensors_header(path))
        else:
            st = path.stat()
            add(f"file {name}", f"{st.st_size} {st.st_mtime_ns}".encode())

    for src in sources:
        if isinstance(src, Mapping):
            items = sorted(src.items(), key=lambda kv: str(kv[0]))
            if items and all(hasattr(v, "shape") and hasattr(v, "dtype") for _, v in items):
                add("state_dict", "\n".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in items).encode())
            else:
                add("mapping", json.dumps(src, sort_keys=True, default=str).encode())
            continue
        path = Path(src)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*")
                           if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
            add("folder", str(len(files)).encode())
            for p in files:
                add_file(p, p.relative_to(path).as_posix())
        elif path.is_file():
            add_file(path, path.name)
        else:
            raise FileNotFoundError(f"cannot fingerprint {path}: no such file or folder")
    return h.hexdigest()[:16]


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise CheckpointError(f"cannot load a tokenizer from {folder}: {type(exc).__name__}: {exc}") from None


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"drafter folder {folder} has no model.safetensors (or sharded index)")


def read_drafter_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(folder):
        try:
            state.update(load_file(str(f)))
        except Exception as exc:
            raise CheckpointError(f"cannot read drafter weights {f}: {exc}") from None
    return state


def normalise_drafter_keys(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """Map either released layout onto the TreeFlash key names; returns (state, layout)."""
    if any(k.startswith("model.layers.") for k in state):
        return state, "treeflash"
    if any(k.startswith("layers.") for k in state):
        return {f"model.{k}": v for k, v in state.items()}, "dflash"
    sample = ", ".join(sorted(state)[:3])
    raise CheckpointError(
        f"unknown drafter layout (expected keys under 'model.layers.' or 'layers.', found e.g. {sample})"
    )


def load_drafter(folder: Path, *, dtype: torch.dtype, device: str | torch.device):
    """(TreeFlashDrafter, DrafterConfig, layout) with strict key checking."""
    from transformers import AutoConfig

    from .models import TreeFlashDrafter, draft_vocab

    try:
        hf_cfg = AutoConfig.from_pretrained(folder)
    except Exception as exc:
        raise CheckpointError(f"cannot read drafter config in {folder}: {exc}") from None
    cfg = DrafterConfig.from_hf(hf_cfg)
    state, layout = normalise_drafter_keys(read_drafter_state(folder))
    if layout == "dflash" and cfg.has_head:
        raise CheckpointError("drafter config asks for an AR-approximation head but the weights are in the "
                              "DFlash layout, which has none")
    with torch.device("meta"):  # no random initialisation: every parameter comes from the checkpoint
        model = TreeFlashDrafter(cfg)
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} keys (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} keys (e.g. {', '.join(unexpected[:3])})")
        raise CheckpointError(f"drafter weights in {folder} do not match its config: " + "; ".join(parts))
    # Each tensor goes to the device in the run's dtype once, and becomes the parameter itself.
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=True, assign=True)
    model.model.reset_rope()
    model.vocab_order = draft_vocab.read(folder, cfg.vocab_size)
    return model.eval().requires_grad_(False), cfg, layout


def validate_pair(verifier_cfg: Any, drafter: DrafterConfig) -> None:
    """Checks that need both models; each failure is one line naming both values."""
    vh, vv = int(verifier_cfg.hidden_size), int(verifier_cfg.vocab_size)
    vl = int(verifier_cfg.num_hidden_layers)
    if drafter.hidden_size != vh:
        raise CheckpointError(f"hidden size mismatch: drafter {drafter.hidden_size}, verifier {vh}")
    if drafter.vocab_size != vv:
        raise CheckpointError(f"vocabulary size mismatch: drafter {drafter.vocab_size}, verifier {vv}")
    if drafter.num_target_layers is not None and drafter.num_target_layers != vl:
        raise CheckpointError(
            f"layer count mismatch: drafter was trained on a {drafter.num_target_layers}-layer verifier, "
            f"this verifier has {vl}"
        )
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < vl]
    if bad:
        raise CheckpointError(
            f"target_layer_ids {list(drafter.target_layer_ids)} out of range: verifier has layers 0..{vl - 1}"
        )
    if not 0 <= drafter.mask_token_id < vv:
        raise CheckpointError(f"mask_token_id {drafter.mask_token_id} out of range: verifier vocabulary is {vv}")


END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>")


def end_of_turn_ids(tokenizer) -> set[int]:
    """The end-of-turn tokens that the tokenizer's chat template writes after a turn (a chat answer
    ends there even where the tokenizer's EOS is another token); none without a chat template."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return set()
    ids = set()
    for name in END_OF_TURN_TOKENS:
        if name in template:
            tid = tokenizer.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None):
                ids.add(tid)
    return ids


def eos_token_ids(tokenizer, model) -> list[int]:
    """The ids that end a generation by default: EOS from the tokenizer and the model's generation
    config (either may list several), and the chat template's end-of-turn token."""
    ids = set()
    for source in (getattr(tokenizer, "eos_token_id", None),
                   getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    if tokenizer is not None:
        ids |= end_of_turn_ids(tokenizer)
    return sorted(ids)


@dataclass
class LoadedPair:
    verifier: Any  # Hugging Face causal LM
    drafter: Any  # TreeFlashDrafter or None (plain decoding)
    drafter_cfg: DrafterConfig | None
    tokenizer: Any
    verifier_path: Path
    drafter_path: Path | None
    drafter_layout: str | None
    seconds: dict[str, float] = field(default_factory=dict)  # what loading took: tokenizer, verifier, drafter


def load_pair(model: str, drafter: str | None, *, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu", need_tokenizer: bool = True,
              check: Callable[[Any, DrafterConfig | None], None] | None = None,
              log: Callable[[str], None] | None = None) -> LoadedPair:
    """Resolve, validate configs first (no weights touched), then load both models.

    ``check(verifier_config, drafter_config)`` runs after the pair checks and before any
    weights are read, so settings errors surface in seconds even for large models.
    ``log`` gets a line per model loaded (its size and the seconds it took); the seconds are
    also in the result's ``seconds``.
    """
    vpath = resolve_checkpoint(model, "verifier")
    dpath = resolve_checkpoint(drafter, "drafter") if drafter else None
    from transformers import AutoConfig

    try:
        vcfg = AutoConfig.from_pretrained(vpath)
    except Exception as exc:
        raise CheckpointError(f"cannot read verifier config in {vpath}: {exc}") from None
    dcfg = None
    if dpath is not None:
        try:
            dcfg = DrafterConfig.from_hf(AutoConfig.from_pretrained(dpath))
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"cannot read drafter config in {dpath}: {exc}") from None
        validate_pair(vcfg, dcfg)
    if check is not None:
        check(vcfg, dcfg)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    tok = load_tokenizer(vpath) if need_tokenizer else None
    seconds["tokenizer"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    verifier = load_verifier(vpath, dtype=dtype, device=device)
    seconds["verifier"] = time.perf_counter() - t0
    _log_loaded(log, "verifier", verifier, seconds["verifier"])
    dmodel, layout = None, None
    if dpath is not None:
        t0 = time.perf_counter()
        dmodel, dcfg, layout = load_drafter(dpath, dtype=dtype, device=device)
        seconds["drafter"] = time.perf_counter() - t0
        _log_loaded(log, f"drafter ({layout} layout)", dmodel, seconds["drafter"])
    return LoadedPair(verifier, dmodel, dcfg, tok, vpath, dpath, layout, seconds)


def _log_loaded(log: Callable[[str], None] | None, what: str, model: torch.nn.Module, seconds: float) -> None:
    if log is None:
        return
    size = weight_bytes(model)
    amount = f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"
    first = next(model.parameters())
    log(f"loaded {what}: {amount}, {str(first.dtype).replace('torch.', '')} on {first.device}, in {seconds:.1f}s")
