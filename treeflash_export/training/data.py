"""Data generation: the verifier's own continuations of prompts, with the tapped hidden states.

The verifier continues prompts in batches with a preallocated cache, greedily or sampled
(`--gen-temperature`, seeded per prompt). Also here: windows of standard-library code as
prompts, the end of a chat turn, and the pieces of the per-split cache (an earlier cache whose
prompts lead the wanted ones; under torchrun, every rank's share joined by rank 0). Which
prompts of which source make up a split is dataset.py's business.
"""

from __future__ import annotations

import hashlib
import inspect
import random
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..fsutil import atomic_torch_save
from .distributed import World


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


def next_tokens(logits: torch.Tensor, temperature: float = 0.0, generators: list | None = None) -> torch.Tensor:
    """[b, V] logits -> [b, 1] tokens: the argmax at temperature 0, else a sample of
    softmax(logits / T) by Gumbel-max, row r drawing its noise from generators[r]. The noise is
    drawn on the CPU, so a seed gives the same tokens on any device and in any batch."""
    if not temperature:
        return logits.argmax(-1, keepdim=True)
    u = torch.stack([torch.rand(logits.shape[-1], generator=g, dtype=torch.float64) for g in generators])
    gumbel = -torch.log(-torch.log(u))  # u = 0 gives -inf: that token is never drawn
    return (logits.double() / temperature + gumbel.to(logits.device)).argmax(-1, keepdim=True)


def prompt_seed(seed: int, split: str, index: int) -> int:
    """The sampling seed of one prompt: fixed by its place in its split, not by its batch or rank."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{split}/{index}".encode()).digest()[:8], "little")


def cache_argument(model) -> str:
    """The name under which the model's forward takes its KV cache: ``cache`` from transformers 5.24,
    ``past_key_values`` before (5.24 still accepts the old name with a warning; 5.40 drops it)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def generate_data(verifier, prompts: list[list[int]], tap_ids: list[int], new_tokens: int, batch: int,
                  progress: Callable | None = None, *, width: int | None = None, pad_id: int = 0,
                  temperature: float = 0.0, seeds: list[int] | None = None,
                  stops: set[int] | None = None) -> dict[str, torch.Tensor]:
    """Continuations (no EOS stop) and the tapped hidden states of every position.

    One pass per batch: the prompt's prefill, then one cached step per new token, keeping
    the taps of each step (no second pass over the finished sequences). `progress(done,
    total)` counts generated tokens. Runs on the verifier's device; the result is on the CPU.

    Prompts of different lengths are left-padded to the longest of their batch, with an
    attention mask and position ids counted from each prompt's own first token, so each row
    gets the continuation and taps of its prompt alone (up to float rounding). With `width`,
    rows are stored left-padded to `width` prompt columns (token pad_id, features 0) and "pad"
    holds each row's count of padding columns; without it all prompts must have one length
    (the corpus data, stored without "pad"). temperature > 0 samples, prompt i drawing from its
    own generator seeded by seeds[i]; 0 is greedy. With no tap_ids the features are empty ([.., 0]).

    `stops` (chat instructions and user turns, whose text ends at the first end-of-turn token): a
    batch ends as soon as every row has written one of these tokens, and its remaining columns are
    pad_id (features 0). Each row's tokens up to its first stop are the same as without `stops`
    (its sampling noise comes from its own generator, one draw per step)."""
    from transformers import StaticCache

    lengths = [len(p) for p in prompts]
    store_pad = width is not None
    if width is None and len(set(lengths)) > 1:
        raise ValueError("prompts of different lengths need a width to be stored")
    width = width or lengths[0]
    if max(lengths) > width:
        raise ValueError(f"a prompt of {max(lengths)} tokens does not fit in width {width}")
    tokens, feats, pads = [], [], []
    total, done = len(prompts) * new_tokens, 0
    dev = verifier.device
    keep_taps = bool(tap_ids)
    cache_arg = cache_argument(verifier)

    def taps(out, positions: int):
        if not keep_taps:  # instructions (chat.py): the tokens alone, no hidden states kept
            return torch.zeros(len(out.logits), positions, 0, dtype=torch.float16, device=dev)
        return torch.cat([out.hidden_states[t + 1] for t in tap_ids], dim=-1).to(torch.float16)

    for i in range(0, len(prompts), batch):
        rows = prompts[i : i + batch]
        longest = max(lengths[i : i + batch])
        pad = torch.tensor([longest - len(p) for p in rows])
        ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in rows], device=dev)
        gens = [torch.Generator().manual_seed(s) for s in seeds[i : i + batch]] if temperature else None
        # Only a padded batch gets a mask: an unpadded one runs exactly as before.
        mask = (torch.arange(longest)[None] >= pad[:, None]).long().to(dev) if pad.any() else None
        pos = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
        # A preallocated cache: a growing one is copied whole at every step.
        cache = StaticCache(config=verifier.config, max_cache_len=longest + new_tokens)
        out = verifier(ids, **{cache_arg: cache}, use_cache=True, output_hidden_states=keep_taps,
                       logits_to_keep=1, cache_position=torch.arange(longest, device=dev), attention_mask=mask,
                       position_ids=pos)
        seq, feat = [ids], [taps(out, longest)]
        ended = torch.zeros(len(rows), dtype=torch.bool)
        stop_ids = torch.tensor(sorted(stops or ()), dtype=torch.long)
        for step, cache_pos in enumerate(range(longest, longest + new_tokens)):
            nxt = next_tokens(out.logits[:, -1], temperature, gens)
            seq.append(nxt)
            if stops:
                ended |= torch.isin(nxt[:, 0].cpu(), stop_ids)
                if bool(ended.all()):  # every row's text is complete: the rest is padding
                    rest = longest + new_tokens - cache_pos - 1
                    seq.append(torch.full((len(rows), rest), pad_id, dtype=nxt.dtype, device=dev))
                    feat.append(torch.zeros(len(rows), rest + 1, feat[0].shape[2], dtype=torch.float16, device=dev))
                    done += len(ids) * (rest + 1)
                    if progress:
                        progress(done, total)
                    break
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
                pos = pos[:, -1:] + 1
            out = verifier(nxt, **{cache_arg: cache}, use_cache=True, output_hidden_states=keep_taps,
                           cache_position=torch.tensor([cache_pos], device=dev), attention_mask=mask,
                           position_ids=pos)
            feat.append(taps(out, 1))
            done += len(ids)
            if progress:
                progress(done, total)
        seq, feat = torch.cat(seq, dim=1).to(torch.int32).cpu(), torch.cat(feat, dim=1).cpu()
        pad = pad + width - longest  # to the common width: the prompt ends at column `width` in every row
        seq = F.pad(seq, (width - longest, 0), value=pad_id)
        # zeros in front by concatenation: F.pad before torch 2.7 rejects the empty feature axis (no taps)
        feat = torch.cat([feat.new_zeros(feat.shape[0], width - longest, feat.shape[2]), feat], dim=1)
        feat.masked_fill_((torch.arange(seq.shape[1]) < pad[:, None])[..., None], 0.0)
        tokens.append(seq)
        feats.append(feat)
        pads.append(pad.to(torch.int32))
    out = {"tokens": torch.cat(tokens), "features": torch.cat(feats)}
    if store_pad:
        out["pad"] = torch.cat(pads)
    return out


