"""A tiny verifier + drafter pair generated offline, in the released checkpoint layouts.

It lets the whole pipeline run on a fresh machine with no model hub: a small
byte-level BPE tokenizer trained on Python's own standard-library sources, a
random Qwen3 or Llama verifier, and a random drafter saved in the TreeFlash
layout (with head) or the DFlash layout (without). Random weights accept few
drafts; the tests add an oracle drafter for that.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .fsutil import atomic_folder

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(max_chars: int = 400_000) -> list[str]:
    """Plain text from the standard library's sources (present on every machine)."""
    import json as _json

    root = Path(_json.__file__).resolve().parent.parent
    texts, total = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return texts


def build_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def verifier_config(family: str, vocab_size: int, *, hidden: int = 64, layers: int = 4, eos: int = 0):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=4096,
        rms_norm_eps=1e-6, eos_token_id=eos, bos_token_id=eos, pad_token_id=eos,
    )
    if family == "qwen3":
        return Qwen3Config(**common, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise ValueError(f"unknown family {family!r}: use qwen3 or llama")


def drafter_config(verifier_cfg, *, layers: int = 2, block_size: int = 8, head: bool = True,
                   target_layer_ids: list[int] | None = None, mask_token_id: int | None = None):
    from transformers import Qwen3Config

    from .config import default_target_layer_ids

    L = verifier_cfg.num_hidden_layers
    ids = target_layer_ids if target_layer_ids is not None else default_target_layer_ids(L, layers)
    mask_id = mask_token_id if mask_token_id is not None else verifier_cfg.vocab_size - 1
    extra = dict(
        block_size=block_size,
        num_target_layers=L,
        dflash_config={"target_layer_ids": ids, "mask_token_id": mask_id},
    )
    if head:
        extra["treeflash_config"] = {"ar_approximation": "swiglu", "candidate_tokens": 16}
    return Qwen3Config(
        vocab_size=verifier_cfg.vocab_size, hidden_size=verifier_cfg.hidden_size,
        intermediate_size=verifier_cfg.intermediate_size, num_hidden_layers=layers,
        num_attention_heads=verifier_cfg.num_attention_heads, num_key_value_heads=verifier_cfg.num_key_value_heads,
        head_dim=getattr(verifier_cfg, "head_dim", None) or verifier_cfg.hidden_size // verifier_cfg.num_attention_heads,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        architectures=["TreeFlashDraftModel" if head else "DFlashDraftModel"], **extra,
    )


def random_drafter_state(cfg, seed: int) -> dict[str, torch.Tensor]:
    """Random weights in the TreeFlash key layout; the head's down projection is non-zero
    so the head really changes the tables (an untrained head would be all-zero)."""
    from .config import DrafterConfig
    from .models import TreeFlashDrafter

    torch.manual_seed(seed)
    model = TreeFlashDrafter(DrafterConfig.from_hf(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.dim() >= 2 or name.endswith("bias"):
                p.normal_(0, 0.2 if name.startswith("ar_approximation") else 0.08)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def save_verifier(folder: Path, model, tok) -> None:
    """A verifier checkpoint with its tokenizer; generation stops and pads at the tokenizer's EOS."""
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def save_drafter(folder: Path, cfg, state: dict[str, torch.Tensor]) -> None:
    """A drafter checkpoint in the released layout: config.json and model.safetensors."""
    from safetensors.torch import save_file

    folder.mkdir()
    cfg.save_pretrained(folder)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def write_tiny_pair(out: str | os.PathLike, *, family: str = "qwen3", seed: int = 0, hidden: int = 64,
                    layers: int = 4, draft_layers: int = 2, block_size: int = 8, vocab_size: int = 512,
                    layout: str = "treeflash") -> Path:
    """Writes out/verifier and out/drafter atomically (a temporary folder renamed at the end)."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    with atomic_folder(out) as tmp:
        tok = build_tokenizer(vocab_size)
        eos = tok.convert_tokens_to_ids("<|endoftext|>")
        vcfg = verifier_config(family, len(tok), hidden=hidden, layers=layers, eos=eos)
        torch.manual_seed(seed)
        vcfg.initializer_range = 0.08
        save_verifier(tmp / "verifier", AutoModelForCausalLM.from_config(vcfg), tok)

        dcfg = drafter_config(vcfg, layers=draft_layers, block_size=block_size, head=layout == "treeflash",
                              mask_token_id=tok.convert_tokens_to_ids("<|mask|>"))
        state = random_drafter_state(dcfg, seed + 1)
        if layout == "dflash":
            state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
        elif layout != "treeflash":
            raise ValueError(f"unknown layout {layout!r}: use treeflash or dflash")
        save_drafter(tmp / "drafter", dcfg, state)
    return out
