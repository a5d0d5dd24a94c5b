"""Chat prompts that the verifier writes for itself (`--source chat-stdlib`, `chat-prose`).

Stage 1 (here): for each seed of a source's stream (sources.seed_stream) the verifier is
asked, through its chat template, to write a user instruction of one style (explain, write code,
summarise, paraphrase, ...) about the seed, greedily or sampled with a per-candidate seed. The
text it writes up to its end-of-turn token, cleaned, becomes a user turn rendered with the chat
template and the generation prompt, exactly as `treeflash-run --chat` renders a prompt.
Stage 2 (dataset.prepare_data): the verifier's answers to those turns are the training data.

Candidates that fail the cleaning rules are rejected and counted, so a split takes the first
`count` accepted candidates of its stream: prompt i depends only on the seed, the source and the
split, and a later run asking for more prompts reuses every cached candidate.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import ConfigError
from ..fsutil import atomic_torch_save
from . import data  # its functions through the module, so a test can count the generation calls
from .config import TrainConfig
from .distributed import World
from .files import Prompt, render
from .sources import Seed, seed_stream

# Name the chat caches together with the settings. CHAT_RECIPE: bump it when the styles change (it
# names the raw candidates); CLEAN_RECIPE: when the cleaning changes (it names the answers' caches,
# since it decides which candidates are kept, but not the raw candidates, which are reused).
CHAT_RECIPE = 4
CLEAN_RECIPE = 2
MIN_WORDS, MAX_CHARS = 4, 400
REJECTIONS = ("unfinished", "empty", "too short", "too long", "echo", "answer-like", "over --prompt-tokens")
# Stage 1's system turn: a small verifier otherwise often answers the request, or plays the assistant.
WRITER = "You write one message that a user would send to an AI assistant. You never answer it."
_LABEL = re.compile(r"^\W*(question|instruction|request|prompt|user|task|answer)\s*\d*\s*:\s*", re.IGNORECASE)
# A complete sentence's end: . ? or ! after a word or a closing bracket or quote (not "1." of a list),
# followed by white space or the end of the text.
_SENTENCE_END = re.compile(r"(?<=[\w)\]`'\"\u201d])(?<!\d)[.?!](?=\s|$)")
# Openings of an assistant's reply, not of a user's message (the verifier slipping into its usual role).
_ANSWER = re.compile(r"^(sure|certainly|of course|here('s| is| are)|i('m| am) (ready|here|happy|glad)|i('ll| will)"
                     r"|as an ai|in order to)\b", re.IGNORECASE)


@dataclass(frozen=True)
class Style:
    name: str
    ask: str  # the request to the verifier, with {topic} and {text}
    attach: bool  # the seed text follows the instruction in the user turn (a task on that text)
    direct: str  # a hand-written instruction of this style (held-out benchmark prompts)


_MODULE = 'The Python standard-library module `{topic}` is described as: "{text}"\n\n'
_PASSAGE = "Here is a passage from {topic} by William Shakespeare:\n\n{text}\n\n"
_ONLY = " Reply with the {what} only."
STYLES: dict[str, tuple[Style, ...]] = {
    "chat-stdlib": (
        Style("explain", _MODULE + "Write one question a Python beginner could ask an assistant about what this "
              "module is for and how to use it. Name the module." + _ONLY.format(what="question"), False,
              "What is the Python module `{topic}` for, and how do I use it?"),
        Style("code", _MODULE + "Write one request asking an assistant to write a short Python function that uses "
              "this module for a practical task. Name the module." + _ONLY.format(what="request"), False,
              "Write a short Python function that uses the `{topic}` module for a practical task."),
        Style("answer", _MODULE + "Write one specific question about this module that can be answered in a few "
              "sentences. Name the module." + _ONLY.format(what="question"), False,
              "In a few sentences: when should I use the `{topic}` module rather than something else?"),
        Style("summarise", _MODULE + "Write one instruction asking an assistant to summarise the main features "
              "of this module in a short list. Name the module." + _ONLY.format(what="instruction"), False,
              "Summarise the main features of the Python module `{topic}` in a short list."),
    ),
    "chat-prose": (
        Style("summarise", _PASSAGE + "Write one instruction asking an assistant to summarise a passage. Do not "
              "quote the passage." + _ONLY.format(what="instruction"), True,
              "Summarise this passage from {topic} in two sentences:"),
        Style("paraphrase", _PASSAGE + "Write one instruction asking an assistant to rewrite a passage in plain "
              "modern English. Do not quote the passage." + _ONLY.format(what="instruction"), True,
              "Rewrite this passage from {topic} in plain modern English:"),
        Style("continue", _PASSAGE + "Write one instruction asking an assistant to continue a passage with a few "
              "more lines in the same style. Do not quote the passage." + _ONLY.format(what="instruction"), True,
              "Continue this passage from {topic} with a few more lines in the same style:"),
        Style("explain", _PASSAGE + "Write one instruction asking an assistant to explain what a passage means and "
              "who is speaking. Do not quote the passage." + _ONLY.format(what="instruction"), True,
              "Explain what this passage from {topic} means:"),
        # The passage follows every prose message: a question "about this passage" needs it.
        Style("answer", _PASSAGE + "Write one question about the characters, events or themes of {topic} that "
              "this passage brings to mind." + _ONLY.format(what="question"), True,
              "What does this passage from {topic} tell us about its characters?"),
    ),
}


def style_of(source: str, index: int) -> Style:
    """Candidates take the source's styles in turn, so every style gets its share."""
    styles = STYLES[source]
    return styles[index % len(styles)]


