"""Prompt sets for benchmarks: held-out standard-library code, code of other installed packages, and prompts
read from a file.

The held-out split is the embedded tiny model pair's (`train_tiny` trains on the other files), so
these prompts measure acceptance on code the model never saw. `out_of_distribution_prompts` is text the pair,
trained on the standard library, never saw, from what every install of dspark has: third-party packages'
sources (`package_prompts`) and the prose of installed distributions' descriptions (`distribution_prose`),
each in two disjoint parts (one to serve, one to score); `header_prompts` is a language it never saw (the C++
headers torch ships). Importing this module does not import torch:
`dspark bench` is a plain HTTP client and must stay light.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import json
import random
import sysconfig
import zlib
from collections.abc import Callable
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
        prompts += _cut(text, length, lambda i: i % HELD_OUT_LINE_STRIDE == phase)
        if len(prompts) >= count:
            return prompts[:count]
    return prompts


def _cut(text: str, length: int, keep: Callable[[int], bool]) -> list[str]:
    """Prompts of `length` characters starting at the lines `keep(line index)` picks (blank ones left out)."""
    out, offset = [], 0
    for i, line in enumerate(text.splitlines(keepends=True)):
        if keep(i) and text[offset:offset + length].strip():
            out.append(text[offset:offset + length])
        offset += len(line)
    return out


# Installed with dspark (numpy and networkx are its dependencies, sympy torch's), and the three on which the
# embedded pair's calibration is furthest off (benchmarks/calibration_drift.py); none imports here.
OUT_OF_DISTRIBUTION_PACKAGES = ("numpy", "sympy", "networkx")


def package_files(part: int, packages: tuple[str, ...] = OUT_OF_DISTRIBUTION_PACKAGES
                  ) -> dict[str, list[Path]]:
    """Per installed package of `packages` (absent ones left out), its `.py` files in part `part` (0 or 1:
    the file's path inside the package hashes to it), sorted. A standard-library package is refused: the
    pair trained on those."""
    if part not in (0, 1):
        raise ValueError(f"part must be 0 or 1, got {part!r}")
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    out = {}
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        if root.resolve().is_relative_to(stdlib) and "site-packages" not in root.parts:
            raise ValueError(f"{name} is part of the standard library, which the embedded pair trained on; "
                             "name a third-party package")
        out[name] = [p for p in sorted(root.rglob("*.py"))
                     if zlib.crc32(f"{name}/{p.relative_to(root)}".encode()) % 2 == part]
    return out


def package_prompts(count: int, part: int, length: int = DEFAULT_PROMPT_CHARS, phase: int = DEFAULT_PHASE,
                    packages: tuple[str, ...] = OUT_OF_DISTRIBUTION_PACKAGES) -> list[str]:
    """`count` prompts cut as `held_out_prompts` cuts them, from the files of `package_files(part)`: each
    package's prompts in a fixed shuffled order (so a few hundred of them come from many files, not the first
    few), the packages in turn; fewer when they run out. Parts 0 and 1 share no file."""
    per_package = []
    for name, files in package_files(part, packages).items():
        prompts = [p for path in files
                   for p in _cut(path.read_text(encoding="utf-8", errors="replace"), length,
                                 lambda i: i % HELD_OUT_LINE_STRIDE == phase)]
        random.Random(f"{name}:{part}").shuffle(prompts)
        per_package.append(prompts)
    return _in_turn(per_package)[:count]


def header_prompts(count: int, part: int, length: int = DEFAULT_PROMPT_CHARS, phase: int = DEFAULT_PHASE,
                   package: str = "torch") -> list[str]:
    """`count` prompts cut as `held_out_prompts` cuts them from the C and C++ headers an installed package
    ships (torch's `include/`: every install of dspark's runtime has them; found without importing it): a
    language the pair never saw. Part 0 or 1 by the header's path hashed (no file in both), in a fixed
    shuffled order; fewer when they run out, none without the package."""
    if part not in (0, 1):
        raise ValueError(f"part must be 0 or 1, got {part!r}")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(next(iter(spec.submodule_search_locations))) / "include"
    files = [h for h in sorted(root.rglob("*.h"))
             if zlib.crc32(str(h.relative_to(root)).encode()) % 2 == part]
    prompts = [p for path in files
               for p in _cut(path.read_text(encoding="utf-8", errors="replace"), length,
                             lambda i: i % HELD_OUT_LINE_STRIDE == phase)]
    random.Random(f"{package}-headers:{part}").shuffle(prompts)
    return prompts[:count]


def _in_turn(lists: list[list[str]]) -> list[str]:
    return [p for group in itertools.zip_longest(*lists) for p in group if p is not None]


# Distributions installed with dspark (its dependencies and theirs) whose descriptions (their METADATA's long
# text) are prose.
PROSE_DISTRIBUTIONS = ("pydantic", "matplotlib", "tqdm", "torch", "fastapi", "httpx", "networkx", "numpy",
                       "jinja2", "uvicorn", "fonttools", "sympy", "httpcore", "starlette", "fsspec", "pillow",
                       "python-dateutil", "annotated-types")
PROSE_LINE_STRIDE = 7  # a description is short: a prompt every 7 lines


def distribution_prose(count: int, part: int, length: int = DEFAULT_PROMPT_CHARS,
                       distributions: tuple[str, ...] = PROSE_DISTRIBUTIONS) -> list[str]:
    """Up to `count` prompts of `length` characters cut at line starts from installed distributions'
    descriptions, every 7th line; a prompt's part (0 or 1) is its distribution and line hashed, so the two
    parts share no prompt. Each distribution's prompts in a fixed shuffled order, the distributions in turn;
    absent distributions are skipped."""
    if part not in (0, 1):
        raise ValueError(f"part must be 0 or 1, got {part!r}")
    per_distribution = []
    for name in distributions:
        try:
            metadata = importlib.metadata.distribution(name).read_text("METADATA") or ""
        except importlib.metadata.PackageNotFoundError:
            continue
        text = metadata.partition("\n\n")[2]  # the description: the header fields end at the first blank line
        prompts = _cut(text, length, lambda i, name=name: (
            i % PROSE_LINE_STRIDE == 3 and zlib.crc32(f"{name}:{i}".encode()) % 2 == part))
        random.Random(f"{name}:{part}").shuffle(prompts)
        per_distribution.append(prompts)
    return _in_turn(per_distribution)[:count]


def out_of_distribution_prompts(count: int, part: int, length: int = DEFAULT_PROMPT_CHARS) -> list[str]:
    """Up to `count` prompts of part `part`, code (`package_prompts`) and prose (`distribution_prose`) in
    turn while both last: the prose runs out first (some 650 prompts a part), and a part that went on with
    code alone would mix the two unlike the other part (a calibration fitted on one and scored on the other
    would be scored on another mixture)."""
    code, prose = package_prompts(count, part, length), distribution_prose(count, part, length)
    return [p for pair in zip(code, prose, strict=False) for p in pair][:count]


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
