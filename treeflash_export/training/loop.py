"""`treeflash-export train`: a DFlash-style drafter and the TreeFlash head for a given verifier.

Data (dataset.py, data.py): the verifier's own continuations of prompts, from Python's
standard-library sources by default, from chat instructions the verifier writes about offline
seed texts (`--source` / `--mix`, sources.py and chat.py) or from the user's JSON Lines /
Parquet files (`--data`, files.py), generated in batches once and cached together with the
tapped hidden states the drafter reads.

Loss: for random anchors a (several per sequence, trained in one call under DFlash's block
mask), the block [x_a, MASK x (B-1)] must predict
x_{a+1..a+B-1}: cross-entropy of the marginal logits plus cross-entropy of the
head's conditional logits given the true previous token, with position-decay
weights exp(-(k-1)/gamma). Backbone and head train jointly; the head's down
projection starts at zero (an untrained head is the marginal drafter).
Checkpoints are atomic and carry optimiser and RNG state, so a resumed run
continues exactly where it stopped. Under torchrun the same loop runs data-parallel (DDP).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import random
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..config import DrafterConfig, default_target_layer_ids
from ..errors import ConfigError
from ..fsutil import atomic_folder
from ..fsutil import atomic_torch_save as _atomic_save  # checkpoints (a module name the tests can patch)
from .chat import stop_ids
from .config import CHAT_SOURCES, TrainConfig
from .data import turn_ends
from .dataset import prepare_data


# ---------------------------------------------------------------- model and loss


def load_init(folder: Path, drafter, hf_cfg) -> dict:
    """--init: loads the folder's weights into `drafter` (fresh, built from hf_cfg) after checking the
    block settings the weights' shapes do not show; returns what training.json says of them."""
    from safetensors.torch import load_file

    folder = Path(folder)
    weights_file = folder / "model.safetensors"
    try:
        theirs = json.loads((folder / "config.json").read_text())
        weights = load_file(str(weights_file))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--init {folder}: not a drafter folder (config.json and model.safetensors): {exc}") from None
    for key in ("block_size", "hidden_size", "num_hidden_layers", "intermediate_size"):
        if theirs.get(key) != getattr(hf_cfg, key):
            raise ConfigError(f"--init {folder}: its {key} is {theirs.get(key)}, this run's is {getattr(hf_cfg, key)}")
    ours = (theirs.get("dflash_config") or {}).get("target_layer_ids")
    if ours != hf_cfg.dflash_config["target_layer_ids"]:
        raise ConfigError(f"--init {folder}: it taps verifier layers {ours}, this run taps "
                          f"{hf_cfg.dflash_config['target_layer_ids']}")
    try:  # strict: names every missing, unexpected or reshaped key
        drafter.load_state_dict({k: v.float() for k, v in weights.items()})
    except RuntimeError as exc:
        raise ConfigError(f"--init {folder}: its weights do not fit this drafter: {exc}") from None
    return {"from": folder.name, "sha256": hashlib.sha256(weights_file.read_bytes()).hexdigest()}


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
    from ..models import TreeFlashDrafter

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
               vocab: torch.Tensor | None = None, pad: torch.Tensor | None = None, ends: torch.Tensor | None = None):
    """Mean weighted CE of marginal and conditional logits over several anchors in one call.

    tokens [b, L] int64, feats [b, L, F]; anchors: an int or a list of them, shared by the batch.
    For anchor a the context is positions 0..a-1, the block root is x[a] at position a, and the
    targets are x[a+1 .. a+B-1]. All blocks go through the drafter at once: each block sees the
    context before its own anchor and its own B positions, nothing else (DFlash's training
    mask), so the result equals the mean of one call per anchor.

    vocab (sorted token ids containing every target) restricts the softmax to those tokens: on a
    CPU the LM head over the whole vocabulary is most of a training step. None = all tokens.

    pad [b] (data from --data files): each row's count of left-padding columns, hidden from every
    block. RoPE is relative, so a row's shifted positions change nothing but rounding.

    ends [b] (optional): each row's last position worth predicting, its first end-of-turn token
    (the verifier's answer ends there; what a greedy run writes after it is never served). Targets
    past it weigh 0; the loss is still divided by the b x anchors blocks of the call, so equal
    micro-batches average to the global batch's loss under any split."""
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
    if pad is not None and bool(pad.any()):  # one mask per row: [b, n*B, ctx + n*B]
        real = torch.arange(ctx_len + n * block, device=dev)[None] >= pad[:, None].to(dev)
        real[:, ctx_len:] = True
        key_mask = key_mask[None] & real[:, None]
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

    # [b, n, B-1]: 1 where the target lies at or before the row's end, else 0 (None: all count).
    live = None if ends is None else (where[None, :, 1:] <= ends.to(dev)[:, None, None]).float()

    def wce(logits):
        ce = F.cross_entropy(logits.flatten(0, 2), targets.flatten(), reduction="none").view(targets.shape)
        if live is None:
            return (ce * w).sum(-1).mean()
        return (ce * w * live).sum() / (b * n)

    def accuracy(logits):
        hit = (logits.argmax(-1) == targets).float()
        if live is None:
            return hit.mean((0, 1))
        return (hit * live).sum((0, 1)) / live.sum((0, 1)).clamp(min=1)

    with torch.no_grad():
        acc = {"marginal": accuracy(marg), "conditional": accuracy(cond)}
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


