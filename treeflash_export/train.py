"""`treeflash-export train`: a DFlash-style drafter and the TreeFlash head for a given verifier.

Data: the verifier's own greedy continuations of prompts cut from a real offline
corpus (Python's standard-library sources: code, comments and docstrings),
generated in batches once and cached together with the tapped hidden states the
drafter reads. Files are split into training and held-out sets (every tenth file
is held out), so held-out prompts never come from a training file.

Loss: for random anchors a (several per sequence, trained in one call under DFlash's block
mask), the block [x_a, MASK x (B-1)] must predict
x_{a+1..a+B-1}: cross-entropy of the marginal logits plus cross-entropy of the
head's conditional logits given the true previous token, with position-decay
weights exp(-(k-1)/gamma). Backbone and head train jointly; the head's down
projection starts at zero (an untrained head is the marginal drafter).
Checkpoints are atomic and carry optimiser and RNG state, so a resumed run
continues exactly where it stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .config import DrafterConfig, default_target_layer_ids
from .errors import ConfigError
from .fsutil import atomic_folder


@dataclass(frozen=True)
class TrainConfig:
    block_size: int = 8
    draft_layers: int = 1
    intermediate_size: int | None = None  # None = the verifier's (lets layers start from the verifier's)
    num_taps: int = 3  # tapped verifier layers (target_layer_ids spread over the verifier)
    train_prompts: int = 10240
    heldout_prompts: int = 96
    prompt_tokens: int = 48
    continuation_tokens: int = 96
    gen_batch: int = 256
    steps: int = 4800
    batch_size: int = 8
    anchors: int = 16  # random anchors per sequence per step, all trained in one drafter call
    loss_vocab: str = "data"  # "data": softmax over the tokens of the training data; "full": all
    lr: float = 1e-3
    warmup: int = 100
    decay_gamma: float = 4.0
    eval_every: int = 100
    save_every: int = 100
    seed: int = 0

    def validate(self) -> None:
        if self.block_size < 2:
            raise ConfigError("--block-size must be >= 2")
        if self.continuation_tokens < self.block_size + 1:
            raise ConfigError("--continuation-tokens must exceed the block size")
        for name in ("steps", "batch_size", "anchors", "train_prompts", "heldout_prompts", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if self.loss_vocab not in ("data", "full"):
            raise ConfigError("--loss-vocab must be data or full")

    def data_key(self, verifier: str, split: str) -> str:
        """Names the cached data of one split. The prompt count is not part of it: a cache of
        more or fewer prompts of the same stream is reused for its leading prompts."""
        fields = (verifier, self.num_taps, split, self.prompt_tokens, self.continuation_tokens, self.seed)
        return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- data


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the standard library, every tenth file held out."""
    import json as _json

    root = Path(_json.__file__).resolve().parent.parent
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts
                   and p.stat().st_size > 2000)
    return [f for i, f in enumerate(files) if i % 10], [f for i, f in enumerate(files) if i % 10 == 0]


