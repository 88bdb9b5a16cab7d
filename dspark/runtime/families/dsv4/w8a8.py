"""Ascend W8A8_DYNAMIC linears kept quantised: int8 weights with a float32 scale per output channel, the
activations quantised per token at run time, the product in int8 with int32 accumulation.

On a backend with the kernels (Ascend: `torch_npu.npu_dynamic_quant`, then `npu_quant_matmul` with the
weight's channel scales and the rows' token scales) a W8A8 checkpoint loads into `W8A8Weight`s in place of
the float weights it quantised (`weights.load_dsv4_weights(keep_w8a8=True)`), and the model's `row_linear`
hands them their rows (`W8A8Weight.linear`). Elsewhere it is dequantised at load (`quant.dequant_w8a8`).

Each weight calls its `kernel`: the operators on an NPU (`npu_kernel`, bound by the Ascend layers), or
their CPU models (`reference_kernel`, `ascend_op_models`), so the CPU computes what the device does: a row's
codes depend on that row alone and the integer products are exact, so the result is row-invariant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from dspark.runtime.distributed.tensor_parallel import frozen_param
from dspark.runtime.families.dsv4.ascend_quant_op_models import (
    reference_dynamic_quant,
    reference_quant_matmul,
)

W8A8Kernel = Callable[[Tensor, "W8A8Weight"], Tensor]  # rows x [m, in] -> [m, out] in x's dtype


def _io_dtype(x: Tensor) -> torch.dtype:
    """The operators take and give float16 / bfloat16: float32 rows go in, and come out, as bfloat16."""
    return x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def reference_kernel(x: Tensor, weight: W8A8Weight) -> Tensor:
    """The NPU's two operators, by their CPU models."""
    io = _io_dtype(x)
    codes, token_scale = reference_dynamic_quant(x.to(io))
    return reference_quant_matmul(codes, weight.codes.transpose(-2, -1), weight.scale,
                                  pertoken_scale=token_scale, output_dtype=io).to(x.dtype)


def npu_kernel(torch_npu: Any) -> W8A8Kernel:
    """The operators themselves (`torch_npu`, or a stand-in with their schema)."""
    def run(x: Tensor, weight: W8A8Weight) -> Tensor:
        io = _io_dtype(x)
        codes, token_scale = torch_npu.npu_dynamic_quant(x.to(io))
        return torch_npu.npu_quant_matmul(codes, weight.codes.transpose(-2, -1), weight.scale,
                                          pertoken_scale=token_scale, output_dtype=io).to(x.dtype)
    return run


class W8A8Weight(nn.Module):
    """A linear's weight kept as int8 codes [..., out, in] and float32 channel scales [..., out] (stacked
    experts have the leading dimension). Indexing selects experts, rows or columns as a tensor's would
    (scales follow the rows), so sharding and expert parallelism slice it as they slice a weight."""

    def __init__(self, codes: Tensor, scale: Tensor, kernel: W8A8Kernel = reference_kernel) -> None:
        super().__init__()
        if codes.dtype != torch.int8 or tuple(scale.shape) != tuple(codes.shape[:-1]):
            raise ValueError(f"W8A8 codes must be int8 [..., out, in] with scales [..., out]; got "
                             f"{codes.dtype} {list(codes.shape)} and {list(scale.shape)}")
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scale", scale.to(torch.float32).contiguous())
        self.kernel = kernel

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def __getitem__(self, index: Any) -> W8A8Weight:
        index = index if isinstance(index, tuple) else (index,)
        codes = self.codes[index].clone()
        row_index = index[: self.codes.dim() - 1]  # the column index, if any, leaves the scales as they are
        return W8A8Weight(codes, self.scale[row_index].clone(), self.kernel)

    def linear(self, x: Tensor) -> Tensor:
        """x [..., in] -> [..., out]: x's rows quantised per token, multiplied in int8."""
        if self.codes.dim() != 2:
            raise ValueError("index the expert first: a stacked W8A8 weight is not one linear")
        rows = x.reshape(-1, x.shape[-1])
        return self.kernel(rows, self).reshape(*x.shape[:-1], self.codes.shape[0])

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> W8A8Weight:
        # A device move applies; a dtype cast does not: the codes are int8 and the scales' float32 bits
        # are the format's, so they travel as int32 bits (`Module.to(dtype)` casts only floating tensors).
        self.codes = fn(self.codes)
        self.scale = fn(self.scale.view(torch.int32)).view(torch.float32)
        return self


def kept(weight: Tensor | nn.Module) -> nn.Parameter | nn.Module:
    """What a rank keeps of a weight it sliced: a parameter of its own storage (`frozen_param`), or a weight
    kept quantised (`W8A8Weight`, `fp8_linear.Fp8BlockWeight`: its slice already has its own)."""
    return weight if isinstance(weight, nn.Module) else frozen_param(weight)


def bind_kernel(model: nn.Module, kernel: W8A8Kernel) -> int:
    """Make every kept-quantised weight of `model` call `kernel`; the number bound."""
    weights = [m for m in model.modules() if isinstance(m, W8A8Weight)]
    for weight in weights:
        weight.kernel = kernel
    return len(weights)
