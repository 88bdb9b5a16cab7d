"""Checkpoints shipped inside dspark, which specs name `embedded:<name>` (`tiny/`: the embedded
model pair, with `training.json` recording how it was trained), and the content digest that
identifies any checkpoint (`dspark.checkpoints.digest`). No torch here: the compiler resolves
these names and computes digests too."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_PREFIX = "embedded:"


def embedded_root() -> Path:
    """The directory holding one folder per embedded pair, each with `target/` and `draft/`."""
    return Path(__file__).resolve().parent
