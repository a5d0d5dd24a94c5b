"""Everyday chat prompts that the verifier writes itself (`--source chat-self`): no seed text, no download.

The verifier's chat template is rendered up to the start of a user turn (with the template's own
default system turn, if it has one) and the verifier continues it: it writes what a user would
type to it, up to its end-of-turn token. Two in three candidates are steered by an opening of a
few words (OPENERS: the forms of everyday requests, explanations, lists, how-tos, small coding
questions) that the verifier completes; the others start from nothing. Candidates are sampled
(--instruction-temperature, seeded per candidate) in batches of --gen-batch, left-padded with an
attention mask, and a batch stops once every row has ended its turn.

Candidates are cleaned (finish_turn, check_turn) and deduplicated, and the kept turns, rendered
with the chat template and the generation prompt as `treeflash-run --chat` renders a prompt, are
the source's prompts; the verifier's answers to them are the training data (dataset.py).

Splits: the training and held-out splits sample from their own seeded streams; besides, a
training turn whose normalised text is one of the first HELDOUT_POOL held-out turns is rejected,
so no held-out prompt (of a benchmark or run with up to HELDOUT_POOL of them) is trained on: the
run's own held-out turns, and, for a run with the benchmark's instruction settings but another
--seed, the benchmark's too (`treeflash-bench --heldout-domain chat-self`: the held-out split under
BENCH_SETTINGS), whose stream the run's seed would otherwise not avoid.
A split takes the first `count` accepted candidates of its stream, so a larger run reuses every
cached candidate, and the raw candidates are saved after every batch: an interrupted run loses
one batch at most.
"""

from __future__ import annotations

import hashlib
import random
import re
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import torch

from ..errors import ConfigError
from ..fsutil import atomic_torch_save
from . import data  # its functions through the module, so a test can count the generation calls
from .chat import _ANSWER, _SENTENCE_END, ChatPrompts, stop_ids
from .config import TrainConfig
from .distributed import World

SOURCE = "chat-self"
# SELF_RECIPE: bump it when the openers or the prefix change (it names the raw candidates);
# SELF_CLEAN: when check_turn or the held-out pool change (it names the answers' caches only).
SELF_RECIPE = 1
SELF_CLEAN = 1
HELDOUT_POOL = 64
BENCH_SETTINGS = {"prompt_tokens": 160, "gen_batch": 64}  # the benchmark's held-out turns (heldout_turns)
MIN_WORDS, MAX_CHARS = 4, 400
REJECTIONS = ("unfinished", "empty", "too short", "too long", "not English", "answer-like", "malformed",
              "duplicate", "held-out", "over --prompt-tokens")
# Openings of everyday requests; the verifier writes the rest. "" (twice in every three) = no opening.
OPENERS = (
    "How do I", "How can I", "How does", "What is", "What are some", "What's the difference between",
    "Why do", "Why is", "Can you explain", "Can you help me", "Could you give me", "Explain", "Give me a list of",
    "List", "Write a", "Write a short", "Write a Python function", "Tell me about", "Describe", "Summarize",
    "Suggest", "I need", "I'm trying to", "Is it", "Should I", "Which", "When should I", "Compare", "Help me",
    "What should I",
)
_MARK = "\x00user-turn\x00"
# Other ways a small model slips into the assistant's role, or writes both sides of a dialogue.
_GREETING = re.compile(r"^(hello|hi|hey)\b.{0,40}?\b(how (can|may) i (help|assist)|i('m| am) (an? )?(ai|assistant|"
                       r"smollm))", re.IGNORECASE)
_ROLE_LINE = re.compile(r"(^|\n)\s*(q|a|question|answer|assistant|user|ai|smollm|response|output)\s*\d*\s*:",
                        re.IGNORECASE)
_LIST_START = re.compile(r"^\s*(\d+[.)]|[-*\u2022])\s")


def opener(split: str, seed: int, index: int) -> str:
    """Candidate `index`'s opening words ("" for none): fixed by its place in its split's stream."""
    rng = random.Random(f"{SOURCE}/{split}/{seed}/opener/{index}")
    return "" if rng.random() < 1 / 3 else rng.choice(OPENERS)


def turn_seed(seed: int, split: str, index: int) -> int:
    """Candidate `index`'s sampling seed (one stream per split)."""
    return data.prompt_seed(seed, f"{SOURCE}/{split}/turn", index)


