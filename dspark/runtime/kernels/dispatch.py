"""Choosing between a kernel's Triton implementation and its torch reference.

Triton is optional (CPU-only installs, Ascend): the kernel modules decorate their kernels with
`jit` from here, which is `triton.jit` when Triton imports and otherwise a stub that only fails
if something tries to launch it. Kernel annotations are strings (`from __future__ import
annotations` in the kernel modules), which Triton reads just as well, so `tl` need not exist for
the modules to import.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without Triton
    triton = None
    tl = None

Impl = Literal["auto", "torch", "triton"]
HAS_TRITON = triton is not None


def _missing_triton(fn: Callable[..., Any]) -> Any:
    class _Unavailable:
        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            raise RuntimeError(f"{fn.__name__}: Triton is not installed")

    return _Unavailable()


jit: Callable[[Callable[..., Any]], Any] = triton.jit if HAS_TRITON else _missing_triton


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(impl: Impl, *tensors: torch.Tensor) -> bool:
    """Whether to launch the Triton kernel for these tensors.

    `auto` takes Triton only when every tensor is on CUDA: CPU tensors always take the torch
    reference at runtime. `triton` forces it, which on CPU tensors works only under the Triton
    interpreter (how the tests compare the kernels with the references on a machine without GPU).
    """
    if impl == "torch":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if impl == "auto":
        return HAS_TRITON and on_cuda
    if impl != "triton":
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    if not HAS_TRITON:
        raise RuntimeError("impl='triton' but Triton is not installed")
    if not on_cuda and not _interpreting():
        devices = sorted({str(t.device) for t in tensors})
        raise ValueError(f"impl='triton' needs CUDA tensors (got {devices}) or TRITON_INTERPRET=1")
    return True


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1): `tl.arange` extents must be powers of two."""
    return 1 << max(n - 1, 0).bit_length()
