"""Row-invariant pieces of the DeepSeek-V4 reference (`dspark.runtime.families.dsv4.model` and its MoE and
hyper-connection modules): a row's result must not depend on how many rows are computed with it.

Linear layers are an elementwise product and a sum over the input (a BLAS GEMM picks other kernels for 1
row than for 5); transcendental elementwise operations (SiLU, sigmoid, softplus, exp) run in the fixed
tiles of `ops.lanewise`, so a vector lane and the scalar tail never split a row differently; sums over a
handful of streams or experts are written out in a fixed order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from dspark.formats.dsv4_config import Rope
from dspark.runtime.models.ops import SMALL_ELEMENT_TILE, lanewise

if TYPE_CHECKING:
    from dspark.runtime.families.dsv4.w8a8 import W8A8Weight


def row_linear(x: Tensor, weight: Tensor | W8A8Weight) -> Tensor:
    """x [..., in] @ weight[out, in].T -> [..., out], each output one fixed-length sum over `in` (a GEMM
    would pick a different kernel, and different rounding, for one row than for several). A weight kept
    quantised (`w8a8.W8A8Weight`) computes its own product, also row by row."""
    if not isinstance(weight, Tensor):
        return weight.linear(x)
    return (x.unsqueeze(-2) * weight).sum(-1)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight


def tiled(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """`fn(x)` for an elementwise transcendental, every element in a full vector iteration."""
    return lanewise(fn, x, SMALL_ELEMENT_TILE) if x.numel() else x


def row_softmax(x: Tensor) -> Tensor:
    """Softmax over the last dimension: the maximum and the subtraction are exact, exp runs in fixed tiles."""
    e = tiled(torch.exp, x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """silu(gate) * up, both clamped by `limit` first as DeepSeek-V4 clamps them (gate from above, up on both
    sides); limit 0 clamps nothing."""
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return tiled(F.silu, gate) * up


_ROPE_TABLES: dict[Rope, tuple[Tensor, Tensor]] = {}


def rope_cos_sin(rope: Rope, pos: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin [*pos.shape, rope.dim // 2] in fp32. Tabled per position with libm and only ever extended,
    because a vectorised torch.cos may round a lane differently from its scalar tail, and a position's
    angles must not depend on the batch it was first asked for in."""
    empty = torch.zeros(0, rope.dim // 2)
    cos, sin = _ROPE_TABLES.get(rope, (empty, empty))
    need = int(pos.max()) + 1 if pos.numel() else 0
    if need > cos.shape[0]:
        freqs = rope.frequencies()
        new = range(cos.shape[0], max(need, 2 * cos.shape[0]))
        cos = torch.cat([cos, torch.tensor([[math.cos(p * f) for f in freqs] for p in new])])
        sin = torch.cat([sin, torch.tensor([[math.sin(p * f) for f in freqs] for p in new])])
        _ROPE_TABLES[rope] = (cos, sin)
    return cos[pos], sin[pos]


def apply_rope(x: Tensor, pos: Tensor, rope: Rope, inverse: bool = False) -> Tensor:
    """Rotate the trailing rope.dim channels of x [..., D] by position pos (shape x.shape[:-1],
    broadcastable), interleaved pairs (2i, 2i+1)."""
    cos, sin = rope_cos_sin(rope, pos)
    if inverse:
        sin = -sin
    nope, rot = x[..., : x.shape[-1] - rope.dim], x[..., x.shape[-1] - rope.dim :]
    a, b = rot[..., 0::2], rot[..., 1::2]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([nope, rot], dim=-1)


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 over the last dimension, as Ascend's quantised lightning indexer takes its inputs (quant
    mode 0: one scale per token and head, or per key): x [..., d] -> codes int8 [..., d] and float16 dequant
    scales [...], scale = max|x| / 127 rounded to float16, codes = round(x / scale) (half to even), clamped
    to +-127; an all-zero vector gets scale 0 and codes 0. Elementwise but for the row's own maximum, so a
    row's codes do not depend on the rows beside it."""
    scale = (x.abs().amax(-1) / 127.0).to(torch.float16)
    s = scale.to(torch.float32).unsqueeze(-1)
    codes = torch.where(s > 0, torch.round(x / torch.where(s > 0, s, 1.0)), 0.0).clamp(-127, 127)
    return codes.to(torch.int8), scale


def int8_index_scores(q_codes: Tensor, q_scale: Tensor, k_codes: Tensor, k_scale: Tensor, weights: Tensor
                      ) -> Tensor:
    """One row's lightning-indexer scores over int8 keys: q_codes [IH, ID], q_scale [IH], k_codes [n, ID],
    k_scale [n], weights [IH] -> [n] fp32: sum_h w_h * relu(q_h . k * s_q,h * s_k). The integer dot products
    are exact in fp32 (|q . k| <= 127^2 * ID < 2^24 for ID < 1040)."""
    dots = (q_codes.to(torch.float32).unsqueeze(1) * k_codes.to(torch.float32)).sum(-1)  # [IH, n]
    scaled = dots * q_scale.to(torch.float32)[:, None] * k_scale.to(torch.float32)[None, :]
    return (scaled.relu() * weights.to(torch.float32)[:, None]).sum(0)


def ordered_sum(parts: list[Tensor]) -> Tensor:
    """parts[0] + parts[1] + ... added left to right (a few streams or experts: the order is the model's)."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total
