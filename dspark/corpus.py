"""Prompt sets for benchmarks: held-out standard-library code, and prompts read from a file.

The held-out split is the embedded tiny model pair's (`train_tiny` trains on the other files), so
these prompts measure acceptance on code the model never saw. Importing this module does not import
torch: `dspark bench` is a plain HTTP client and must stay light.
"""

from __future__ import annotations

import json
import sysconfig
import zlib
from pathlib import Path

HELD_OUT_MODULUS = 20  # every file whose path hashes to 0 mod this is held out
HELD_OUT_LINE_STRIDE = 97  # prompts start every this many lines; the phase picks the residue
DEFAULT_PHASE = 40  # the benchmarks' prompt set; other phases give disjoint sets
DEFAULT_PROMPT_CHARS = 200
HELD_OUT_TEXT_BYTES = 4 << 20


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(train, held-out) Python files of the running interpreter's standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    train, held = [], []
    for p in files:
        key = str(p.relative_to(root)).encode()
        (held if zlib.crc32(key) % HELD_OUT_MODULUS == 0 else train).append(p)
    return train, held


def held_out_text(max_bytes: int = 1 << 20) -> list[str]:
    """Held-out standard-library sources (for prompts and evaluation)."""
    _, held = corpus_files()
    out, total = [], 0
    for p in held:
        text = p.read_text(encoding="utf-8", errors="replace")
        out.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return out


def held_out_prompts(count: int, length: int = DEFAULT_PROMPT_CHARS, phase: int = DEFAULT_PHASE) -> list[str]:
    """`count` prompts of `length` characters cut at line starts from held-out files: every 97th
    line, starting at line `phase` (different phases give disjoint prompt sets). Fewer than `count`
    when the held-out text runs out (about 400 at the default length and phase)."""
    prompts: list[str] = []
    for text in held_out_text(HELD_OUT_TEXT_BYTES):
        lines = text.splitlines(keepends=True)
        offset = 0
        for i, line in enumerate(lines):
            if i % HELD_OUT_LINE_STRIDE == phase and text[offset:offset + length].strip():
                prompts.append(text[offset:offset + length])
            offset += len(line)
            if len(prompts) == count:
                return prompts
    return prompts


def load_prompts_file(path: Path) -> list[str]:
    """A `.json` file holds a JSON list of strings; any other file one prompt per non-blank line.

    Raises ValueError for a JSON file of another shape (the caller turns it into a CLI error)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
        if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
            raise ValueError(f"{path}: expected a JSON list of strings")
        return data
    return [line for line in text.splitlines() if line.strip()]
