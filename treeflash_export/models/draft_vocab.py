"""The draft vocabulary: the tokens a drafter may propose, a subset of the verifier's.

A drafter ranks its candidates through the verifier's LM head. Over the whole vocabulary that is
the largest part of the expansion on a CPU (SmolLM2: 49,152 rows, each block position and each
parent row). A drafter trained by ``treeflash-export train`` learnt its softmax over the tokens of
its training data only (``--loss-vocab data``), so the rows of the other tokens add work and almost
nothing it was taught: the drafter folder lists its training tokens, most frequent first, in
``draft-vocab.json``, and the runtime ranks only those rows (EAGLE-3 trains a draft vocabulary the
same way). The verifier still scores the whole vocabulary: a token outside the list is never
drafted, so a round can stop earlier, but what is committed is the verifier's output as always.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import CheckpointError

FILE = "draft-vocab.json"
FORMAT = 1


def token_order(tokens: torch.Tensor, counted: torch.Tensor | None = None) -> list[int]:
    """Every token id in ``tokens``, most frequent in ``counted`` first (ties: lower id first; tokens
    never counted follow in id order). counted: the positions that weigh (e.g. the continuations),
    default all of ``tokens``."""
    present = torch.unique(tokens.long())
    source = (tokens if counted is None else counted).long().flatten()
    counts = torch.bincount(source, minlength=int(present.max()) + 1 if present.numel() else 0)
    count = counts[present] if present.numel() else counts[:0]
    # a stable sort by descending count over ids in ascending order keeps ties in id order
    order = torch.sort(-count, stable=True).indices
    return present[order].tolist()


def write(folder: Path, order: list[int], *, source: str) -> Path:
    """Writes ``draft-vocab.json`` (the token ids, most frequent first, and where they came from)."""
    path = Path(folder) / FILE
    path.write_text(json.dumps({"format": FORMAT, "source": source, "size": len(order), "ids": order}) + "\n")
    return path


def read(folder: Path, vocab_size: int) -> list[int] | None:
    """The drafter folder's token order, or None when it has no ``draft-vocab.json``. A file that
    cannot be read, or names ids outside the vocabulary or twice, is an error (a draft vocabulary that
    silently lost tokens would only show as slower generation)."""
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        ids = data["ids"]
        if data.get("format") != FORMAT or not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ValueError("expected {'format': 1, 'ids': [token ids]}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot read the draft vocabulary {path}: {exc}") from None
    if not ids or min(ids) < 0 or max(ids) >= vocab_size or len(set(ids)) != len(ids):
        raise CheckpointError(f"the draft vocabulary {path} must list distinct token ids in 0..{vocab_size - 1}")
    return ids


def select(order: list[int] | None, size: int | None, vocab_size: int) -> torch.Tensor | None:
    """The ids the drafter ranks, ascending (so ties break towards the lower id, as over the whole
    vocabulary), or None for the whole vocabulary. size None: all of ``order`` (none: the whole
    vocabulary); 0: the whole vocabulary; N: the first N of ``order``, then the lowest ids not in it
    when the order is shorter (a tokenizer's ids roughly follow its merges' frequency)."""
    if size == 0 or (size is None and order is None):
        return None
    if size is not None and not 0 < size <= vocab_size:
        raise CheckpointError(f"--draft-vocab {size}: must be between 1 and the vocabulary size {vocab_size} "
                              f"(0: the whole vocabulary)")
    ids = list(order or [])
    n = len(ids) if size is None else size
    if n >= vocab_size:
        return None
    if len(ids) < n:
        seen = set(ids)
        ids += [i for i in range(vocab_size) if i not in seen][: n - len(ids)]
    return torch.tensor(sorted(ids[:n]), dtype=torch.long)
