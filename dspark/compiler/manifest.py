"""manifest.json: provenance of a generated package and the hash of every file in it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import networkx as nx

from dspark import __version__
from dspark.compiler.graph import node_link
from dspark.spec import ResolvedSpec

MANIFEST_FORMAT = 1


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_bytes(resolved: ResolvedSpec, graph: nx.DiGraph, files: Mapping[str, bytes]) -> bytes:
    manifest = {
        "format": MANIFEST_FORMAT,
        "name": resolved.name,
        "compiler_version": __version__,
        "spec": {"path": resolved.display_path, "sha256": resolved.source_sha256},
        "files": {name: sha256(data) for name, data in sorted(files.items())},
        "graph": node_link(graph),
    }
    text = json.dumps(manifest, sort_keys=True, indent=2, ensure_ascii=True) + "\n"
    return text.encode("ascii")


def recorded_hashes(manifest: bytes) -> dict[str, str] | None:
    """File name -> sha256 as recorded in a manifest, or None if it is not a dspark manifest."""
    try:
        data: Any = json.loads(manifest)
    except (ValueError, UnicodeDecodeError):
        return None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        return None
    return dict(files)