def sample_prompts(files: list[Path], tokenizer, count: int, length: int, rng: random.Random) -> list[list[int]]:
    """Windows of `length` tokens starting at a line start of a random file."""
    prompts: list[list[int]] = []
    tries = 0
    while len(prompts) < count and tries < count * 20:
        tries += 1
        text = rng.choice(files).read_text(encoding="utf-8", errors="ignore")
        starts = [i + 1 for i, ch in enumerate(text) if ch == "\n"]
        if not starts:
            continue
        start = rng.choice(starts)
        ids = tokenizer(text[start : start + 40 * length], add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            prompts.append(ids[:length])
    if len(prompts) < count:
        raise ConfigError(f"could only cut {len(prompts)} prompts of {length} tokens from the corpus")
    return prompts


@torch.inference_mode()
def generate_data(verifier, prompts: list[list[int]], tap_ids: list[int], new_tokens: int, batch: int,
                  progress: Callable | None = None) -> dict[str, torch.Tensor]:
    """Greedy continuations (no EOS stop) and the tapped hidden states of every position.

    One pass per batch: the prompt's prefill, then one cached step per new token, keeping
    the taps of each step (no second pass over the finished sequences). `progress(done,
    total)` counts generated tokens. Runs on the verifier's device; the result is on the CPU."""
    from transformers import StaticCache

    tokens, feats = [], []
    total, done = len(prompts) * new_tokens, 0
    dev = verifier.device

    def taps(out):
        return torch.cat([out.hidden_states[t + 1] for t in tap_ids], dim=-1).to(torch.float16)

    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i : i + batch], device=dev)
        length = ids.shape[1]
        # A preallocated cache: a growing one is copied whole at every step.
        cache = StaticCache(config=verifier.config, max_cache_len=length + new_tokens)
        out = verifier(ids, past_key_values=cache, use_cache=True, output_hidden_states=True, logits_to_keep=1,
                       cache_position=torch.arange(length, device=dev))
        seq, feat = [ids], [taps(out)]
        for pos in range(length, length + new_tokens):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            seq.append(nxt)
            out = verifier(nxt, past_key_values=cache, use_cache=True, output_hidden_states=True,
                           cache_position=torch.tensor([pos], device=dev))
            feat.append(taps(out))
            done += len(ids)
            if progress:
                progress(done, total)
        tokens.append(torch.cat(seq, dim=1).to(torch.int32).cpu())
        feats.append(torch.cat(feat, dim=1).cpu())
    return {"tokens": torch.cat(tokens), "features": torch.cat(feats)}


# ---------------------------------------------------------------- model and loss


