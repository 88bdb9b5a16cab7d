"""DeepSeek-V4's quantised weight formats, read on the CPU by their exact dequantisation rule.

* FP8 e4m3 block-scaled linears (the release: `X.weight` float8_e4m3fn with `X.scale`; DeepSeek-V3 and
  transformers' FP8 layout: `X.weight_scale_inv`): one scale per `weight_block_size` block (128 x 128
  published; a partial block at the edge has its own scale), W[i, j] = q[i, j] * s[i // b0, j // b1]. Scales
  are float32 or ue8m0 (float8_e8m0fnu, or its bytes as uint8: 2^(b - 127)).
* FP4 e2m1 experts (`expert_dtype: fp4`): two values a byte, the even index in the low nibble, one ue8m0
  scale per 32 values of a row (MXFP4), W[i, j] = e2m1(q[i, j]) * s[i, j // 32].
* Ascend W8A8 (msmodelslim's W8A8_DYNAMIC): int8 `X.weight` with per-output-channel `X.weight_scale` and
  optional `X.weight_offset`, W[i, j] = (q[i, j] - offset[i]) * scale[i]. Static W8A8 (activation scales
  and `deq_scale` in the checkpoint) is refused.

On the Ascend backend W8A8 weights stay quantised (`split_w8a8`, then `w8a8.W8A8Weight`: activations quantised
per token at run time, the product in int8); everywhere else, and for FP8 and FP4 on every backend, the model
computes with the dequantised weights (docs/dsv4.md says what runs where). Read from transformers'
`Fp8Dequantize`, vLLM's and vllm-ascend's weight loaders for the layouts; the arithmetic is the formats' own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from dspark.formats.dsv4_config import FP8_BLOCK

FP4_GROUP = 32
# e2m1: sign, two exponent bits (bias 1), one mantissa bit; codes 0..7 positive, 8..15 their negatives
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
# every tensor a quantised weight brings beside it
_QUANT_SUFFIXES = (*_SCALE_SUFFIXES, ".weight_scale", ".weight_offset")
_W8A8_STATIC = (".input_scale", ".input_offset", ".deq_scale", ".quant_bias")


class Dsv4QuantError(ValueError):
    """A quantised tensor that does not follow its format (the message names it)."""


def scale_values(scale: Tensor) -> Tensor:
    """Scales as float32: ue8m0 (float8_e8m0fnu, or uint8 bytes) is 2^(b - 127); floats as they are."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.to(torch.float32) - 127.0)
    return scale.to(torch.float32)


def check_fp8_scales(weight: Tensor, scale: Tensor, block: Sequence[int], name: str = "") -> None:
    """An FP8 weight [out, in] has one scale per block: [ceil(out / b0), ceil(in / b1)]."""
    out, inn = weight.shape
    grid = (math.ceil(out / block[0]), math.ceil(inn / block[1]))
    if tuple(scale.shape) != grid:
        raise Dsv4QuantError(f"{name}: FP8 scales {list(scale.shape)}, a [{out}, {inn}] weight in "
                             f"{block[0]} x {block[1]} blocks needs {list(grid)}")


def dequant_fp8_blocks(weight: Tensor, scale: Tensor, block: Sequence[int] = FP8_BLOCK,
                       name: str = "") -> Tensor:
    """float8_e4m3fn weight [out, in] and its block scales [ceil(out / b0), ceil(in / b1)] -> float32."""
    check_fp8_scales(weight, scale, block, name)
    out, inn = weight.shape
    b0, b1 = block
    s = scale_values(scale).repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :inn]
    return weight.to(torch.float32) * s


