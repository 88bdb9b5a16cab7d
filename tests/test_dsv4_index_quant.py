"""The lightning indexer over int8 inputs (`Dsv4Geometry.index_quant`, set on Ascend): the quantisation and
the scores against naive references, the model's choice against a naive top-k (on data where the float
indexer chooses otherwise), the Ascend operator model's choice over int8 codes against a naive top-k and its
refusing the unquantised inputs the device refuses, and the backend that sets it."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.runtime.families.dsv4.ascend_op_models import (
    AscendOpArgumentError,
    reference_quant_lightning_indexer,
)
from dspark.runtime.families.dsv4.model import Indexer
from dspark.runtime.families.dsv4.ops import int8_index_scores, quantize_int8

GEN = torch.Generator().manual_seed(0)


def naive_quantize(row: list[float]) -> tuple[list[int], float]:
    scale = float(torch.tensor(max(abs(v) for v in row) / 127.0).half())
    if scale == 0:
        return [0] * len(row), 0.0
    return [max(-127, min(127, round(v / scale))) for v in row], scale  # Python's round: half to even


def naive_score(q_codes: list[list[int]], q_scales: list[float], k_codes: list[int], k_scale: float,
                weights: list[float]) -> float:
    """One key's score: sum_h w_h * relu((q_h . k) * s_q,h * s_k), the dot products in integers."""
    total = 0.0
    for qc, qs, w in zip(q_codes, q_scales, weights, strict=True):
        dot = sum(a * b for a, b in zip(qc, k_codes, strict=True))
        total += w * max(0.0, dot * qs * k_scale)
    return total


def naive_top(scores: list[float], k: int) -> list[int]:
    """The ids of the k best scores, best first, equal scores to the lower id."""
    return sorted(range(len(scores)), key=lambda n: (-scores[n], n))[:k]


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
        want = naive_score(qc.tolist(), qs.tolist(), kc[n].tolist(), float(ks[n]), w.tolist())
        assert abs(float(got[n]) - want) <= 1e-5 * max(1.0, abs(want))


def test_the_model_chooses_the_top_k_of_the_int8_scores() -> None:
    """Indexer.scores and Indexer.select with `index_quant` against the naive quantisation and sum, on keys
    with an outlier channel (which the queries do not read): their per-key scale coarsens the other channels'
    codes, so the int8 choice is not the float one (asserted)."""
    cfg = Dsv4Geometry(index_n_heads=3, index_head_dim=8, index_topk=4, rope_dim=4, index_quant=True)
    indexer = Indexer(cfg, cfg.rope_for(4))
    gen = torch.Generator().manual_seed(2)
    q, w = torch.randn(3, 8, generator=gen), torch.randn(3, generator=gen)
    keys = torch.randn(9, 8, generator=gen)
    keys[:, 0], q[:, 0] = 40.0, 0.0
    q_codes, q_scales = zip(*(naive_quantize(r) for r in q.tolist()), strict=True)
    want = [naive_score(list(q_codes), list(q_scales), *naive_quantize(r), w.tolist()) for r in keys.tolist()]
    scores = indexer.scores(q, w, keys)
    for got, naive in zip(scores.tolist(), want, strict=True):
        assert abs(got - naive) <= 1e-5 * max(1.0, abs(naive))
    ranked = sorted(want, reverse=True)
    assert ranked[3] - ranked[4] > 1e-3 * max(1.0, abs(ranked[3]))  # no near tie at the k-th choice
    chosen = indexer.select(q, w, keys).tolist()
    assert chosen == sorted(naive_top(want, 4))
    float_indexer = Indexer(dataclasses.replace(cfg, index_quant=False), cfg.rope_for(4))
    assert not torch.equal(float_indexer.scores(q, w, keys), scores)
    assert float_indexer.select(q, w, keys).tolist() != chosen  # the data tells int8 from float


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