def user_prefix(tok, start: str = "") -> list[int]:
    """The chat template rendered up to the start of a user turn's text, followed by `start`."""
    text = tok.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
    return list(tok(text[: text.index(_MARK)] + start, add_special_tokens=False)["input_ids"])


def normalise(text: str) -> str:
    """The key of deduplication: lower-case words and numbers only."""
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def finish_turn(ids: list[int], tok, stops: set[int], start: str = "") -> tuple[str | None, str]:
    """(the user turn's text, "") or (None, "unfinished"): `start` plus the text up to the first
    end-of-turn token; with none within the budget, up to the last complete sentence."""
    cut = next((i for i, t in enumerate(ids) if t in stops), None)
    text = (start + tok.decode(ids if cut is None else ids[:cut], skip_special_tokens=True)).strip()
    if cut is None:
        ends = [m.end() for m in _SENTENCE_END.finditer(text)]
        if not ends:
            return None, "unfinished"
        text = text[: ends[-1]]
    return text.strip().strip("\"'\u201c\u201d").strip(), ""


def check_turn(text: str) -> str:
    """"" for a user turn worth keeping, else the rule it breaks (one of REJECTIONS):
    "empty"; "too short" (fewer than MIN_WORDS words); "too long" (over MAX_CHARS characters);
    "not English" (under 97 % of its letters ASCII, or letters under half of its characters);
    "answer-like" (opens as an assistant's reply or greeting); "malformed" (opens as a list item,
    holds a dialogue's role label such as "A:" or a template token, ends on a colon that announces
    text which never comes, or repeats itself: under 40 % distinct words in 12 or more)."""
    if not text:
        return "empty"
    words = text.split()
    if len(words) < MIN_WORDS:
        return "too short"
    if len(text) > MAX_CHARS:
        return "too long"
    letters = [c for c in text if c.isalpha()]
    if sum(c.isascii() for c in letters) < 0.97 * len(letters) or len(letters) < 0.5 * len(text):
        return "not English"
    if _ANSWER.match(text) or _GREETING.match(text):
        return "answer-like"
    lowered = [w.lower() for w in words]
    if (_LIST_START.match(text) or _ROLE_LINE.search(text) or "<|" in text or "|>" in text or text.endswith(":")
            or (len(words) >= 12 and len(set(lowered)) < 0.4 * len(words))):
        return "malformed"
    return ""


def self_fields(cfg: TrainConfig) -> tuple:
    """The settings that name chat-self's cached answers (TrainConfig.data_key's `chat`)."""
    return (SOURCE, cfg.instruction_tokens, cfg.instruction_temperature, SELF_RECIPE, SELF_CLEAN)


def turns_key(verifier_key: str, split: str, cfg: TrainConfig) -> str:
    """Names the cached raw candidates of a split: every setting they depend on."""
    fields = (verifier_key, SOURCE, split, cfg.seed, cfg.instruction_tokens, cfg.instruction_temperature,
              SELF_RECIPE)
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]


def _extend(raw: list[list[int]], upto: int, verifier, tok, split: str, cfg: TrainConfig, path: Path,
            log: Callable[[str], None], world: World, pad_id: int) -> list[list[int]]:
    """Raw candidates up to index `upto`, generated batch by batch after the cached ones; the cache
    file is rewritten after every batch (every rank generating its share of it)."""
    stops = stop_ids(tok)
    t0, first, written = time.perf_counter(), len(raw), 0
    while len(raw) < upto:
        start = len(raw)
        n = min(cfg.gen_batch * world.size, upto - start)
        mine = world.shard(n)
        new = None
        if len(mine):
            index = range(start + mine.start, start + mine.stop)
            starts = [opener(split, cfg.seed, i) for i in index]
            asks = [user_prefix(tok, s) for s in starts]
            width = max(map(len, asks))
            out = data.generate_data(verifier, asks, [], cfg.instruction_tokens, cfg.gen_batch, width=width,
                                     pad_id=pad_id, temperature=cfg.instruction_temperature,
                                     seeds=[turn_seed(cfg.seed, split, i) for i in index], stops=stops)
            new = {"tokens": out["tokens"][:, width:]}
        new = data.join_shares(new, path.parent, path.stem, world, n)
        if world.main:
            raw = raw + new["tokens"].tolist()
            atomic_torch_save(raw, path)
            written += n
            rate = written / (time.perf_counter() - t0)
            log(f"{SOURCE} {split}: {len(raw)} candidate user turns cached ({written} new, {rate:.1f}/s)")
        world.barrier()  # every rank reads the same candidates
        raw = torch.load(path)
    if len(raw) > first and world.main:
        log(f"{SOURCE} {split}: wrote {len(raw) - first} candidates in {time.perf_counter() - t0:.0f} s")
    return raw


