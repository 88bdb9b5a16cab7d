"""Content identity of a checkpoint: one sha256 over its config.json and its weights.

Fingerprints name a checkpoint by this digest, so a cost table or calibration measured on other
weights is recognised as stale even when the directory, its name and the model's shape are the
same (a refitted confidence head changes nothing but bytes). What is hashed is what the runtime
loads: `config.json`, every `*.safetensors` file and the shard index `*.safetensors.index.json`
when the weights are sharded; tokenizer files and provenance notes are not the model.

Hashing a 16 GB checkpoint takes tens of seconds, so digests are cached in a small JSON file keyed
by the directory's resolved path and each hashed file's size, mtime and ctime (like `make` and git's
index, a file rewritten in place is noticed by its times). The cache lives in `$DSPARK_CACHE_DIR`,
else `$XDG_CACHE_HOME/dspark`, else `~/.cache/dspark`; a missing, unreadable or corrupt cache is
ignored, and failing to write it never fails the caller.

No torch here: the compiler computes digests too.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from dspark.atomic import atomic_write

DIGEST_FORMAT = 1  # changes whenever what is hashed changes, so old cache entries stop matching
CACHE_FILE = "checkpoint_digests.json"
MAX_CACHE_ENTRIES = 64
_CHUNK = 1 << 20


class DigestError(OSError):
    """A checkpoint file could not be read; the message names it."""


def hashed_files(directory: Path) -> list[Path]:
    """The files a checkpoint's digest covers, sorted by name."""
    names = [p for p in directory.iterdir() if p.is_file() and (
        p.name == "config.json" or p.name.endswith(".safetensors")
        or p.name.endswith(".safetensors.index.json"))]
    return sorted(names, key=lambda p: p.name)


def cache_dir() -> Path:
    explicit = os.environ.get("DSPARK_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "dspark"


def checkpoint_digest(directory: str | os.PathLike[str]) -> str:
    """sha256 (64 hex digits) of a checkpoint directory's config.json and weight files.

    Raises `DigestError` when the directory or one of its files cannot be read.
    """
    root = Path(directory)
    try:
        resolved = root.resolve()
        files = hashed_files(resolved)
        stamp = [[p.name, *_stat(p)] for p in files]
    except OSError as exc:
        raise DigestError(f"cannot read checkpoint directory {str(root)!r}: {exc.strerror or exc}") from None
    key = str(resolved)
    cache = _read_cache()
    entry = cache.get(key)
    if isinstance(entry, dict) and entry.get("files") == stamp and isinstance(entry.get("digest"), str):
        return entry["digest"]
    digest = _hash(files)
    cache.pop(key, None)
    cache[key] = {"files": stamp, "digest": digest}
    _write_cache(dict(list(cache.items())[-MAX_CACHE_ENTRIES:]))
    return digest


def _stat(path: Path) -> tuple[int, int, int]:
    info = path.stat()
    return info.st_size, info.st_mtime_ns, info.st_ctime_ns


def _hash(files: list[Path]) -> str:
    total = hashlib.sha256(f"dspark checkpoint digest {DIGEST_FORMAT}\n".encode())
    for path in files:
        one = hashlib.sha256()
        try:
            with open(path, "rb") as handle:
                while chunk := handle.read(_CHUNK):
                    one.update(chunk)
        except OSError as exc:
            raise DigestError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
        # The name is hashed too: a shard renamed against its index is a different checkpoint.
        total.update(f"{path.name}\0{one.hexdigest()}\n".encode())
    return total.hexdigest()


def _read_cache() -> dict[str, Any]:
    try:
        data = json.loads((cache_dir() / CACHE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != DIGEST_FORMAT:
        return {}
    entries = data.get("entries")
    return dict(entries) if isinstance(entries, dict) else {}


def _write_cache(entries: dict[str, Any]) -> None:
    text = json.dumps({"format": DIGEST_FORMAT, "entries": entries}, indent=1, sort_keys=False)
    try:
        atomic_write(cache_dir() / CACHE_FILE, lambda path: path.write_text(text, encoding="utf-8"))
    except OSError:
        pass  # a read-only or full cache directory costs a re-hash next time, nothing more