def test_the_quantised_operator_model_chooses_the_naive_top_k_of_int8_codes() -> None:
    """Random int8 codes and float16 scales, three requests over shuffled pages, 4 query heads on 2 kv heads,
    the causal mask (sparse_mode 3) over compressed entries (cmp_ratio 4): per row and kv head, the indices
    are the naive top-k (k = 3) of the naive int8 scores, best first, equal scores to the lower id, then -1
    (rows see 0 to 7 entries); the values are those scores, then -inf. Repeated keys make ties, some across
    the k-th choice."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, bs, ratio, k = 4, 2, 8, 4, 4, 3
    q_lens, kv_lens = [3, 2, 3], [29, 12, 5]  # 7, 3 and 1 entries: rows seeing 6..7, 2..3 and 0..1
    rows, blocks = sum(q_lens), 6
    query = torch.randint(-127, 128, (rows, heads, dim), generator=gen, dtype=torch.int8)
    key = torch.randint(-127, 128, (blocks, bs, kv_heads, dim), generator=gen, dtype=torch.int8)
    q_scale = (torch.rand(rows, heads, generator=gen) / 64 + 1 / 256).half()
    k_scale = (torch.rand(blocks, bs, kv_heads, generator=gen) / 64 + 1 / 256).half()
    weights = torch.randn(rows, heads, generator=gen)
    table = torch.tensor([[4, 1], [5, 2], [0, 3]], dtype=torch.int32)  # entry j of b: page table[b, j // bs]

    def slot(b: int, j: int) -> tuple[int, int]:
        return int(table[b, j // bs]), j % bs

    for b, src, dst in ((0, 1, 3), (0, 0, 5), (1, 0, 2)):  # ties: entry dst repeats entry src
        key[slot(b, dst)], k_scale[slot(b, dst)] = key[slot(b, src)], k_scale[slot(b, src)]
    indices, values = reference_quant_lightning_indexer(
        query, key, weights, query_dequant_scale=q_scale, key_dequant_scale=k_scale,
        actual_seq_lengths_query=torch.tensor([3, 5, 8], dtype=torch.int32),
        actual_seq_lengths_key=torch.tensor(kv_lens, dtype=torch.int32), block_table=table, sparse_count=k,
        cmp_ratio=ratio)
    assert indices.shape == values.shape == (rows, kv_heads, k) and indices.dtype == torch.int32
    group, t, boundary_ties = heads // kv_heads, 0, 0
    for b, (q_len, kv) in enumerate(zip(q_lens, kv_lens, strict=True)):
        for i in range(q_len):
            visible = min(kv // ratio, (kv - q_len + i + 1) // ratio)
            for n2 in range(kv_heads):
                hs = range(n2 * group, (n2 + 1) * group)
                q_codes, q_scales = [query[t, h].tolist() for h in hs], [float(q_scale[t, h]) for h in hs]
                w = [float(weights[t, h]) for h in hs]
                scores = [naive_score(q_codes, q_scales, key[slot(b, j)][n2].tolist(),
                                      float(k_scale[slot(b, j)][n2]), w) for j in range(visible)]
                top, ranked = naive_top(scores, k), sorted(scores, reverse=True)[: k + 1]
                # equal scores are repeated keys; others far apart for fp32 (the operator's) to order alike
                assert all(x == y or x - y > 1e-4 * abs(x) for x, y in itertools.pairwise(ranked)), scores
                boundary_ties += len(ranked) > k and ranked[k - 1] == ranked[k]
                assert indices[t, n2].tolist() == top + [-1] * (k - len(top)), (t, n2, scores)
                want = [scores[j] for j in top] + [float("-inf")] * (k - len(top))
                torch.testing.assert_close(values[t, n2], torch.tensor(want), rtol=1e-5, atol=1e-5)
            t += 1
    assert boundary_ties, "no tie across the k-th choice"
    assert (indices[:, :, 0] == -1).any() and ((indices == -1).sum(-1) == 1).any()  # 0 and k - 1 entries
