"""Whole-or-nothing file writes: a reader sees the old file or the new one, never a torn one.

The content goes to a temporary file in the target's directory (same filesystem, so the final
`os.replace` is atomic), is flushed to disk, gets the permissions a plain `open()` would have
given it (mkstemp creates 0600 files), and only then replaces the target.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def staged_file(directory: Path, write: Callable[[Path], None], suffix: str = ".tmp") -> Path:
    """A complete temporary file in `directory`, written by `write(path)`; the caller renames it
    into place (several staged files can then replace their targets together)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=directory, prefix=".staging-", suffix=suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Write `path` through `write(tmp_path)` and move it into place in one step."""
    target = Path(path)
    tmp = staged_file(target.parent, write, suffix=f".{target.name}")
    try:
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
