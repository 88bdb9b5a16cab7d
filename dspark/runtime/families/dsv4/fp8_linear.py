"""FP8 e4m3 block-scaled linears kept quantised on CUDA (the release's `X.weight` float8_e4m3fn with one
scale per `weight_block_size` block, 128 x 128 published).

A checkpoint loaded for the cuda backend keeps each FP8 linear as an `Fp8BlockWeight` (its codes and block
scales, one byte a weight) in place of the float weight (`weights.load_dsv4_weights(keep_fp8=True)`), and the
model's `row_linear` hands it its rows. On CUDA tensors the product is this module's Triton kernel, which
decodes each tile of codes in registers (sign, 4-bit exponent with bias 7, 3-bit mantissa; subnormals at
2^-9), multiplies it by its block's scale and accumulates in fp32: the weights stay one byte in memory, the
product runs in the activations' precision (weight-only: no FP8 tensor-core path, which DeepGEMM-style
activation quantisation would add). Elsewhere the torch reference dequantises the weight and multiplies; both
are tested against each other under the Triton interpreter in fp32 (tests/dsv4_fp8_interp_checks.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from dspark.runtime.families.dsv4.quant import dequant_fp8_blocks
from dspark.runtime.kernels.dispatch import Impl, jit, tl, use_triton

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32  # tl.dot needs every operand dimension >= 16


def fp8_block_linear_torch(x: Tensor, codes: Tensor, scales: Tensor, block: tuple[int, int]) -> Tensor:
    """x [M, in] @ (codes [out, in] dequantised by its block scales).T -> [M, out] in x's dtype (fp32)."""
    weight = dequant_fp8_blocks(codes, scales, block)
    return (x.to(torch.float32) @ weight.t()).to(x.dtype)


@jit
def _fp8_block_linear_kernel(x_ptr, codes_ptr, scales_ptr, out_ptr, M, N, K, stride_xm, stride_cn,
                             stride_sn, stride_om, B0: tl.constexpr, B1: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0).to(tl.float32)
        w_mask = (rn[:, None] < N) & (rk[None, :] < K)
        byte = tl.load(codes_ptr + rn[:, None] * stride_cn + rk[None, :], mask=w_mask, other=0).to(tl.int32)
        exp = (byte >> 3) & 15
        man = (byte & 7).to(tl.float32)
        # e4m3fn: (8 + m) * 2^(e - 10) for e > 0, m * 2^-9 for subnormals; the sign bit on top
        mag = tl.where(exp == 0, man * 0.001953125, (8.0 + man) * tl.exp2((exp - 10).to(tl.float32)))
        w = tl.where((byte & 128) != 0, -mag, mag)
        s = tl.load(scales_ptr + (rn[:, None] // B0) * stride_sn + rk[None, :] // B1, mask=w_mask, other=0.0)
        acc += tl.dot(x, tl.trans(w * s), input_precision="ieee")
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def fp8_block_linear(x: Tensor, codes: Tensor, scales: Tensor, block: tuple[int, int],
                     impl: Impl = "auto") -> Tensor:
    """x [M, in] @ W.T for W the FP8 codes [out, in] times their block scales [ceil(out/b0), ceil(in/b1)]:
    the Triton kernel on CUDA tensors (or forced under the interpreter), else the torch reference."""
    if codes.dtype != torch.float8_e4m3fn or codes.dim() != 2 or x.dim() != 2 or x.shape[1] != codes.shape[1]:
        raise ValueError(f"an FP8 linear takes x [M, {codes.shape[-1]}] and float8_e4m3fn codes [out, in]; "
                         f"got {list(x.shape)} and {codes.dtype} {list(codes.shape)}")
    if not use_triton(impl, x, codes, scales):
        return fp8_block_linear_torch(x, codes, scales, block)
    m, k = x.shape
    n = codes.shape[0]
    x, scales = x.contiguous(), scales.to(torch.float32).contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (-(-m // BLOCK_M), -(-n // BLOCK_N))
    _fp8_block_linear_kernel[grid](x, codes.contiguous().view(torch.uint8), scales, out, m, n, k, x.stride(0),
                                   k, scales.stride(0), out.stride(0), B0=block[0], B1=block[1], BM=BLOCK_M,
                                   BN=BLOCK_N, BK=BLOCK_K)
    return out


class Fp8BlockWeight(nn.Module):
    """A linear's weight kept as float8_e4m3fn codes [..., out, in] and float32 block scales
    [..., ceil(out / b0), ceil(in / b1)] (stacked experts have the leading dimension). Indexing selects
    experts, or rows and columns on block boundaries, as sharding and expert parallelism slice weights."""

    def __init__(self, codes: Tensor, scales: Tensor, block: tuple[int, int], impl: Impl = "auto") -> None:
        super().__init__()
        b0, b1 = block
        grid = (-(-codes.shape[-2] // b0), -(-codes.shape[-1] // b1))
        if codes.dtype != torch.float8_e4m3fn or tuple(scales.shape) != (*codes.shape[:-2], *grid):
            raise ValueError(f"FP8 codes must be float8_e4m3fn [..., out, in] with scales [..., {grid[0]}, "
                             f"{grid[1]}] for {b0} x {b1} blocks; got {codes.dtype} {list(codes.shape)} and "
                             f"{list(scales.shape)}")
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.to(torch.float32).contiguous())
        self.block, self.impl = (b0, b1), impl

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def __getitem__(self, index: Any) -> Fp8BlockWeight:
        index = index if isinstance(index, tuple) else (index,)
        lead = self.codes.dim() - 2
        scale_index = list(index[:lead])  # expert indices apply to both
        for axis, part in enumerate(index[lead:lead + 2]):
            size, blk = self.codes.shape[lead + axis], self.block[axis]
            if not isinstance(part, slice) or part.step not in (None, 1):
                raise ValueError("an FP8 weight's rows and columns are sliced by ranges")
            start, stop, _ = part.indices(size)
            if start % blk or (stop % blk and stop != size):
                what = ("rows", "columns")[axis]
                raise ValueError(f"slice {start}:{stop} of an FP8 weight's {what} is not on its {blk}-wide "
                                 "scale blocks")
            scale_index.append(slice(start // blk, -(-stop // blk)))
        return Fp8BlockWeight(self.codes[index].clone(), self.scales[tuple(scale_index)].clone(), self.block,
                              self.impl)

    def linear(self, x: Tensor) -> Tensor:
        """x [..., in] -> [..., out]."""
        if self.codes.dim() != 2:
            raise ValueError("index the expert first: a stacked FP8 weight is not one linear")
        rows = x.reshape(-1, x.shape[-1])
        out = fp8_block_linear(rows, self.codes, self.scales, self.block, self.impl)
        return out.reshape(*x.shape[:-1], self.codes.shape[0])

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Fp8BlockWeight:
        # A device move applies; a dtype cast does not (`Module.to(dtype)` casts floating tensors, and FP8
        # codes are floating): the codes travel as their bytes, the scales as their float32 bits.
        self.codes = fn(self.codes.view(torch.uint8)).view(torch.float8_e4m3fn)
        self.scales = fn(self.scales.view(torch.int32)).view(torch.float32)
        return self