def make_drafter_config(verifier_cfg, cfg: TrainConfig, mask_token_id: int, tap_ids: list[int]):
    from transformers import Qwen3Config

    heads = int(verifier_cfg.num_attention_heads)
    kv_heads = int(getattr(verifier_cfg, "num_key_value_heads", None) or heads)
    return Qwen3Config(
        vocab_size=verifier_cfg.vocab_size, hidden_size=verifier_cfg.hidden_size,
        intermediate_size=cfg.intermediate_size or int(verifier_cfg.intermediate_size),
        num_hidden_layers=cfg.draft_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=int(getattr(verifier_cfg, "head_dim", None) or verifier_cfg.hidden_size // heads),
        rms_norm_eps=float(verifier_cfg.rms_norm_eps), max_position_embeddings=verifier_cfg.max_position_embeddings,
        rope_parameters=dict(getattr(verifier_cfg, "rope_parameters", None) or {"rope_type": "default",
                                                                               "rope_theta": 10000.0}),
        architectures=["TreeFlashDraftModel"], block_size=cfg.block_size,
        num_target_layers=int(verifier_cfg.num_hidden_layers),
        dflash_config={"target_layer_ids": tap_ids, "mask_token_id": mask_token_id},
        treeflash_config={"ar_approximation": "swiglu", "candidate_tokens": 16},
    )


def init_drafter(hf_cfg, seed: int, verifier=None):
    """Random init; with a verifier, the final norm is the verifier's (its LM head expects that
    scale) and each draft layer starts as a copy of one of the verifier's last layers where the
    shapes agree."""
    from .models import TreeFlashDrafter

    torch.manual_seed(seed)
    model = TreeFlashDrafter(DrafterConfig.from_hf(hf_cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "ar_approximation.d.weight":
                p.zero_()  # an untrained head reproduces the marginal drafter
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
        if verifier is not None:
            model.model.norm.weight.copy_(verifier.model.norm.weight)
            src_layers = verifier.model.layers[-len(model.model.layers):]
            for dst, src in zip(model.model.layers, src_layers):
                src_state = src.state_dict()
                for key, value in dst.state_dict().items():
                    if key in src_state and src_state[key].shape == value.shape:
                        value.copy_(src_state[key])
    return model


def block_loss(drafter, embed, lm_head, tokens, feats, anchors, block: int, gamma: float, mask_id: int,
               vocab: torch.Tensor | None = None):
    """Mean weighted CE of marginal and conditional logits over several anchors in one call.

    tokens [b, L] int64, feats [b, L, F]; anchors: an int or a list of them, shared by the batch.
    For anchor a the context is positions 0..a-1, the block root is x[a] at position a, and the
    targets are x[a+1 .. a+B-1]. All blocks go through the drafter at once: each block sees the
    context before its own anchor and its own B positions, nothing else (DFlash's training
    mask), so the result equals the mean of one call per anchor.

    vocab (sorted token ids containing every target) restricts the softmax to those tokens: on a
    CPU the LM head over the whole vocabulary is most of a training step. None = all tokens."""
    b, dev = tokens.shape[0], tokens.device
    anchors = torch.as_tensor([anchors] if isinstance(anchors, int) else list(anchors), device=dev)
    n, ctx_len = anchors.numel(), int(anchors.max())
    offs = torch.arange(block, device=dev)
    where = anchors[:, None] + offs  # [n, B] positions of each block
    block_ids = torch.full((b, n, block), mask_id, dtype=torch.long, device=dev)
    block_ids[:, :, 0] = tokens[:, anchors]
    ctx_mask = (torch.arange(ctx_len, device=dev)[None] < anchors[:, None]).repeat_interleave(block, 0)
    same_block = torch.arange(n, device=dev).repeat_interleave(block)
    key_mask = torch.cat([ctx_mask, same_block[:, None] == same_block[None]], dim=1)
    z, _ = drafter.model(feats[:, :ctx_len], torch.arange(ctx_len, device=dev), embed(block_ids.flatten(1)),
                         where.flatten(), None, 0, key_mask=key_mask)
    z = z.unflatten(1, (n, block))[:, :, 1:]  # [b, n, B-1, H]
    targets = tokens[:, where[:, 1:]]  # [b, n, B-1]
    norm = drafter.model.norm
    h = norm(z)
    w = torch.exp(-torch.arange(block - 1, dtype=torch.float32, device=dev) / gamma)
    w = w / w.sum()
    parents = embed(tokens[:, where[:, :-1]])  # the true previous token of each position
    cond_h = norm(z + drafter.ar_approximation(parents, h))
    if vocab is None:
        marg, cond = lm_head(h).float(), lm_head(cond_h).float()
    else:
        weight = lm_head.weight[vocab]
        marg, cond = F.linear(h, weight).float(), F.linear(cond_h, weight).float()
        targets = torch.searchsorted(vocab, targets)

    def wce(logits):
        ce = F.cross_entropy(logits.flatten(0, 2), targets.flatten(), reduction="none").view(targets.shape)
        return (ce * w).sum(-1).mean()

    with torch.no_grad():
        acc = {"marginal": (marg.argmax(-1) == targets).float().mean((0, 1)),
               "conditional": (cond.argmax(-1) == targets).float().mean((0, 1))}
    return wce(marg), wce(cond), acc


# ---------------------------------------------------------------- training loop


def _training_device(name: str) -> torch.device:
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name}: use cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: this torch has no CUDA device (torch {torch.__version__})")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name}: use cpu or cuda[:N]")
    return dev


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def evaluate(drafter, embed, lm_head, data, cfg: TrainConfig, mask_id: int) -> dict:
    """Held-out loss and per-position top-1 accuracy over fixed anchors (up to 8, evenly spread)."""
    dev = lm_head.weight.device
    tokens, feats = data["tokens"].long().to(dev), data["features"]
    first, last = cfg.prompt_tokens, tokens.shape[1] - cfg.block_size
    anchors = sorted({round(first + i * (last - first) / 7) for i in range(8)})
    drafter.eval()
    totals = {"marginal_loss": 0.0, "conditional_loss": 0.0}
    acc_m = acc_c = 0
    with torch.no_grad():
        for rows in torch.arange(len(tokens)).split(16):
            lm, lc, acc = block_loss(drafter, embed, lm_head, tokens[rows.to(dev)], feats[rows].to(dev).float(),
                                     anchors, cfg.block_size, cfg.decay_gamma, mask_id)
            share = len(rows) / len(tokens)
            totals["marginal_loss"] += float(lm) * share
            totals["conditional_loss"] += float(lc) * share
            acc_m = acc_m + acc["marginal"] * share
            acc_c = acc_c + acc["conditional"] * share
    drafter.train()
    return {**totals, "marginal_acc": [round(float(x), 4) for x in acc_m],
            "conditional_acc": [round(float(x), 4) for x in acc_c]}


def _cached_rows(work: Path, stem: str, prompts: torch.Tensor, log: Callable[[str], None]):
    """(rows, file) of an earlier cache of this split whose prompts are the leading prompts
    wanted now (the largest such cache first), or (None, None)."""
    def count(path):
        return int(path.stem.rsplit("-", 1)[1])

    for path in sorted(work.glob(f"{stem}-*.pt"), key=count, reverse=True):
        data = torch.load(path)
        n = min(len(prompts), len(data["tokens"]))
        if torch.equal(data["tokens"][:n, : prompts.shape[1]], prompts[:n]):
            log(f"reusing {n} sequences of cached data {path.name}")
            return {k: v[:n] for k, v in data.items()}, path
        del data
    return None, None


def prepare_data(verifier, tok, verifier_key: str, cfg: TrainConfig, tap_ids: list[int], work: Path,
                 log: Callable[[str], None] = print) -> dict:
    """The training and held-out data, generated once and cached in `work`, one file per split
    named by every setting that changes it and by its prompt count.

    Each split draws its prompts from its own seeded stream, so a run with more prompts than an
    earlier one generates only the new sequences (and one with fewer reuses a leading slice)."""
    from tqdm import tqdm

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    train_files, held_files = corpus_files()
    data = {}
    for split, files, count in (("train", train_files, cfg.train_prompts),
                                ("heldout", held_files, cfg.heldout_prompts)):
        stem = f"{split}-{cfg.data_key(verifier_key, split)}"
        path = work / f"{stem}-{count}.pt"
        if path.exists():
            log(f"using cached data {path.name}")
            data[split] = torch.load(path)
            continue
        # The training stream is seeded as in the single-file cache this replaced, so its sequences
        # could be carried over; the held-out stream no longer depends on the training prompt count.
        rng = random.Random(cfg.seed) if split == "train" else random.Random(f"heldout-{cfg.seed}")
        prompts = torch.tensor(sample_prompts(files, tok, count, cfg.prompt_tokens, rng), dtype=torch.int32)
        part, source = _cached_rows(work, stem, prompts, log)
        have = 0 if part is None else len(part["tokens"])
        if have < count:
            bar = tqdm(total=(count - have) * cfg.continuation_tokens, desc=f"verifier continuations ({split})",
                       unit="tok", leave=False)
            new = generate_data(verifier, prompts[have:].tolist(), tap_ids, cfg.continuation_tokens, cfg.gen_batch,
                                progress=lambda done, total, bar=bar: bar.update(done - bar.n))
            bar.close()
            log(f"generated {new['tokens'].numel()} tokens of {split} data")
            part = new if not have else {k: torch.cat([part[k], new[k]]) for k in new}
            _atomic_save(part, path)
            if source is not None:  # its sequences lead the new file
                source.unlink()
        data[split] = part
    return data


def train(verifier_path: str, out: Path, cfg: TrainConfig, *, resume: bool = False, work: Path | None = None,
          log: Callable[[str], None] = print, verifier_name: str | None = None, device: str = "cpu") -> Path:
    """Train and write the drafter to `out` in the released TreeFlash layout.

    `device` runs data generation and training there (fp32 weights either way); the cached data
    and the checkpoints are device-independent, so a run may resume on another device."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from .checkpoints import load_tokenizer, load_verifier, resolve_checkpoint

    cfg.validate()
    out = Path(out)
    work = Path(work) if work else out.with_name(out.name + ".work")  # prepare_data creates it
    ckpt_path = work / "last.pt"
    if ckpt_path.exists() and not resume:
        raise ConfigError(f"{ckpt_path} exists from an earlier run: pass --resume to continue it, "
                          f"or remove {work}")
    dev = _training_device(device)
    vpath = resolve_checkpoint(verifier_path, "verifier")
    verifier = load_verifier(vpath, dtype=torch.float32, device=dev)
    tok = load_tokenizer(vpath)
    vcfg = verifier.config
    tap_ids = default_target_layer_ids(int(vcfg.num_hidden_layers), cfg.num_taps)
    mask_id = int(vcfg.vocab_size) - 1 if tok.pad_token_id is None else int(tok.pad_token_id)

    data = prepare_data(verifier, tok, str(vpath), cfg, tap_ids, work, log)

    hf_cfg = make_drafter_config(vcfg, cfg, mask_id, tap_ids)
    drafter = init_drafter(hf_cfg, cfg.seed, verifier).to(dev).train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))

    def lr_at(step):
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))))

    step, history = 0, []
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if ckpt_path.exists():
        # On the CPU: load_state_dict copies weights and optimiser state onto the model's device,
        # and the RNG state must stay a CPU tensor.
        state = torch.load(ckpt_path, weights_only=False, map_location="cpu")
        if state["config"] != dataclasses.asdict(cfg):
            raise ConfigError(f"{ckpt_path} was made with other settings; use the same options or remove {work}")
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
        _set_rng_state(state["rng"])
        log(f"resumed at step {step}")

    embed, lm_head = verifier.model.embed_tokens, verifier.lm_head
    tokens = data["train"]["tokens"].long()
    feats = data["train"]["features"]  # stays on the CPU; each step's rows move to `dev`
    n_seq, L = tokens.shape
    anchor_range = range(cfg.prompt_tokens, L - cfg.block_size + 1)  # blocks lie inside the continuation
    # Held-out evaluation always uses the whole vocabulary.
    vocab = torch.unique(tokens).to(dev) if cfg.loss_vocab == "data" else None
    if vocab is not None:
        log(f"training softmax over the {len(vocab)} tokens of the training data "
            f"(of {lm_head.weight.shape[0]})")
    if step == 0:  # the untrained drafter, as the curve's starting point
        history.append({"step": 0, "train_loss": None, **evaluate(drafter, embed, lm_head, data["heldout"], cfg,
                                                                   mask_id)})
    bar = tqdm(total=cfg.steps, initial=step, desc="training", unit="step")
    while step < cfg.steps:
        anchors = random.sample(anchor_range, min(cfg.anchors, len(anchor_range)))
        rows = torch.randint(0, n_seq, (cfg.batch_size,))
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        lm, lc, _ = block_loss(drafter, embed, lm_head, tokens[rows].to(dev), feats[rows].to(dev).float(), anchors,
                               cfg.block_size, cfg.decay_gamma, mask_id, vocab)
        loss = lm + lc
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            ev = evaluate(drafter, embed, lm_head, data["heldout"], cfg, mask_id)
            history.append({"step": step, "train_loss": loss.item(), **ev})
            log(f"step {step}: held-out marginal {ev['marginal_loss']:.3f}, conditional {ev['conditional_loss']:.3f}")
        if step % cfg.save_every == 0 or step == cfg.steps:
            _atomic_save({"model": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step,
                          "history": history, "rng": _rng_state(), "config": dataclasses.asdict(cfg)}, ckpt_path)
    bar.close()

    # The drafter, in the released TreeFlash layout, written atomically (fp16 weights).
    with atomic_folder(out) as tmp:
        hf_cfg.torch_dtype = "float16"
        hf_cfg.save_pretrained(tmp)
        save_file({k: v.to(torch.float16).cpu().contiguous() for k, v in drafter.state_dict().items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "training.json").write_text(json.dumps(
            {"config": dataclasses.asdict(cfg), "verifier": verifier_name or str(verifier_path), "history": history,
             "data": {"corpus": "Python standard library sources (every tenth file held out)",
                      "train_tokens": int(data["train"]["tokens"].numel()),
                      "heldout_tokens": int(data["heldout"]["tokens"].numel())}}, indent=1) + "\n")
    return out


def plot_history(training_json: Path, png: Path) -> None:
    """The held-out loss curves as an image (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = json.loads(Path(training_json).read_text())["history"]
    steps = [h["step"] for h in hist]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    trained = [h for h in hist if h["train_loss"] is not None]
    ax.plot([h["step"] for h in trained], [h["train_loss"] / 2 for h in trained],
            label="train batch (mean of the two; training vocabulary)", alpha=0.5)
    ax.plot(steps, [h["marginal_loss"] for h in hist], label="held-out, marginal")
    ax.plot(steps, [h["conditional_loss"] for h in hist], label="held-out, TreeFlash head")
    ax.set_xlabel("step")
    ax.set_ylabel("position-weighted cross-entropy")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
