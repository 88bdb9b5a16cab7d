"""Unified diffs between generated packages, file by file."""

from __future__ import annotations

import difflib
from collections.abc import Mapping


def diff_files(old: Mapping[str, bytes], new: Mapping[str, bytes], old_label: str,
               new_label: str) -> str:
    """A unified diff of every file that differs, is missing, or is extra ('' when equal)."""
    chunks = []
    for name in sorted(set(old) | set(new)):
        before, after = old.get(name), new.get(name)
        if before == after:
            continue
        chunks.extend(difflib.unified_diff(
            _lines(before), _lines(after),
            fromfile=f"{old_label}/{name}" if before is not None else "/dev/null",
            tofile=f"{new_label}/{name}" if after is not None else "/dev/null"))
    return "".join(chunks)


def _lines(data: bytes | None) -> list[str]:
    if data is None:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n\\ No newline at end of file\n"
    return lines
