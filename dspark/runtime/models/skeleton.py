"""Models built as shapes only, for a checkpoint to fill in."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

# What a module's `reset_parameters` calls (nn.Linear, nn.Embedding and our own modules).
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                 "kaiming_normal_", "xavier_uniform_", "xavier_normal_")


def _leave(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


@contextmanager
def skeleton() -> Iterator[None]:
    """Modules built inside have their parameters and buffers on the meta device, uninitialised: the
    checkpoint assigns every one. Initialising a meta tensor runs torch's Python decompositions, whose
    first use imports torch._dynamo, seconds of every process's start for values no one reads."""
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    for name in _INITIALISERS:
        setattr(nn.init, name, _leave)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)