def user_turn(instruction: str, seed: Seed, style: Style) -> str:
    return f"{instruction}\n\n{seed.text}" if style.attach else instruction


def stop_ids(tok) -> set[int]:
    """The tokens that end the verifier's turn: its EOS and the chat template's end-of-turn token."""
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    for name in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        tid = tok.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != tok.unk_token_id:
            ids.add(tid)
    return ids


def _shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def clean_instruction(ids: list[int], tok, stops: set[int], ask: str = "") -> tuple[str | None, str]:
    """(instruction, "") or (None, the rejection reason, one of REJECTIONS).

    The text is cut at the first end-of-turn token. With none within the budget it is cut after its
    last complete sentence (a small verifier often runs on past a finished request), and is
    "unfinished" when it has none. The text then loses surrounding whitespace and quotes and a
    leading label ("Question:"). It must keep at least MIN_WORDS words and at most MAX_CHARS
    characters, must not repeat five words in a row of the request's own wording `ask` ("echo":
    the verifier restating what it was asked) and must not open like an assistant's reply
    ("answer-like": "Sure, ...", "I'm ready to ...")."""
    cut = next((i for i, t in enumerate(ids) if t in stops), None)
    text = tok.decode(ids if cut is None else ids[:cut], skip_special_tokens=True).strip()
    if cut is None:
        ends = [m.end() for m in _SENTENCE_END.finditer(text)]
        if not ends:
            return None, "unfinished"
        text = text[: ends[-1]]
    text = _LABEL.sub("", text).strip().strip("\"'\u201c\u201d").strip()
    if not text:
        return None, "empty"
    if len(text.split()) < MIN_WORDS:
        return None, "too short"
    if len(text) > MAX_CHARS:
        return None, "too long"
    if _ANSWER.match(text):
        return None, "answer-like"
    fixed = re.sub(r"\{\w+\}", " | ", ask)  # the request's wording, not the seed's
    if _shingles(text) & set().union(*(_shingles(part) for part in fixed.split("|"))):
        return None, "echo"
    return text, ""


@dataclass
class ChatPrompts:
    ids: list[list[int]]  # the rendered user turns, each at most --prompt-tokens long
    texts: list[str]  # their user turns as text
    rejected: Counter  # reason -> count, over the candidates read
    candidates: int  # candidates read to find them

    def take(self, turn: str | None, reason: str, name: str, tok, prompt_tokens: int) -> None:
        """One candidate: kept when it has no rejection reason and its user turn, rendered with the
        chat template, fits in prompt_tokens; otherwise its reason is counted."""
        if not reason:
            ids = render(Prompt(name, messages=(("user", turn),)), tok)
            if len(ids) <= prompt_tokens:
                self.ids.append(ids)
                self.texts.append(turn)
                return
            reason = "over --prompt-tokens"
        self.rejected[reason] += 1

    def reasons(self) -> str:
        """The rejections, most frequent first ('12 unfinished, 3 echo')."""
        return ", ".join(f"{n} {r}" for r, n in self.rejected.most_common())


def chat_fields(source: str, cfg: TrainConfig) -> tuple:
    """The settings that name a chat source's cached answers (TrainConfig.data_key's `chat`)."""
    return (source, cfg.instruction_tokens, cfg.instruction_temperature, CHAT_RECIPE, CLEAN_RECIPE)


def instruction_key(verifier_key: str, source: str, split: str, cfg: TrainConfig) -> str:
    """Names the cached stage-1 candidates: every setting they depend on (not the prompt or
    continuation lengths, which only decide which of them are used)."""
    fields = (verifier_key, source, split, cfg.seed, cfg.instruction_tokens, cfg.instruction_temperature,
              CHAT_RECIPE)
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]