def evaluate(drafter, embed, lm_head, data, cfg: TrainConfig, mask_id: int) -> dict:
    """Held-out loss and per-position top-1 accuracy over fixed anchors (up to 8, evenly spread)."""
    dev = lm_head.weight.device
    tokens, feats, pad, ends = data["tokens"].long().to(dev), data["features"], data.get("pad"), data.get("ends")
    first, last = cfg.prompt_tokens, tokens.shape[1] - cfg.block_size
    anchors = sorted({round(first + i * (last - first) / 7) for i in range(8)})
    drafter.eval()
    totals = {"marginal_loss": 0.0, "conditional_loss": 0.0}
    acc_m = acc_c = 0
    with torch.no_grad():
        for rows in torch.arange(len(tokens)).split(16):
            lm, lc, acc = block_loss(drafter, embed, lm_head, tokens[rows.to(dev)], feats[rows].to(dev).float(),
                                     anchors, cfg.block_size, cfg.decay_gamma, mask_id,
                                     pad=None if pad is None else pad[rows],
                                     ends=None if ends is None else ends[rows])
            share = len(rows) / len(tokens)
            totals["marginal_loss"] += float(lm) * share
            totals["conditional_loss"] += float(lc) * share
            acc_m = acc_m + acc["marginal"] * share
            acc_c = acc_c + acc["conditional"] * share
    drafter.train()
    return {**totals, "marginal_acc": [round(float(x), 4) for x in acc_m],
            "conditional_acc": [round(float(x), 4) for x in acc_c]}