def turn_ends(tokens: torch.Tensor, start: int, stops: set[int]) -> torch.Tensor | None:
    """[n] the first end-of-turn position of each row at or after column `start` (where the
    continuation begins), or the last column when the row has none; None when no row has one.

    Generation does not stop at the end of a turn (a batch runs its full length), so a chat answer
    shorter than --continuation-tokens is followed by whatever the verifier writes next; training
    gives those positions no weight (train.block_loss)."""
    if not stops:
        return None
    hit = torch.isin(tokens[:, start:], torch.tensor(sorted(stops), dtype=tokens.dtype))
    if not bool(hit.any()):
        return None
    last = tokens.shape[1] - 1
    first = torch.where(hit.any(1), hit.int().argmax(1) + start, torch.full_like(hit[:, 0], last, dtype=torch.long))
    return first.long()


def cached_rows(work: Path, stem: str, prompts: torch.Tensor, log: Callable[[str], None]):
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


def join_shares(new: dict | None, work: Path, stem: str, world: World, total: int) -> dict | None:
    """Rank 0 gets every rank's newly generated rows, in rank order; the other ranks get None.
    Shares travel through the work folder (one machine or a shared file system), as the cache does."""
    if world.size == 1:
        return new
    share = lambda r: work / f".{stem}.share{r}.pt"  # noqa: E731
    if new is not None:
        atomic_torch_save(new, share(world.rank))
    world.barrier()
    if not world.main:
        return None
    ranks = [r for r in range(world.size) if len(World(r, world.size).shard(total))]
    shares = [torch.load(share(r)) for r in ranks]
    for r in ranks:
        share(r).unlink()
    return {k: torch.cat([s[k] for s in shares]) for k in shares[0]}
