"""Prompts from the user's own files for `treeflash-export train --data`.

Formats: JSON Lines (`.jsonl`, `.ndjson`) or Parquet (`.parquet`, needs pyarrow), one record
per line or row, in any of the shapes people already have:
- `{"prompt": str}` or `{"text": str}`: a raw text prompt, tokenised exactly as `treeflash-run
  --prompt` tokenises it without `--chat` (the tokenizer's own special tokens, no template);
- `{"messages": [{"role", "content"}, ...]}` (OpenAI style; content a string or a list of
  `{"type": "text", "text"}` parts);
- `{"conversations": [{"from", "value"}, ...]}` (ShareGPT style; from = human/user,
  gpt/assistant or system).

A conversation keeps its system and user turns up to, and excluding, the first assistant turn,
rendered with the verifier's chat template and the generation prompt (as `treeflash-run --chat`
does). The assistant turns are dropped on purpose: the verifier regenerates the answer, because
the drafter must learn the verifier's own distribution, not the data set's.

Every tenth usable record (by position in the files, counting from the first) is held out.
A malformed record is reported with its file and line (or row) and skipped; a file that cannot be
read, has an unsupported type or holds no records is a one-line ConfigError naming it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..errors import ConfigError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}


@dataclass(frozen=True)
class Prompt:
    where: str  # "file:line" (or "file:row N"), for messages about this record
    text: str | None = None  # a raw prompt
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) turns before the first assistant turn


class BadRecord(ValueError):
    """A record that is skipped; the message says what is wrong with it."""


# ---------------------------------------------------------------- reading


def _jsonl_records(path: Path) -> Iterator[tuple[str, object]]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue  # blank lines (a trailing newline) are not records
            try:
                yield f"{path}:{number}", json.loads(line)
            except json.JSONDecodeError as exc:
                yield f"{path}:{number}", BadRecord(f"bad JSON ({exc.msg})")


def _parquet_records(path: Path) -> Iterator[tuple[str, object]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{path}: reading Parquet needs pyarrow: pip install 'treeflash-export[train]'") from None
    try:
        table = pq.ParquetFile(path)
        row = 0
        for batch in table.iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                row += 1
                yield f"{path}:row {row}", record
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise ConfigError(f"cannot read {path} as Parquet: {str(exc).splitlines()[0]}") from None


def read_records(path: Path) -> Iterator[tuple[str, object]]:
    """(where, record or BadRecord) for every record of one file."""
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        reader = _jsonl_records
    elif name.endswith(PARQUET_SUFFIXES):
        reader = _parquet_records
    else:
        raise ConfigError(f"--data {path}: unsupported file type; use JSON Lines (.jsonl) or Parquet (.parquet)")
    if not path.is_file():
        raise ConfigError(f"--data {path}: no such file")
    empty = True
    try:
        for item in reader(path):
            empty = False
            yield item
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if empty:
        raise ConfigError(f"--data {path} holds no records")


# ---------------------------------------------------------------- parsing


def _content(value, what: str) -> str:
    if isinstance(value, list):  # OpenAI content parts: only text parts carry a prompt
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
            raise BadRecord(f"{what} is a list with parts other than text parts")
        value = "".join(p["text"] for p in value)
    if not isinstance(value, str):
        raise BadRecord(f"{what} is not a string")
    return value


def _turns(turns, role_key: str, content_key: str, field: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(turns, list) or not turns:
        raise BadRecord(f"'{field}' is not a non-empty list")
    kept = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRecord(f"{field}[{i}] is not an object")
        role = ROLES.get(turn.get(role_key)) if isinstance(turn.get(role_key), str) else None
        if role is None:
            raise BadRecord(f"{field}[{i}].{role_key} is {turn.get(role_key)!r}; use one of {', '.join(ROLES)}")
        if role == "assistant":
            break  # the verifier writes the answer itself
        kept.append((role, _content(turn.get(content_key), f"{field}[{i}].{content_key}")))
    if not any(role == "user" for role, _ in kept):
        raise BadRecord(f"'{field}' has no user turn before the first assistant turn")
    return tuple(kept)


def parse_record(where: str, record) -> Prompt:
    """The prompt of one record, or BadRecord saying why it has none."""
    if isinstance(record, BadRecord):
        raise record
    if not isinstance(record, dict):
        raise BadRecord("the record is not an object")
    if record.get("messages") is not None:
        return Prompt(where, messages=_turns(record["messages"], "role", "content", "messages"))
    if record.get("conversations") is not None:
        return Prompt(where, messages=_turns(record["conversations"], "from", "value", "conversations"))
    for field in ("prompt", "text"):
        if record.get(field) is not None:
            text = _content(record[field], f"'{field}'")
            if not text.strip():
                raise BadRecord(f"'{field}' is empty")
            return Prompt(where, text=text)
    raise BadRecord("no 'prompt', 'text', 'messages' or 'conversations' field")


def load_prompts(paths: list[Path], log: Callable[[str], None]) -> list[Prompt]:
    """The usable prompts of all files, in order; malformed records are logged and counted."""
    prompts, skipped = [], 0
    for path in paths:
        before = len(prompts)
        for where, record in read_records(Path(path)):
            try:
                prompts.append(parse_record(where, record))
            except BadRecord as exc:
                skipped += 1
                log(f"{where}: skipped: {exc}")
        if len(prompts) == before:
            raise ConfigError(f"--data {path}: no usable record (see the messages above)")
    if skipped:
        log(f"skipped {skipped} malformed record(s) of {skipped + len(prompts)}")
    return prompts


def content_hash(paths: list[Path]) -> str:
    """Names the files' contents in the data cache key (their order matters: it sets the split)."""
    h = hashlib.sha256()
    for path in paths:
        try:
            with Path(path).open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        except FileNotFoundError:
            raise ConfigError(f"--data {path}: no such file") from None
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
        h.update(b"\0")
    return h.hexdigest()[:16]


def split_heldout(prompts: list[Prompt]) -> tuple[list[Prompt], list[Prompt]]:
    """(training, held-out): every tenth usable record is held out, as the corpus holds out every
    tenth file, so the split of a record depends only on its place in the files."""
    return [p for i, p in enumerate(prompts) if i % 10], [p for i, p in enumerate(prompts) if i % 10 == 0]


# ---------------------------------------------------------------- tokenising


def render(prompt: Prompt, tokenizer) -> list[int]:
    """Token ids as the verifier will see the prompt at serving time (see the module docstring)."""
    if prompt.text is not None:
        return list(tokenizer(prompt.text, add_special_tokens=True)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{prompt.where}: a conversation, but the verifier's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in prompt.messages],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def tokenise(prompts: list[Prompt], tokenizer, max_tokens: int, count: int, split: str,
             log: Callable[[str], None]) -> list[list[int]]:
    """The first `count` prompts of a split whose tokens fit in `max_tokens` (longer ones are
    skipped, not cut, so every prompt is one the verifier would really be served)."""
    kept, too_long, longest = [], 0, 0
    for p in prompts:
        if len(kept) == count:
            break
        ids = render(p, tokenizer)
        if len(ids) > max_tokens:
            too_long, longest = too_long + 1, max(longest, len(ids))
        elif ids:
            kept.append(ids)
    if too_long:
        log(f"{split}: skipped {too_long} prompt(s) longer than --prompt-tokens {max_tokens} (longest {longest})")
    if not kept:
        raise ConfigError(f"--data: no {split} prompt fits in --prompt-tokens {max_tokens}; raise it")
    if len(kept) < count:
        log(f"{split}: using all {len(kept)} prompts of the files ({count} asked for)")
    return kept
