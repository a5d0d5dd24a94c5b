"""Writing whole folders atomically: nothing half-written is ever left where a result is expected."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_folder(out: Path):
    """Yields a hidden temporary sibling of `out` to fill. When the block succeeds it is renamed to
    `out` (an existing `out` is swapped out first and removed after); when it fails in any way,
    including Ctrl-C, the temporary folder is removed and `out` is left as it was."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        yield tmp
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: Path, text: str) -> Path:
    """Writes `text` to a unique temporary sibling renamed over `path`: a reader sees the old file or
    the new one, and a failed write (Ctrl-C, a full disk) leaves no temporary file behind."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_torch_save(obj, path: Path) -> None:
    """torch.save to a temporary sibling renamed over `path`: a reader sees the old file or the new one."""
    import torch

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:  # interrupted mid-write (Ctrl-C, a full disk): no half-written file is left
        tmp.unlink(missing_ok=True)
        raise