class DrafterLoss(torch.nn.Module):
    """block_loss as a module, so DistributedDataParallel's forward sees (and syncs) the drafter.
    The verifier's embedding and LM head are frozen arguments, not part of the synced model."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, embed, lm_head, *args, **kwargs):
        return block_loss(self.drafter, embed, lm_head, *args, **kwargs)


def _check_resumable(state: dict, cfg: TrainConfig, global_batch: int, source: str, ckpt_path: Path, work: Path):
    """A checkpoint continues under the same settings, data and global batch. How the global batch
    is split into processes, micro-batches and accumulation may change: every step draws its whole
    global batch from one random stream, whatever the split."""
    saved = {**dataclasses.asdict(TrainConfig()), **state["config"]}  # fields added since take their defaults
    split = ("batch_size", "grad_accum")
    now = dataclasses.asdict(cfg)
    if {k: v for k, v in saved.items() if k not in split} != {k: v for k, v in now.items() if k not in split}:
        raise ConfigError(f"{ckpt_path} was made with other settings; use the same options or remove {work}")
    if state.get("data_source", "") != source:
        raise ConfigError(f"{ckpt_path} was trained on other data (--data files differ); remove {work} to start over")
    was = state.get("global_batch", saved["batch_size"] * saved["grad_accum"])
    if was != global_batch:
        raise ConfigError(f"{ckpt_path} trains with a global batch of {was} sequences, here batch size x processes x "
                          f"grad accum = {global_batch}: choose --batch-size and --grad-accum to match")


def _save_checkpoint(world, path: Path, state: dict) -> None:
    """Called by every rank at a checkpoint step; rank 0 writes it (all ranks hold the same state)."""
    if world.main:
        _atomic_save(state, path)


def train(verifier_path: str, out: Path, cfg: TrainConfig, *, resume: bool = False, work: Path | None = None,
          log: Callable[[str], None] = print, verifier_name: str | None = None, device: str = "cpu",
          data_files: list[str | Path] = (), init_from: Path | None = None) -> Path:
    """Train and write the drafter to `out` in the released TreeFlash layout.

    `device` runs data generation and training there (fp32 weights; bf16 autocast on CUDA); the
    cached data and the checkpoints are device-independent, so a run may resume on another device.
    `data_files` (--data) are the source `data` of cfg.mix; alone they replace the standard-library
    prompts (files.py). cfg.mix is stored normalised ("" for the default mix).

    `init_from` (--init) is a drafter folder whose weights replace the fresh initialisation; its
    shapes and block settings must be the ones cfg gives (checked before any data is generated).
    A resumed run continues from its checkpoint, so there it is only recorded.

    Under torchrun (WORLD_SIZE > 1) every process joins a DistributedDataParallel group (see
    distributed.py); each step's global batch is batch_size x processes x grad_accum sequences,
    drawn by every rank from the same seeded stream and split among ranks and micro-batches, so
    the mean loss and the weights are those of one process with the same global batch (up to
    float summation order), and a checkpoint resumes under another process count with the same
    data order. Rank 0 logs, evaluates and writes checkpoints and the drafter."""
    from .distributed import joined
    from .files import content_hash

    from .sources import mix_text, resolve_mix

    cfg.validate()
    data_files = [Path(p) for p in data_files]
    cfg = dataclasses.replace(cfg, mix=mix_text(resolve_mix(cfg.mix, bool(data_files)), bool(data_files)))
    out = Path(out)
    work = Path(work) if work else out.with_name(out.name + ".work")  # prepare_data creates it
    ckpt_path = work / "last.pt"
    if ckpt_path.exists() and not resume:
        raise ConfigError(f"{ckpt_path} exists from an earlier run: pass --resume to continue it, "
                          f"or remove {work}")
    if resume and not ckpt_path.exists():
        raise ConfigError(f"--resume: there is no checkpoint to continue in {work} (no {ckpt_path.name}); "
                          f"run without --resume to start, or pass the --work folder of the earlier run")
    dev = _training_device(device)
    source = content_hash(data_files) if data_files else ""
    with joined(dev) as (world, dev):
        return _train(verifier_path, out, cfg, resume, work, log if world.main else (lambda m: None),
                      verifier_name, dev, data_files, source, world, init_from)


def _train(verifier_path, out, cfg, resume, work, log, verifier_name, dev, data_files, source, world,
           init_from=None) -> Path:
    from tqdm import tqdm

    from ..checkpoints import checkpoint_fingerprint, load_tokenizer, load_verifier, resolve_checkpoint
    from .sources import resolve_mix

    ckpt_path = work / "last.pt"
    vpath = resolve_checkpoint(verifier_path, "verifier")
    tok = load_tokenizer(vpath)
    chat = [name for name in resolve_mix(cfg.mix, bool(data_files)) if name in CHAT_SOURCES]
    if chat and not getattr(tok, "chat_template", None):  # before any data is generated or written
        raise ConfigError(f"--source {chat[0]} writes chat turns with the verifier's chat template, but its "
                          f"tokenizer has none: train on --source code or on --data prompts instead")
    verifier = load_verifier(vpath, dtype=torch.float32, device=dev)
    vcfg = verifier.config
    tap_ids = default_target_layer_ids(int(vcfg.num_hidden_layers), cfg.num_taps)
    mask_id = int(vcfg.vocab_size) - 1 if tok.pad_token_id is None else int(tok.pad_token_id)
    hf_cfg = make_drafter_config(vcfg, cfg, mask_id, tap_ids)
    drafter = init_drafter(hf_cfg, cfg.seed, verifier)
    init_record = load_init(init_from, drafter, hf_cfg) if init_from else None  # fails before data generation

    # The data caches follow the verifier's content, not its path: a moved folder keeps them, new
    # weights at the same path do not reuse them.
    data = prepare_data(verifier, tok, checkpoint_fingerprint(vpath), cfg, tap_ids, work, log,
                        data_files=data_files, source=source, world=world)

    stops = stop_ids(tok)
    for split in data.values():  # targets past a row's end of turn weigh nothing
        split["ends"] = turn_ends(split["tokens"], cfg.prompt_tokens, stops)

    if init_record is not None:
        log(f"starting from the weights of {init_from}")
    drafter = drafter.to(dev).train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))

    def lr_at(step):
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))))

    global_batch = cfg.batch_size * world.size * cfg.grad_accum
    step, history = 0, []
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if ckpt_path.exists():
        # On the CPU: load_state_dict copies weights and optimiser state onto the model's device,
        # and the RNG state must stay a CPU tensor.
        state = torch.load(ckpt_path, weights_only=False, map_location="cpu")
        _check_resumable(state, cfg, global_batch, source, ckpt_path, work)
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
        _set_rng_state(state["rng"])
        log(f"resumed at step {step}")

    model = DrafterLoss(drafter)
    if world.size > 1:
        from torch.nn.parallel import DistributedDataParallel

        # No buffer changes during training (the rotary tables are fixed): nothing to broadcast per step.
        model = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                        broadcast_buffers=False)
    embed, lm_head = verifier.model.embed_tokens, verifier.lm_head
    tokens = data["train"]["tokens"].long()
    feats = data["train"]["features"]  # stays on the CPU; each step's rows move to `dev`
    pads = data["train"].get("pad")  # left padding of prompts from --data files, else None
    ends = data["train"].get("ends")  # each row's end of turn, or None when no row ends early
    n_seq, L = tokens.shape
    anchor_range = range(cfg.prompt_tokens, L - cfg.block_size + 1)  # blocks lie inside the continuation
    # Held-out evaluation always uses the whole vocabulary.
    vocab = torch.unique(tokens).to(dev) if cfg.loss_vocab == "data" else None
    if vocab is not None:
        log(f"training softmax over the {len(vocab)} tokens of the training data "
            f"(of {lm_head.weight.shape[0]})")
    if world.size > 1 or cfg.grad_accum > 1:
        log(f"global batch {global_batch} = {cfg.batch_size} sequences x {world.size} process(es) x "
            f"{cfg.grad_accum} accumulation step(s)")
    if step == 0 and world.main:  # the untrained drafter, as the curve's starting point
        history.append({"step": 0, "train_loss": None, **evaluate(drafter, embed, lm_head, data["heldout"], cfg,
                                                                   mask_id)})
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")
    bar = tqdm(total=cfg.steps, initial=step, desc="training", unit="step", disable=not world.main)
    while step < cfg.steps:
        anchors = random.sample(anchor_range, min(cfg.anchors, len(anchor_range)))
        # The whole global batch, the same on every rank; [accumulation step, rank, row] picks each share.
        rows = torch.randint(0, n_seq, (global_batch,)).view(cfg.grad_accum, world.size, cfg.batch_size)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=dev)
        for micro in range(cfg.grad_accum):
            part = rows[micro, world.rank]
            # Gradients are all-reduced (averaged over ranks) only on the last micro-batch.
            last = micro == cfg.grad_accum - 1
            with contextlib.nullcontext() if last or world.size == 1 else model.no_sync():
                with autocast:
                    lm, lc, _ = model(embed, lm_head, tokens[part].to(dev), feats[part].to(dev).float(), anchors,
                                      cfg.block_size, cfg.decay_gamma, mask_id, vocab,
                                      None if pads is None else pads[part], None if ends is None else ends[part])
                # Equal micro-batches: the mean of their means is the global batch's mean.
                loss = (lm + lc) / cfg.grad_accum
                loss.backward()
            step_loss += loss.detach()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        train_loss = float(world.mean(step_loss))
        bar.update(1)
        bar.set_postfix(loss=f"{train_loss:.3f}")
        if world.main and (step % cfg.eval_every == 0 or step == cfg.steps):
            ev = evaluate(drafter, embed, lm_head, data["heldout"], cfg, mask_id)
            history.append({"step": step, "train_loss": train_loss, **ev})
            log(f"step {step}: held-out marginal {ev['marginal_loss']:.3f}, conditional {ev['conditional_loss']:.3f}")
        if step % cfg.save_every == 0 or step == cfg.steps:
            _save_checkpoint(world, ckpt_path, {
                "model": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step, "history": history,
                "rng": _rng_state(), "config": dataclasses.asdict(cfg), "global_batch": global_batch,
                "data_source": source})
    bar.close()

    if world.main:
        _write_drafter(out, drafter, hf_cfg, cfg, history, data, verifier_name or str(verifier_path), data_files,
                       source, world, global_batch, init_record)
    world.barrier()  # every rank returns once the drafter is written
    return out


def _write_drafter(out, drafter, hf_cfg, cfg, history, data, verifier_name, data_files, source, world,
                   global_batch, init_record=None) -> None:
    """The drafter, in the released TreeFlash layout, written atomically (fp16 weights)."""
    from safetensors.torch import save_file

    from ..models import draft_vocab
    from .sources import describe

    corpus = describe(cfg.mix, [str(p) for p in data_files], source)
    with atomic_folder(out) as tmp:
        hf_cfg.torch_dtype = "float16"
        hf_cfg.save_pretrained(tmp)
        save_file({k: v.to(torch.float16).cpu().contiguous() for k, v in drafter.state_dict().items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # The tokens it learnt to rank (the runtime's draft vocabulary): every token of the training
        # data, most frequent among the positions it was trained to predict (the continuations) first.
        tokens = data["train"]["tokens"]
        draft_vocab.write(tmp, draft_vocab.token_order(tokens, tokens[:, cfg.prompt_tokens:]),
                          source="the training data of this drafter (training.json says which)")
        (tmp / "training.json").write_text(json.dumps(
            {"config": dataclasses.asdict(cfg), "verifier": verifier_name, "history": history,
             "processes": world.size, "global_batch": global_batch,
             **({"init": init_record} if init_record else {}),
             "data": {**corpus,
                      "train_tokens": int(data["train"]["tokens"].numel()),
                      "heldout_tokens": int(data["heldout"]["tokens"].numel())}}, indent=1) + "\n")


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
