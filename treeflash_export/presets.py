"""Random-weight pairs at the released models' shapes, made directly on the device.

For speed measurements that need no download: the verifier is the Hugging Face
model class built from the real config, the drafter is the TreeFlash layout at
the released drafters' shape (5 layers, block 16, the head at the verifier's
intermediate size). Weights are random, so drafts are hardly ever accepted: only
time per round and per step mean anything, never tokens per round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import DrafterConfig, default_target_layer_ids


@dataclass(frozen=True)
class Preset:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie_embeddings: bool
    draft_layers: int
    block_size: int
    rope_theta: float = 1_000_000.0


PRESETS = {
    # Qwen/Qwen3-8B and a drafter shaped like peerrh/treeflash-qwen3-8b (taps 1, 9, 17, 25, 33).
    "qwen3-8b": Preset(hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8, head_dim=128,
                       vocab=151936, tie_embeddings=False, draft_layers=5, block_size=16),
    # Qwen/Qwen3-4B (tied embeddings, head_dim 128 over a 2560-wide residual).
    "qwen3-4b": Preset(hidden=2560, intermediate=9728, layers=36, heads=32, kv_heads=8, head_dim=128,
                       vocab=151936, tie_embeddings=True, draft_layers=5, block_size=16),
    # Seconds on a CPU: for tests and for trying the benchmark anywhere.
    "tiny": Preset(hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, head_dim=16, vocab=512,
                   tie_embeddings=False, draft_layers=2, block_size=8, rope_theta=10_000.0),
}


def preset_configs(name: str):
    """(verifier Qwen3Config, drafter Qwen3Config in the TreeFlash layout) of a preset."""
    from transformers import Qwen3Config

    from .tiny import drafter_config

    try:
        p = PRESETS[name]
    except KeyError:
        from .errors import ConfigError

        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
    rope = {"rope_type": "default", "rope_theta": p.rope_theta}
    vcfg = Qwen3Config(vocab_size=p.vocab, hidden_size=p.hidden, intermediate_size=p.intermediate,
                       num_hidden_layers=p.layers, num_attention_heads=p.heads, num_key_value_heads=p.kv_heads,
                       head_dim=p.head_dim, rms_norm_eps=1e-6, max_position_embeddings=40960,
                       tie_word_embeddings=p.tie_embeddings, rope_parameters=rope)
    dcfg = drafter_config(vcfg, layers=p.draft_layers, block_size=p.block_size, head=True,
                          target_layer_ids=default_target_layer_ids(p.layers, p.draft_layers),
                          mask_token_id=p.vocab - 1)
    dcfg.rope_parameters = rope
    return vcfg, dcfg


@torch.no_grad()
def random_pair(name: str, *, device: str | torch.device, dtype: torch.dtype, seed: int = 0):
    """(verifier, drafter) with random weights (std 0.02, norms 1), built on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    from .models import TreeFlashDrafter

    vcfg, dcfg = preset_configs(name)
    torch.manual_seed(seed)
    with torch.device(device):
        verifier = AutoModelForCausalLM.from_config(vcfg, dtype=dtype, attn_implementation="sdpa")
        drafter = TreeFlashDrafter(DrafterConfig.from_hf(dcfg)).to(dtype)
    for model in (verifier, drafter):
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            elif pname.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    return verifier.eval().requires_grad_(False), drafter.eval().requires_grad_(False)


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters (a tied tensor counted once: parameters() skips repeats)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def write_random_pair(out, name: str, *, device: str | torch.device, dtype: torch.dtype, seed: int = 0, log=None):
    """Writes a random pair as checkpoints (out/verifier, out/drafter: the released layouts), for
    timing what needs files: loading, start-up before the first token. The verifier carries the tiny
    pair's stand-in tokenizer (512 entries; ids past it decode to nothing), so treeflash-run takes
    text prompts. Written atomically (a temporary folder renamed at the end)."""
    from pathlib import Path

    from .fsutil import atomic_folder
    from .tiny import build_tokenizer, save_drafter, save_verifier

    log = log or (lambda msg: None)
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    with atomic_folder(out) as tmp:
        log(f"building a random {name} pair on {device} ({str(dtype).replace('torch.', '')})")
        verifier, drafter = random_pair(name, device=device, dtype=dtype, seed=seed)
        log(f"writing {weight_bytes(verifier) / 1e9:.2f} GB of verifier and {weight_bytes(drafter) / 1e9:.2f} GB "
            f"of drafter weights to {out}")
        save_verifier(tmp / "verifier", verifier, build_tokenizer(512))
        dcfg = drafter.cfg.hf_config  # the preset's drafter config, as random_pair built it
        dcfg.dtype = dtype
        save_drafter(tmp / "drafter", dcfg, drafter.state_dict())
    return out
