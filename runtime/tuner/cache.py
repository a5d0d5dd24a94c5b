"""What the self-tuning tree measured, on disk: one JSON file per key under the project's cache
folder (the prior's round times, and the rule's estimates per bucket), so that the next process
starts where the last one ended.

The file name is a hash of the key; the key is also stored inside the file and compared on load,
so a hash collision, a hand-edited file or a file from another format is a miss, never a wrong
answer. Anything unreadable (truncated JSON, wrong types, a key that differs) is a miss: the
caller measures again and the new file replaces the old one atomically (temp file + os.replace),
so a reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from treeflash_export.fsutil import atomic_write_text

FORMAT = 2  # bump when the file's layout or the meaning of its numbers changes


@dataclass(frozen=True)
class CostKey:
    """What measured costs depend on. pair_fingerprint: see `checkpoints.pair_fingerprint`; device_name: e.g.
    torch.cuda.get_device_name() or 'cpu (2 threads)'; dtype: 'float32', 'bfloat16', ...; backend:
    the runner's name; version: the project's version; max_batch and capacity (the cache length S):
    the graphs' static shapes; block_size: B; options: anything else that changes the timed code
    (CUDA graphs on/off, fast kernels, the draft vocabulary), as one string; content: what the
    gains depend on beyond the shapes (the checkpoints' content and the drafter temperature; empty
    for a pair built in memory, whose gains are then not kept)."""

    pair_fingerprint: str
    device_name: str
    dtype: str
    backend: str
    version: str
    max_batch: int = 1
    capacity: int = 0
    block_size: int = 0
    options: str = ""
    content: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        blob = json.dumps({"format": FORMAT, **self.as_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:20]


def default_cache_dir() -> Path:
    """<the project's cache folder>/tuner ($TREEFLASH_CACHE or ~/.cache/treeflash)."""
    from treeflash_export.smollm import cache_root

    return cache_root() / "tuner"


class TunerStore:
    """What was measured for a key: {"prior": {bucket: {label: ms}}, "rates": Rule.to_json()}."""

    def __init__(self, root: Path | str | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()

    def path(self, key: CostKey) -> Path:
        return self.root / f"tuner-{key.digest()}.json"

    def load(self, key: CostKey, log: Callable[[str], None] | None = None) -> dict | None:
        def parse(d):
            if not isinstance(d.get("prior"), dict) or not isinstance(d.get("rates"), dict):
                raise ValueError("no prior or rates")
            return d

        return read_keyed(self.path(key), key.as_dict(), parse, "saved tuning", log, "measuring again")

    def save(self, key: CostKey, prior: dict, rates: dict) -> Path:
        return write_keyed(self.path(key), key.as_dict(), {"prior": prior, "rates": rates})


def read_keyed(path: Path, key: dict, parse: Callable[[dict], object], what: str,
               log: Callable[[str], None] | None = None, then: str = "starting afresh"):
    """parse(file's JSON) when the file exists and was written for `key` in this FORMAT; None when it
    is absent; None with a log line when it is unreadable, malformed or made for another key."""
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("key") != key:
            raise ValueError("made for another key or format")
        return parse(data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        # JSON errors are ValueErrors; wrong types surface as Key/Type/AttributeErrors.
        if log:
            log(f"tuning: ignoring the {what} {path.name} ({type(exc).__name__}: {exc}); {then}")
        return None


def write_keyed(path: Path, key: dict, payload: dict) -> Path:
    """Writes {format, key, **payload} to `path` atomically (temp file + os.replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, json.dumps({"format": FORMAT, "key": key, **payload}, indent=1, sort_keys=True))