def self_chat_prompts(verifier, tok, verifier_key: str, split: str, count: int, cfg: TrainConfig, work: Path,
                      log: Callable[[str], None] = print, *, world: World = World(), pad_id: int = 0) -> ChatPrompts:
    """The first `count` accepted user turns of a split, rendered for the verifier (see the module
    docstring); the training split first reads (or writes) the held-out pool it must avoid."""
    if not cfg.instruction_temperature > 0:
        raise ConfigError(f"--source {SOURCE} samples the user turns: --instruction-temperature must be > 0")
    avoid: set[str] = set()
    if split == "train":
        bench = TrainConfig(**BENCH_SETTINGS)
        same_instructions = (cfg.instruction_tokens, cfg.instruction_temperature) == (
            bench.instruction_tokens, bench.instruction_temperature)
        pools = [cfg] + ([bench] if same_instructions and cfg.seed != bench.seed else [])
        for pool in pools:
            held = self_chat_prompts(verifier, tok, verifier_key, "heldout", HELDOUT_POOL, pool, work, log,
                                     world=world, pad_id=pad_id)
            avoid |= {normalise(t) for t in held.texts}
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"turns-{SOURCE}-{split}-{turns_key(verifier_key, split, cfg)}.pt"
    raw: list[list[int]] = torch.load(path) if path.exists() else []
    stops = stop_ids(tok)
    out, seen = ChatPrompts([], [], Counter(), 0), set()
    limit = 6 * (count + len(avoid)) + 4 * cfg.gen_batch  # a verifier whose turns keep failing stops here
    while len(out.ids) < count:
        i = out.candidates
        if i == len(raw):  # write what is missing, with a margin for rejections
            if i >= limit:
                raise ConfigError(f"{SOURCE}: only {len(out.ids)} of {count} {split} user turns were usable after "
                                  f"{i} tries ({out.reasons()}); raise --instruction-tokens or --prompt-tokens")
            want = min(limit - i, max(cfg.gen_batch, round((count - len(out.ids)) * 1.25) + 8))
            raw = _extend(raw, i + want, verifier, tok, split, cfg, path, log, world, pad_id)
        out.candidates += 1
        text, reason = finish_turn(raw[i], tok, stops, opener(split, cfg.seed, i))
        if text is not None:
            reason = check_turn(text)
        if not reason:
            key = normalise(text)
            reason = "duplicate" if key in seen else "held-out" if key in avoid else ""
            seen.add(key)
        out.take(text, reason, f"{SOURCE} {split} candidate {i}", tok, cfg.prompt_tokens)
    if out.rejected:
        log(f"{SOURCE} {split}: {count} user turns from {out.candidates} candidates; rejected {out.reasons()}")
    return out


def heldout_turns(verifier_path: Path, tok, count: int, cache: Path) -> list[list[int]]:
    """The benchmark's held-out chat-self prompts: the first `count` of the held-out split that a
    run with the demo recipe's settings (--prompt-tokens 160, the instruction defaults) uses,
    generated once per verifier (by content) and cached in `cache`."""
    from ..checkpoints import checkpoint_fingerprint, load_verifier, resolve_checkpoint

    cfg = TrainConfig(**BENCH_SETTINGS)
    verifier_path = resolve_checkpoint(verifier_path, "verifier")
    verifier = load_verifier(verifier_path, dtype=torch.float32, device="cpu")
    pad_id = next((t for t in (tok.pad_token_id, tok.eos_token_id) if t is not None), 0)
    return self_chat_prompts(verifier, tok, checkpoint_fingerprint(verifier_path), "heldout", count, cfg,
                             cache, lambda m: None, pad_id=pad_id).ids
