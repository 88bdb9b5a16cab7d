"""DeepSeek-V4's quantised weight formats (`dspark.runtime.families.dsv4.quant`) against naive references on
blocks quantised here: FP8 e4m3 with block scales (float and ue8m0, edge blocks included), FP4 e2m1 pairs with
ue8m0 scales per 32 values, Ascend W8A8 per-channel int8 with offsets; and what is refused, by name."""

from __future__ import annotations

import pytest
import torch

from dspark.runtime.families.dsv4.quant import (
    Dsv4QuantError,
    dequant_fp4,
    dequant_fp8_blocks,
    dequant_w8a8,
    dequantize_state,
)

from .dsv4_quant_common import naive_fp4, naive_fp8, naive_w8a8, quantise_fp4, quantise_fp8

GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("shape,block", [((24, 40), (8, 16)), ((130, 257), (128, 128)), ((5, 7), (8, 8))])
def test_fp8_blocks_dequantise_as_the_naive_rule(shape, block, ue8m0) -> None:
    w = torch.randn(shape, generator=GEN) * 3
    q, scale = quantise_fp8(w, block, ue8m0)
    got = dequant_fp8_blocks(q, scale, block)
    assert torch.equal(got, naive_fp8(q, scale, block))
    assert (got - w).abs().max() <= w.abs().max() * 2 ** -3  # e4m3 keeps 3 mantissa bits
    if ue8m0:  # the same scales as their raw bytes
        assert torch.equal(dequant_fp8_blocks(q, scale.view(torch.uint8), block), got)


def test_fp4_pairs_dequantise_as_the_naive_rule() -> None:
    w = torch.randn(6, 64, generator=GEN)
    packed, scale = quantise_fp4(w)
    got = dequant_fp4(packed, scale)
    assert torch.equal(got, naive_fp4(packed, scale))
    assert torch.equal(dequant_fp4(packed.view(torch.uint8), scale.view(torch.uint8)), got)
    assert (got - w).abs().max() <= 2 * w.abs().max() / 6  # the coarsest e2m1 step is 2 of 6, times the scale


@pytest.mark.parametrize("with_offset", [False, True])
def test_w8a8_per_channel_dequantises_as_the_naive_rule(with_offset: bool) -> None:
    w = torch.randn(12, 20, generator=GEN)
    scale = w.abs().amax(1) / 100
    offset = torch.randint(-20, 20, (12,), generator=GEN).float() if with_offset else None
    zero = offset if offset is not None else torch.zeros(12)
    q = (torch.round(w / scale[:, None]) + zero[:, None]).clamp(-128, 127).to(torch.int8)
    got = dequant_w8a8(q, scale[:, None], None if offset is None else offset[:, None])
    torch.testing.assert_close(got, naive_w8a8(q, scale, offset), rtol=0, atol=1e-6)


def test_dequantize_state_replaces_weights_and_drops_scales() -> None:
    fp8, fp8_scale = quantise_fp8(torch.randn(16, 16, generator=GEN), (8, 8), True)
    fp4, fp4_scale = quantise_fp4(torch.randn(4, 32, generator=GEN))
    w8 = torch.randint(-100, 100, (4, 8), dtype=torch.int8, generator=GEN)
    state = {"a.weight": fp8, "a.scale": fp8_scale, "b.weight": fp4, "b.scale": fp4_scale,
             "c.weight": w8, "c.weight_scale": torch.full((4, 1), 0.5), "d.weight": torch.ones(2, 2),
             "layers.0.hc_attn_scale": torch.ones(3), "model.layers.0.attn_hc.scale": torch.ones(3)}
    out = dequantize_state(state, (8, 8))
    assert sorted(out) == ["a.weight", "b.weight", "c.weight", "d.weight", "layers.0.hc_attn_scale",
                           "model.layers.0.attn_hc.scale"]
    assert torch.equal(out["a.weight"], naive_fp8(fp8, fp8_scale, (8, 8)))
    assert torch.equal(out["b.weight"], naive_fp4(fp4, fp4_scale))
    assert torch.equal(out["c.weight"], w8.float() * 0.5) and out["d.weight"] is state["d.weight"]


@pytest.mark.parametrize(("state", "message"), [
    ({"a.weight": torch.zeros(8, 8, dtype=torch.float8_e4m3fn)},
     "a.weight: an FP8 weight without its a.scale"),
    ({"a.weight": torch.zeros(8, 8, dtype=torch.int8)}, "a.weight: an integer weight without"),
    ({"a.weight": torch.zeros(8, 8), "a.scale": torch.ones(1, 1)}, "a.weight: a torch.float32 weight with"),
    ({"a.scale": torch.ones(1, 1)}, "a.scale: a scale without its weight"),
    ({"a.weight": torch.zeros(8, 8, dtype=torch.int8), "a.weight_scale": torch.ones(8), "a.input_scale":
      torch.ones(1)}, "a.input_scale: static W8A8"),
    ({"a.weight": torch.zeros(16, 16, dtype=torch.float8_e4m3fn), "a.scale": torch.ones(1, 1)},
     r"a.weight: FP8 scales \[1, 1\], a \[16, 16\] weight in 8 x 8 blocks needs \[2, 2\]"),
    ({"a.weight": torch.zeros(4, 16, dtype=torch.int8), "a.scale": torch.ones(4, 2)}, "a.weight: FP4 scales"),
    ({"a.weight": torch.zeros(4, 8, dtype=torch.int8), "a.weight_scale": torch.ones(3)}, "one per output"),
])
def test_a_malformed_quantised_tensor_is_refused_by_name(state, message) -> None:
    with pytest.raises(Dsv4QuantError, match=message):
        dequantize_state(state, (8, 8))
