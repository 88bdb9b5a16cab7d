"""The lightning indexer over int8 inputs (`Dsv4Geometry.index_quant`, set on Ascend): the quantisation and
the scores against naive references, the model's choice against a naive top-k, the Ascend operator model
refusing the unquantised inputs the device refuses, and the backend that sets it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.runtime.dsv4.ascend_ops import AscendOpArgumentError, reference_quant_lightning_indexer
from dspark.runtime.models.dsv4 import Indexer
from dspark.runtime.models.dsv4_ops import int8_index_scores, quantize_int8

GEN = torch.Generator().manual_seed(0)


def naive_quantize(row: list[float]) -> tuple[list[int], float]:
    scale = float(torch.tensor(max(abs(v) for v in row) / 127.0).half())
    if scale == 0:
        return [0] * len(row), 0.0
    return [max(-127, min(127, round(v / scale))) for v in row], scale  # Python's round: half to even


def test_quantize_int8_is_the_symmetric_per_row_rule() -> None:
    x = torch.randn(5, 3, 16, generator=GEN) * 4
    x[0, 0] = 0.0  # an all-zero row: scale 0, codes 0
    x[1, 1, 3] = float((x[1, 1].abs().max() / 127).half()) * 2.5  # a tie: half to even
    codes, scales = quantize_int8(x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16 and scales.shape == (5, 3)
    for i in range(5):
        for j in range(3):
            want_codes, want_scale = naive_quantize(x[i, j].tolist())
            assert codes[i, j].tolist() == want_codes and float(scales[i, j]) == want_scale


def test_int8_scores_are_the_naive_sum_over_heads() -> None:
    q, k = torch.randn(4, 8, generator=GEN), torch.randn(6, 8, generator=GEN)
    w = torch.randn(4, generator=GEN)
    (qc, qs), (kc, ks) = quantize_int8(q), quantize_int8(k)
    got = int8_index_scores(qc, qs, kc, ks, w)
    for n in range(6):
        want = 0.0
        for h in range(4):
            dot = sum(int(a) * int(b) for a, b in zip(qc[h], kc[n], strict=True))
            want += float(w[h]) * max(0.0, dot * float(qs[h]) * float(ks[n]))
        assert abs(float(got[n]) - want) <= 1e-5 * max(1.0, abs(want))


def test_the_model_chooses_the_top_k_of_the_int8_scores() -> None:
    cfg = Dsv4Geometry(index_n_heads=3, index_head_dim=8, index_topk=4, rope_dim=4, index_quant=True)
    indexer = Indexer(cfg, cfg.rope_for(4))
    q, w = torch.randn(3, 8, generator=GEN), torch.randn(3, generator=GEN)
    keys = torch.randn(9, 8, generator=GEN)
    scores = indexer.scores(q, w, keys)
    (qc, qs), (kc, ks) = quantize_int8(q), quantize_int8(keys)
    assert torch.equal(scores, int8_index_scores(qc, qs, kc, ks, w))
    order = sorted(range(9), key=lambda n: (-float(scores[n]), n))[:4]
    assert indexer.select(q, w, keys).tolist() == sorted(order)
    float_cfg = dataclasses.replace(cfg, index_quant=False)
    assert not torch.equal(Indexer(float_cfg, cfg.rope_for(4)).scores(q, w, keys), scores)


def _operator_args(**override: object) -> dict:
    args = dict(query=torch.zeros(2, 2, 8, dtype=torch.int8), key=torch.zeros(3, 4, 1, 8, dtype=torch.int8),
                weights=torch.ones(2, 2), query_dequant_scale=torch.ones(2, 2, dtype=torch.float16),
                key_dequant_scale=torch.ones(3, 4, 1, dtype=torch.float16),
                actual_seq_lengths_query=torch.tensor([2], dtype=torch.int32),
                actual_seq_lengths_key=torch.tensor([8], dtype=torch.int32),
                block_table=torch.tensor([[1, 2]], dtype=torch.int32), sparse_count=2, cmp_ratio=4)
    return {**args, **override}


@pytest.mark.parametrize(("override", "message"), [
    ({"query": torch.zeros(2, 2, 8)}, "query must be int8"),
    ({"key": torch.zeros(3, 4, 1, 8)}, "key must be int8"),
    ({"query_dequant_scale": torch.ones(2, 2)}, "query_dequant_scale must be float16"),
    ({"key_dequant_scale": torch.ones(3, 4, 1)}, "key_dequant_scale must be float16"),
    ({"key_dequant_scale": torch.ones(3, 5, 1, dtype=torch.float16)}, r"key_dequant_scale must be \[blocks"),
])
def test_the_quantised_operator_model_takes_only_int8_inputs_and_float16_scales(override, message) -> None:
    reference_quant_lightning_indexer(**_operator_args())  # the well-formed call runs
    with pytest.raises(AscendOpArgumentError, match=message):
        reference_quant_lightning_indexer(**_operator_args(**override))


def test_ascend_sets_the_int8_indexer_and_other_backends_do_not() -> None:
    geometry = Dsv4Geometry()
    assert geometry.for_backend("ascend").index_quant
    assert not geometry.for_backend("cpu").index_quant and not geometry.for_backend("cuda").index_quant