def _generate_candidates(verifier, tok, source: str, split: str, seeds: list[Seed], first: int, cfg: TrainConfig,
                         work: Path, stem: str, world: World, pad_id: int) -> list[list[int]] | None:
    """The verifier's raw instructions for candidates first.. first+len(seeds)-1; each rank writes its
    share, rank 0 gets them all (the other ranks get None)."""
    from tqdm import tqdm

    mine = world.shard(len(seeds))
    new = None
    if len(mine):
        index = range(first + mine.start, first + mine.stop)
        asks = [render(Prompt(f"{source} {split} candidate {i}", messages=(
            ("system", WRITER), ("user", style_of(source, i).ask.format(topic=s.topic, text=s.text)))), tok)
            for i, s in zip(index, seeds[mine.start : mine.stop])]
        bar = tqdm(total=len(asks) * cfg.instruction_tokens, desc=f"verifier instructions ({source}, {split})",
                   unit="tok", leave=False, disable=not world.main)
        width = max(map(len, asks))
        new = data.generate_data(verifier, asks, [], cfg.instruction_tokens, cfg.gen_batch,
                            progress=lambda done, total: bar.update(done - bar.n), width=width, pad_id=pad_id,
                            temperature=cfg.instruction_temperature,
                            seeds=[data.prompt_seed(cfg.seed, f"{source}/{split}/instruction", i) for i in index],
                            stops=stop_ids(tok))  # a batch whose every instruction has ended stops there
        bar.close()
        new = {"tokens": new["tokens"][:, width:]}
    new = data.join_shares(new, work, stem, world, len(seeds))
    return None if new is None else new["tokens"].tolist()


def chat_prompts(verifier, tok, verifier_key: str, source: str, split: str, count: int, cfg: TrainConfig,
                 work: Path, log: Callable[[str], None] = print, *, world: World = World(),
                 pad_id: int = 0) -> ChatPrompts:
    """The first `count` accepted chat prompts of a source's split (see the module docstring).

    Candidates are generated in rounds sized to what is still missing, and cached (raw, before
    cleaning) in `work`, so an interrupted or larger run regenerates none of them."""
    stem = f"instructions-{source}-{split}-{instruction_key(verifier_key, source, split, cfg)}"
    Path(work).mkdir(parents=True, exist_ok=True)
    path = Path(work) / f"{stem}.pt"
    raw: list[list[int]] = torch.load(path) if path.exists() else []
    stream, seeds = seed_stream(source, split, cfg.seed), []
    stops = stop_ids(tok)
    out = ChatPrompts([], [], Counter(), 0)
    limit = 4 * count + 4 * cfg.gen_batch  # a source whose instructions keep failing stops here
    while len(out.ids) < count:
        i = out.candidates
        if i == len(raw):  # generate what is missing, with a margin for rejections
            if i >= limit:
                raise ConfigError(f"{source}: only {len(out.ids)} of {count} {split} instructions were usable after "
                                  f"{i} tries ({out.reasons()}); raise --instruction-tokens or --prompt-tokens")
            want = min(limit - i, max(cfg.gen_batch, round((count - len(out.ids)) * 1.3) + 8))
            while len(seeds) < i + want:
                seeds.append(next(stream))
            new = _generate_candidates(verifier, tok, source, split, seeds[i : i + want], i, cfg, work, stem, world,
                                       pad_id)
            if world.main:
                atomic_torch_save(raw + new, path)
            world.barrier()  # every rank reads the same candidates
            raw = torch.load(path)
        while len(seeds) <= i:
            seeds.append(next(stream))
        out.candidates += 1
        style = style_of(source, i)
        text, reason = clean_instruction(raw[i], tok, stops, style.ask)
        out.take(None if text is None else user_turn(text, seeds[i], style), reason,
                 f"{source} {split} candidate {i}", tok, cfg.prompt_tokens)
    if out.rejected:
        log(f"{source} {split}: {count} instructions from {out.candidates} candidates; rejected {out.reasons()}")
    return out


def heldout_prompts(source: str, tokenizer, count: int, seed: int = 1234) -> list[list[int]]:
    """`count` benchmark prompts of a chat domain: each style's hand-written instruction about a
    held-out seed, rendered with the chat template (no verifier pass, so the benchmark needs none)."""
    stream = seed_stream(source, "heldout", seed)
    prompts = []
    for i in range(count):
        s, style = next(stream), style_of(source, i)
        turn = user_turn(style.direct.format(topic=s.topic, text=s.text), s, style)
        prompts.append(render(Prompt(f"{source} held-out {i}", messages=(("user", turn),)), tokenizer))
    return prompts
