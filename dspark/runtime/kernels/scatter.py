"""Moving rows between the fixed-stride block (`B * N` rows) and the packed verify rows.

Drafting and acceptance index rows as `r * N + k`; a compact verify step runs only the planned
rows. `pack_rows` gathers the planned rows (input ids, draft hidden states) into the packed
order, `scatter_rows` writes packed outputs (hidden states, argmax ids) back to their slots and
fills the rows that were not verified. `src_index` comes from `build_verify_rows`.
"""

from __future__ import annotations

import math

import torch

from dspark.runtime.kernels.dispatch import Impl, jit, next_pow2, tl, use_triton

MAX_BLOCK_H = 1024  # columns one program moves per loop iteration


def pack_rows(fixed: torch.Tensor, src_index: torch.Tensor, *, impl: Impl = "auto") -> torch.Tensor:
    """`packed[t] = fixed[src_index[t]]`: `[T, ...]` from a `[B * N, ...]` tensor of any trailing shape."""
    _check_index(src_index)
    if fixed.dim() < 1:
        raise ValueError("fixed must have a row dimension")
    if use_triton(impl, fixed, src_index):
        out = torch.empty((src_index.shape[0], *fixed.shape[1:]), dtype=fixed.dtype, device=fixed.device)
        launch_pack_rows(_as_matrix(fixed), src_index, _as_matrix(out))
        return out
    return fixed.index_select(0, src_index)


def scatter_rows(packed: torch.Tensor, src_index: torch.Tensor, num_rows_fixed: int,
                 fill: float = 0.0, *, impl: Impl = "auto") -> torch.Tensor:
    """`fixed[src_index[t]] = packed[t]`, every other row of the `[num_rows_fixed, ...]` result is `fill`.

    Works for any trailing shape, 1-D included: argmax ids scatter back as int64 with `fill=-1`,
    so an unverified slot can never be mistaken for a token. `src_index` must not repeat.
    """
    _check_index(src_index)
    if packed.dim() < 1 or packed.shape[0] != src_index.shape[0]:
        raise ValueError(f"packed must be [T={src_index.shape[0]}, ...], got shape {tuple(packed.shape)}")
    if num_rows_fixed < packed.shape[0]:
        raise ValueError(f"num_rows_fixed={num_rows_fixed} is smaller than the {packed.shape[0]} packed rows")
    if not (packed.dtype.is_floating_point or packed.dtype.is_complex) and not float(fill).is_integer():
        raise ValueError(f"fill={fill} is not representable in {packed.dtype}")
    out = torch.full((num_rows_fixed, *packed.shape[1:]), fill, dtype=packed.dtype, device=packed.device)
    if use_triton(impl, packed, src_index):
        launch_scatter_rows(_as_matrix(packed), src_index, _as_matrix(out))
    else:
        out.index_copy_(0, src_index, packed)
    return out


def _check_index(src_index: torch.Tensor) -> None:
    if src_index.dim() != 1 or src_index.dtype != torch.int64:
        raise TypeError(f"src_index must be 1-D int64, got {src_index.dtype} "
                        f"of shape {tuple(src_index.shape)}")


def _as_matrix(x: torch.Tensor) -> torch.Tensor:
    """`[rows, H]` form of `[rows, ...]` (H = 1 for 1-D) for the kernels, which take both strides.

    It is a view whenever the trailing dims flatten in place (always for the freshly allocated
    outputs, which the kernels must write through); only an oddly strided input is copied.
    """
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))


def _block_h(width: int) -> int:
    return min(next_pow2(width), MAX_BLOCK_H)


def launch_pack_rows(fixed: torch.Tensor, src_index: torch.Tensor, out: torch.Tensor,
                     block_h: int | None = None) -> None:
    """`out[t, :H] = fixed[src_index[t], :H]` for 2-D strided tensors, H = fixed's width."""
    rows, width = src_index.shape[0], fixed.shape[1]
    if rows == 0 or width == 0:
        return
    _copy_rows_kernel[(rows,)](
        fixed, fixed.stride(0), fixed.stride(1), out, out.stride(0), out.stride(1), src_index, width,
        INDEX_SRC=True, BLOCK_H=block_h or _block_h(width),
    )


def launch_scatter_rows(packed: torch.Tensor, src_index: torch.Tensor, out: torch.Tensor,
                        block_h: int | None = None) -> None:
    """`out[src_index[t], :H] = packed[t, :H]` for 2-D strided tensors; no other element is written."""
    rows, width = src_index.shape[0], packed.shape[1]
    if rows == 0 or width == 0:
        return
    _copy_rows_kernel[(rows,)](
        packed, packed.stride(0), packed.stride(1), out, out.stride(0), out.stride(1), src_index, width,
        INDEX_SRC=False, BLOCK_H=block_h or _block_h(width),
    )


@jit
def _copy_rows_kernel(src_ptr, src_stride_row, src_stride_col, dst_ptr, dst_stride_row, dst_stride_col,
                      index_ptr, width, INDEX_SRC: tl.constexpr, BLOCK_H: tl.constexpr):
    # One program per packed row; gather (pack) and scatter differ only in which side is indexed.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(index_ptr + t)
    if INDEX_SRC:
        src_row = slot
        dst_row = t
    else:
        src_row = t
        dst_row = slot
    cols = tl.arange(0, BLOCK_H).to(tl.int64)
    for start in range(0, width, BLOCK_H):
        c = start + cols
        mask = c < width
        vals = tl.load(src_ptr + src_row * src_stride_row + c * src_stride_col, mask=mask)
        tl.store(dst_ptr + dst_row * dst_stride_row + c * dst_stride_col, vals, mask=mask)
