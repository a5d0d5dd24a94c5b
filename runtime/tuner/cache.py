"""What the self-tuning tree measured, on disk: one JSON file per key under the project's cache
folder (the prior's round times, and the rule's estimates per bucket), so that the next process
starts where the last one ended.

The file name is a hash of the key; the key is stored inside too and compared on load. Anything
unreadable (truncated JSON, wrong types, another key or format) is a miss, never a wrong answer: the
caller measures again, and the new file replaces the old one atomically (temp file + os.replace).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from treeflash_export.fsutil import atomic_write_text

from .rule import Rule, Stat

FORMAT = 4  # bump when the file's layout or the meaning of its numbers changes
LOAD_CAP = 8.0  # a saved estimate weighs at most this many rounds: the new process's rounds override it fast


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
    """What was measured for a key: {"prior": {bucket: {label: ms}}, "rates": rates_json(rule)}."""

    def __init__(self, root: Path | str | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()

    def path(self, key: CostKey) -> Path:
        return self.root / f"tuner-{key.digest()}.json"

    def load(self, key: CostKey, log: Callable[[str], None] | None = None) -> dict | None:
        """The file's {prior, rates} when it exists and was written for ``key`` in this FORMAT; None when
        it is absent; None with a log line when it is unreadable, malformed or made for another key."""
        path = self.path(key)
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT or data.get("key") != key.as_dict():
                raise ValueError("made for another key or format")
            if not isinstance(data.get("prior"), dict) or not isinstance(data.get("rates"), dict):
                raise ValueError("no prior or rates")
            return data
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # JSON errors are ValueErrors; wrong types surface as Key/Type/AttributeErrors.
            if log:
                log(f"tuning: ignoring the saved tuning {path.name} ({type(exc).__name__}: {exc}); measuring again")
            return None

    def save(self, key: CostKey, prior: dict, rates: dict) -> Path:
        """Writes {format, key, prior, rates} atomically (temp file + os.replace)."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"format": FORMAT, "key": key.as_dict(), "prior": prior, "rates": rates}
        return atomic_write_text(path, json.dumps(payload, indent=1, sort_keys=True))


def rates_json(rule: Rule) -> dict:
    """What the rule measured: each bucket's residual round times per arm, and the gains (not the
    machine's speed: the next process measures its own). A Stat is [n, mean, m2]."""
    out = {name: {s.label(): [st.n, st.mean, st.m2] for s, st in getattr(rule, name).items()} for name in ("gain", "step")}
    out["resid"] = {str(b): {s.label(): [st.n, st.mean, st.m2] for s, st in k.resid.items()}
                    for b, k in rule.buckets.items()}
    return out


def load_rates(rule: Rule, d: dict) -> None:
    """An earlier process's estimates into ``rule`` (arms unknown here are skipped), each capped at
    LOAD_CAP rounds. A bad entry raises ValueError before anything is loaded: never half a file."""
    by_label = {s.label(): s for s in rule.arms}
    sources = [(("gain",), d.get("gain", {})), (("step",), d.get("step", {}))]
    sources += [(("resid", int(b)), v) for b, v in d.get("resid", {}).items()]
    parsed = []
    for where, stats in sources:
        for label, raw in stats.items():
            if label in by_label:
                n, mean, m2 = (float(x) for x in raw)
                if not (n >= 0 and m2 >= 0 and math.isfinite(mean)):
                    raise ValueError(f"a bad estimate for {label}: {raw}")
                st = Stat(n, mean, m2)
                st.cap(LOAD_CAP)
                parsed.append((where, by_label[label], st))
    for where, s, st in parsed:
        target = rule.bucket(where[1]).resid if where[0] == "resid" else getattr(rule, where[0])
        target[s] = st
