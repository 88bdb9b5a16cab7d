"""Shared helpers for spec/compiler tests: write a valid spec, with overrides, into tmp_path."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

# In CI a missing test dependency fails the run, and only a skip for want of a GPU, an NPU or an emulator
# stays a skip (tests/ci_strict.py).
from .ci_strict import pytest_make_collect_report, pytest_runtest_makereport, pytest_sessionstart  # noqa: F401

GEOMETRY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
            "num_heads": 4, "num_kv_heads": 2, "max_position_embeddings": 2048,
            "rope_theta": 10000.0, "rms_norm_eps": 1e-6}
BASE_SPEC: dict[str, Any] = {
    "name": "demo",
    "model": {"family": "llama", "checkpoint": "/nonexistent/target", "geometry": GEOMETRY},
    "draft": {"checkpoint": "/nonexistent/draft", "gamma": 3},
    "backend": {"kind": "cpu", "device": "generic"},
}


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `overrides` into a copy of `base`; a None value deletes the key."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture
def write_spec(tmp_path: Path):
    def write(overrides: dict[str, Any] | None = None, *, text: str | None = None,
              name: str = "spec.yaml") -> Path:
        path = tmp_path / name
        body = text if text is not None else yaml.safe_dump(merged(BASE_SPEC, overrides or {}),
                                                           sort_keys=False)
        path.write_text(body, encoding="utf-8")
        return path
    return write
