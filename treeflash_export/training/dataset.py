"""The training set: which prompts of which source make up each split, generated once and cached.

Prompts come from the sources of the mix (sources.py): Python's standard-library sources (the
default: windows cut at line starts, every tenth file held out), chat turns the verifier writes
itself about offline seed texts (chat.py), or the user's files (`--data`, read by files.py).
Each source's split is cached in the work folder under a key of every setting that changes it,
one file per prompt count, so a later run with more prompts generates only the new sequences.
Under torchrun every rank generates a share of the missing sequences at once and rank 0 joins
the shares into the cache, which does not depend on the number of processes.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import torch

from ..fsutil import atomic_torch_save
from . import data  # its functions through the module, so a test can count the generation calls
from .chat import chat_fields, chat_prompts
from .config import TrainConfig
from .distributed import World
from .files import load_prompts, split_heldout, tokenise
from .self_chat import SOURCE as SELF, self_chat_prompts, self_fields
from .sources import allocate, corpus_files, prose_works, resolve_mix


def _file_prompts(data_files: list[Path], tok, cfg: TrainConfig, counts: dict[str, int],
                  log) -> dict[str, list[list[int]]]:
    train, held = split_heldout(load_prompts(data_files, log))
    return {"train": tokenise(train, tok, cfg.prompt_tokens, counts["train"], "train", log),
            "heldout": tokenise(held, tok, cfg.prompt_tokens, counts["heldout"], "heldout", log)}


def prepare_data(verifier, tok, verifier_key: str, cfg: TrainConfig, tap_ids: list[int], work: Path,
                 log: Callable[[str], None] = print, *, data_files: list[Path] = (), source: str = "",
                 world: World = World()) -> dict:
    """The training and held-out data, generated once and cached in `work`, one file per source
    and split named by every setting that changes it and by its prompt count. ``verifier_key``
    names the verifier (its content: checkpoints.checkpoint_fingerprint).

    The mix (cfg.mix, sources.py) shares --train-prompts and --heldout-prompts among the
    sources; each source's rows come from its own cache and the splits are their concatenation.
    When any source stores left-padded rows, code rows get a padding count of 0."""
    mix = resolve_mix(cfg.mix, bool(data_files))
    counts = {split: allocate(total, mix, f"--{split}-prompts")
              for split, total in (("train", cfg.train_prompts), ("heldout", cfg.heldout_prompts))}
    # Bad input is found before the work folder is created.
    from_files = _file_prompts(data_files, tok, cfg, {s: c["data"] for s, c in counts.items()}, log) \
        if data_files else None
    if "chat-prose" in mix:
        prose_works()
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    pad_id = next((t for t in (tok.pad_token_id, tok.eos_token_id) if t is not None), 0)
    splits = {}
    for split in ("train", "heldout"):
        parts = [_source_split(name, split, counts[split][name], verifier, tok, verifier_key, cfg, tap_ids, work,
                               log, from_files, source, world, pad_id) for name in mix]
        if len(parts) > 1 and any("pad" in p for p in parts):
            parts = [p if "pad" in p else {**p, "pad": torch.zeros(len(p["tokens"]), dtype=torch.int32)}
                     for p in parts]
        splits[split] = parts[0] if len(parts) == 1 else {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return splits


def _source_split(name: str, split: str, count: int, verifier, tok, verifier_key: str, cfg: TrainConfig,
                  tap_ids: list[int], work: Path, log, from_files, source: str, world: World, pad_id: int) -> dict:
    """One source's rows of one split, from its cache or generated (and cached).

    Code prompts: each split draws from its own seeded stream, so a run with more prompts than an
    earlier one generates only the new sequences (and one with fewer reuses a leading slice).
    File prompts (`from_files`, whose content hash is `source`): the first prompts of each split
    that fit in --prompt-tokens. Chat prompts: the verifier's own instructions (chat.py), or the user
    turns it writes with no seed (self_chat.py).
    File and chat prompts are stored left-padded to --prompt-tokens columns (see generate_data),
    so every continuation starts at the same column as in code data."""
    from tqdm import tqdm

    seed_split = split  # names each prompt's sampling seed (prompt_seed)
    if name == "code":
        stem = f"{split}-{cfg.data_key(verifier_key, split)}"
    elif name == "data":
        stem = f"{split}-{cfg.data_key(verifier_key, split, source)}"
        count = len(from_files[split])
    else:
        fields = self_fields(cfg) if name == SELF else chat_fields(name, cfg)
        stem = f"{name}-{split}-{cfg.data_key(verifier_key, split, chat=fields)}"
        seed_split = f"{name}/{split}"
    path = work / f"{stem}-{count}.pt"
    if path.exists():
        log(f"using cached data {path.name}")
        return torch.load(path)
    width = cfg.prompt_tokens
    if name == "code":
        # The training stream is seeded as in the single-file cache this replaced, so its sequences
        # could be carried over; the held-out stream does not depend on the training prompt count.
        rng = random.Random(cfg.seed) if split == "train" else random.Random(f"heldout-{cfg.seed}")
        lists = data.sample_prompts(corpus_files()[split == "heldout"], tok, count, cfg.prompt_tokens, rng)
        width = None
    elif name == "data":
        lists = from_files[split]
    else:
        if name == SELF:
            lists = self_chat_prompts(verifier, tok, verifier_key, split, count, cfg, work, log, world=world,
                                      pad_id=pad_id).ids
        else:
            lists = chat_prompts(verifier, tok, verifier_key, name, split, count, cfg, work, log, world=world,
                                 pad_id=pad_id).ids
    prompts = torch.tensor([[pad_id] * (cfg.prompt_tokens - len(p)) + p for p in lists], dtype=torch.int32)
    part, cached = data.cached_rows(work, stem, prompts, log)
    have = 0 if part is None else len(part["tokens"])
    if have < count:
        mine = world.shard(count - have)  # this rank's share of the missing sequences
        first = have + mine.start
        bar = tqdm(total=len(mine) * cfg.continuation_tokens, desc=f"verifier continuations ({name}, {split})",
                   unit="tok", leave=False, disable=not world.main)
        new = None if not len(mine) else data.generate_data(
            verifier, lists[first : first + len(mine)], tap_ids, cfg.continuation_tokens, cfg.gen_batch,
            progress=lambda done, total: bar.update(done - bar.n), width=width, pad_id=pad_id,
            temperature=cfg.gen_temperature,
            seeds=[data.prompt_seed(cfg.seed, seed_split, i) for i in range(first, first + len(mine))])
        bar.close()
        new = data.join_shares(new, work, stem, world, count - have)
        if world.main:
            log(f"generated {new['tokens'].numel()} tokens of {name} {split} data")
            part = new if not have else {k: torch.cat([part[k], new[k]]) for k in new}
            atomic_torch_save(part, path)
            if cached is not None:  # its sequences lead the new file
                cached.unlink()
        world.barrier()  # the cache file is complete before any rank reads it or looks for caches
        if not world.main:
            part = torch.load(path)
    return part
