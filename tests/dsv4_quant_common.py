"""Naive references for DeepSeek-V4's quantised weight formats, shared by tests/test_dsv4_quant.py and
tests/test_dsv4_transformers.py: quantising float weights to FP8 e4m3 blocks and FP4 e2m1 pairs, and
dequantising FP8, FP4 and Ascend W8A8 element by element, each by its plain rule."""

from __future__ import annotations

import math

import torch


def pow2_at_least(x: float) -> float:
    return 2.0 ** math.ceil(math.log2(x)) if x > 0 else 1.0


def quantise_fp8(w: torch.Tensor, block: tuple[int, int], ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1])
    scale = torch.zeros(rows, cols)
    q = torch.zeros(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            s = float(part.abs().max()) / 448.0
            s = pow2_at_least(s) if ue8m0 else s
            scale[i, j] = s
            rows_, cols_ = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            q[rows_, cols_] = (part / s).to(torch.float8_e4m3fn)
    return q, (scale.to(torch.float8_e8m0fnu) if ue8m0 else scale)


def naive_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    s = scale.float()
    out = torch.empty(q.shape)
    for i in range(q.shape[0]):
        for j in range(q.shape[1]):
            out[i, j] = float(q[i, j].float()) * float(s[i // block[0], j // block[1]])
    return out


def e2m1_from_bits(code: int) -> float:
    """The e2m1 value of a 4-bit code from its bits: sign, two exponent bits (bias 1), one mantissa bit."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man / 2 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2))


def quantise_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.tensor([e2m1_from_bits(c) for c in range(16)])
    out, inn = w.shape
    scale = torch.zeros(out, inn // 32)
    codes = torch.zeros(out, inn, dtype=torch.long)
    for i in range(out):
        for g in range(inn // 32):
            part = w[i, g * 32:(g + 1) * 32]
            s = pow2_at_least(float(part.abs().max()) / 6.0)
            scale[i, g] = s
            codes[i, g * 32:(g + 1) * 32] = ((part / s).unsqueeze(1) - values).abs().argmin(1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def naive_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    u8 = packed.view(torch.uint8)
    out = torch.empty(u8.shape[0], 2 * u8.shape[1])
    for i in range(u8.shape[0]):
        for k in range(u8.shape[1]):
            byte = int(u8[i, k])
            for half, code in ((0, byte & 0xF), (1, byte >> 4)):
                j = 2 * k + half
                out[i, j] = e2m1_from_bits(code) * float(scale[i, j // 32].float())
    return out


def naive_w8a8(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """Ascend W8A8 per channel: (q[i, j] - offset[i]) * scale[i], scale and offset [out] or [out, 1] (no
    offset: 0)."""
    scales = scale.reshape(-1).tolist()
    zeros = offset.reshape(-1).tolist() if offset is not None else [0.0] * q.shape[0]
    return torch.tensor([[(int(q[i, j]) - zeros[i]) * scales[i] for j in range(q.shape[1])]
                         for i in range(q.shape[0])])