def unpack_fp4(packed: Tensor) -> Tensor:
    """[..., n] bytes of e2m1 pairs -> float32 [..., 2n] (byte k holds values 2k (low nibble), 2k + 1)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    u8 = packed.contiguous().view(torch.uint8).long()
    return torch.stack([table[u8 & 0xF], table[u8 >> 4]], dim=-1).flatten(-2)


def dequant_fp4(packed: Tensor, scale: Tensor, name: str = "") -> Tensor:
    """Packed e2m1 weight [out, in / 2] (int8 or uint8), ue8m0 scales [out, in / 32] -> float32 [out, in]."""
    values = unpack_fp4(packed)
    out, inn = values.shape
    if inn % FP4_GROUP or tuple(scale.shape) != (out, inn // FP4_GROUP):
        raise Dsv4QuantError(f"{name}: FP4 scales {list(scale.shape)}, a [{out}, {inn}] weight needs one "
                             f"per {FP4_GROUP} values of a row, [{out}, {inn // FP4_GROUP}]")
    return values * scale_values(scale).repeat_interleave(FP4_GROUP, 1)


def dequant_w8a8(weight: Tensor, scale: Tensor, offset: Tensor | None, name: str = "") -> Tensor:
    """int8 weight [out, in], per-channel scale and offset ([out] or [out, 1]) -> float32."""
    out = weight.shape[0]
    for what, t in (("weight_scale", scale), ("weight_offset", offset)):
        if t is not None and t.numel() != out:
            raise Dsv4QuantError(f"{name}: {what} has {t.numel()} values, one per output channel is {out}")
    zero = 0.0 if offset is None else offset.reshape(out, 1).to(torch.float32)
    return (weight.to(torch.float32) - zero) * scale.reshape(out, 1).to(torch.float32)


def split_w8a8(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """The W8A8_DYNAMIC weights of a checkpoint, to keep quantised: their int8 codes by the weight's name
    (`X.weight`), their float32 channel scales ([out]) by the same name, and the other tensors. A weight
    offset other than 0 is refused (the NPU's int8 product is symmetric in the weight)."""
    codes, scales, rest = {}, {}, dict(state)
    for name, tensor in sorted(state.items()):  # the first refused, by name, whatever the file order
        stem = name.removesuffix(".weight")
        if not name.endswith(".weight") or tensor.dtype != torch.int8 or stem + ".weight_scale" not in state:
            continue
        scale, offset = state[stem + ".weight_scale"], state.get(stem + ".weight_offset")
        out = tensor.shape[0]
        if scale.numel() != out:
            raise Dsv4QuantError(f"{name}: weight_scale has {scale.numel()} values, one per output channel "
                                 f"is {out}")
        if offset is not None and bool(offset.ne(0).any()):
            raise Dsv4QuantError(f"{name}: a nonzero weight_offset cannot stay quantised (the NPU's int8 "
                                 "product is symmetric); load this checkpoint on the cpu backend")
        codes[name], scales[name] = tensor, scale.reshape(out).to(torch.float32)
        for suffix in (".weight", ".weight_scale", ".weight_offset"):
            rest.pop(stem + suffix, None)
    return codes, scales, rest


def split_fp8(state: dict[str, Tensor], fp8_block: Sequence[int] = FP8_BLOCK
              ) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """The FP8 block-scaled weights of a checkpoint, to keep quantised: their float8_e4m3fn codes by the
    weight's name, their block scales as float32 by the same name (checked against `fp8_block`), and the
    other tensors."""
    codes, scales, rest = {}, {}, dict(state)
    for name, tensor in sorted(state.items()):
        stem = name.removesuffix(".weight")
        found = [stem + s for s in _SCALE_SUFFIXES if stem + s in state]
        if not name.endswith(".weight") or tensor.dtype != torch.float8_e4m3fn or len(found) != 1:
            continue  # the dequantiser refuses what does not fit (no scale, or two)
        check_fp8_scales(tensor, state[found[0]], fp8_block, name)
        codes[name], scales[name] = tensor, scale_values(state[found[0]])
        rest.pop(name)
        rest.pop(found[0])
    return codes, scales, rest


def dequantize_state(state: dict[str, Tensor], fp8_block: Sequence[int] = FP8_BLOCK) -> dict[str, Tensor]:
    """A checkpoint's tensors with every quantised weight replaced by its float32 value and its scales
    dropped; a scale without its weight, an integer or FP8 weight without its scale, or static W8A8 tensors
    are refused by name."""
    static = sorted(n for n in state if n.endswith(_W8A8_STATIC))
    if static:
        raise Dsv4QuantError(f"{static[0]}: static W8A8 (activation scales in the checkpoint) is not read; "
                             "use a W8A8_DYNAMIC or unquantised checkpoint")
    out = dict(state)
    for name, tensor in state.items():
        if not name.endswith(".weight"):
            continue
        stem = name.removesuffix(".weight")
        scales = [stem + s for s in _SCALE_SUFFIXES if stem + s in state]
        w8a8 = stem + ".weight_scale" in state
        if len(scales) > 1 or (scales and w8a8):
            raise Dsv4QuantError(f"{name}: more than one scale ({', '.join(scales)})")
        if tensor.dtype == torch.float8_e4m3fn:
            if not scales:
                raise Dsv4QuantError(f"{name}: an FP8 weight without its {stem}.scale")
            out[name] = dequant_fp8_blocks(tensor, state[scales[0]], fp8_block, name)
        elif tensor.dtype in (torch.int8, torch.uint8) and w8a8:
            offset = state.get(stem + ".weight_offset")
            out[name] = dequant_w8a8(tensor, state[stem + ".weight_scale"], offset, name)
        elif tensor.dtype in (torch.int8, torch.uint8):
            if not scales:
                raise Dsv4QuantError(f"{name}: an integer weight without its {stem}.scale (FP4) or "
                                     f"{stem}.weight_scale (W8A8)")
            out[name] = dequant_fp4(tensor, state[scales[0]], name)
        elif scales or w8a8:
            raise Dsv4QuantError(f"{name}: a {tensor.dtype} weight with quantisation scales")
        for suffix in _QUANT_SUFFIXES:
            out.pop(stem + suffix, None)
    # every scale of a weight present was dropped above: those left have no weight
    orphans = sorted(n for n in out if n.endswith(_QUANT_SUFFIXES) and not _is_hc_scale(n))
    if orphans:
        raise Dsv4QuantError(f"{orphans[0]}: a scale without its weight")
    return out


def _is_hc_scale(name: str) -> bool:
    """transformers' module names give the hyper-connections' learned scales as `attn_hc.scale` /
    `ffn_hc.scale`: weights of the model, not quantisation scales."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ("attn_hc", "ffn_hc")
