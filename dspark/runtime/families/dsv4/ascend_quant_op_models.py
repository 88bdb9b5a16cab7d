"""CPU models of the two Ascend operators a W8A8_DYNAMIC linear calls (`w8a8.npu_kernel`), from their
documented semantics, checking their inputs as the operators do. Nothing here imports torch_npu.

`reference_dynamic_quant` -- `torch_npu.npu_dynamic_quant(x)` (aclnnDynamicQuant, no smooth scales)
    Per-token symmetric int8: scale = row_max(|x|) / 127 in float32 (one per row, the shape of x without its
    last dimension), y = round(x / scale) as int8. x is float16 or bfloat16 with at least two dimensions.
    The documentation says `round`; modelled as round half to even (torch.round), an all-zero row as scale 0
    and codes 0.

`reference_quant_matmul` -- `torch_npu.npu_quant_matmul(x1, x2, scale, *, pertoken_scale, output_dtype)`
    x1 int8 [m, k], x2 int8 [k, n] (the weight, transposed), integer products accumulated exactly (int32),
    then dequantised: acc[i, j] * scale[j] * pertoken_scale[i] in float32, rounded to `output_dtype`
    (float16 or bfloat16). scale is float32 or bfloat16 [n] (or [1]); pertoken_scale float32 [m]. Left out:
    `offset` and `bias`, int8 output (`output_dtype` None / int8) and int4 (int32-packed) inputs, refused.
"""

from __future__ import annotations

import torch
from torch import Tensor

HALF_TYPES = (torch.float16, torch.bfloat16)
INT8_MAX = 127.0


def reference_dynamic_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    if x.dtype not in HALF_TYPES or x.dim() < 2:
        raise TypeError(f"npu_dynamic_quant: x must be float16 or bfloat16 with 2+ dimensions, got {x.dtype} "
                        f"{list(x.shape)}")
    values = x.to(torch.float32)
    scale = values.abs().amax(-1) / INT8_MAX  # [...]
    safe = torch.where(scale > 0, scale, 1.0).unsqueeze(-1)
    codes = torch.where(scale.unsqueeze(-1) > 0, torch.round(values / safe), 0.0).clamp(-INT8_MAX, INT8_MAX)
    return codes.to(torch.int8), scale


def reference_quant_matmul(x1: Tensor, x2: Tensor, scale: Tensor, *, offset: Tensor | None = None,
                           pertoken_scale: Tensor | None = None, bias: Tensor | None = None,
                           output_dtype: torch.dtype | None = None) -> Tensor:
    if x1.dtype != torch.int8 or x2.dtype != torch.int8 or x1.dim() != 2 or x2.dim() != 2:
        raise TypeError(f"npu_quant_matmul: x1 and x2 must be 2-D int8 (modelled), got {x1.dtype} "
                        f"{list(x1.shape)} and {x2.dtype} {list(x2.shape)}")
    (m, k), (k2, n) = x1.shape, x2.shape
    if k != k2:
        raise ValueError(f"npu_quant_matmul: x1 [{m}, {k}] and x2 [{k2}, {n}] do not multiply")
    if scale.dtype not in (torch.float32, torch.bfloat16) or scale.dim() != 1 or scale.numel() not in (1, n):
        raise TypeError(f"npu_quant_matmul: scale must be float32 or bfloat16 [1] or [{n}], got "
                        f"{scale.dtype} {list(scale.shape)}")
    if pertoken_scale is None or pertoken_scale.dtype != torch.float32 or tuple(pertoken_scale.shape) != (m,):
        raise TypeError(f"npu_quant_matmul: pertoken_scale must be float32 [{m}] (modelled with it)")
    if offset is not None or bias is not None or output_dtype not in HALF_TYPES:
        raise NotImplementedError("npu_quant_matmul: only float16 / bfloat16 output without offset or bias "
                                  "is modelled")
    acc = (x1.to(torch.int32) @ x2.to(torch.int32)).to(torch.float32)  # exact: |acc| < 2^31
    out = acc * scale.to(torch.float32)[None, :] * pertoken_scale[:, None]
    return out.to(output_dtype)
