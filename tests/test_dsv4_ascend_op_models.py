"""CPU references of the Ascend DSV4 operators (dspark.runtime.families.dsv4.ascend_op_models) against naive
computations.

The naive side works from positions only: row p of request b attends to raw positions [p-W+1, p] of that
request's history and to its compressed entries 0 .. floor((p+1)/r) - 1 (C4: only the given top-k), with one
sink-augmented softmax; caches are filled here from the definitions (ring slot p % C, entry e at page
e // page_size), sharing no code with the references.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dspark.runtime.families.dsv4 import Dsv4PageTables, Dsv4StepConfig, plan_dsv4_verify
from dspark.runtime.families.dsv4.ascend_op_models import (
    AscendOpArgumentError,
    compressor_write_from_metadata,
    reference_compressor_write,
    reference_lightning_indexer,
    reference_sparse_attn_sharedkv,
    run_dsv4_layer_reference,
)

D, N1, NI, DI = 8, 4, 3, 8  # head dim, query heads, indexer heads, indexer head dim
SCALE = 0.3


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def naive_attend(q_row: torch.Tensor, keys: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """[heads, D] query against keys [n, D] (value = key), sink logit per head in the denominator."""
    out = torch.zeros_like(q_row)
    for h in range(q_row.shape[0]):
        logits = keys @ q_row[h] * SCALE
        if sinks is not None:
            logits = torch.cat([logits, sinks[h : h + 1]])
        if logits.numel() == 0:
            continue
        probs = logits.softmax(0)[: keys.shape[0]]
        out[h] = probs @ keys
    return out


def naive_topk(q_row: torch.Tensor, w_row: torch.Tensor, keys: torch.Tensor, k: int) -> tuple[list, list]:
    scores = [float(sum(w_row[h] * torch.relu(q_row[h] @ keys[e]) for h in range(q_row.shape[0])))
              for e in range(keys.shape[0])]
    order = sorted(range(len(scores)), key=lambda e: (-scores[e], e))[:k]
    return order + [-1] * (k - len(order)), [scores[e] for e in order]


# ----------------------------------------------------------------------------------------------------------
# random geometries, calling the operators directly


def paged(histories: list[torch.Tensor], block_size: int, cols: int, gen: torch.Generator):
    """A paged cache [blocks, block_size, KV_N, D] holding histories[b][j] at logical index j, pages shuffled,
    garbage elsewhere, and its block table [B, cols] (unused columns: a spare garbage page)."""
    batch = len(histories)
    kv_heads = histories[0].shape[1]
    num_blocks = batch * cols + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.tensor(perm[: batch * cols], dtype=torch.int32).view(batch, cols)
    cache = torch.randn(num_blocks, block_size, kv_heads, D, generator=gen)
    for b, hist in enumerate(histories):
        for j in range(hist.shape[0]):
            cache[table[b, j // block_size], j % block_size] = hist[j]
    return cache, table


@pytest.mark.parametrize("seed", range(8))
def test_sas_matches_naive_on_random_geometries(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    kv_heads = 1 if seed % 2 == 0 else 2
    ratio = (1, 4, 128, 4)[seed % 4]
    window, right, bs = rng.randint(1, 6), (1 if seed == 5 else 0), 4
    batch = rng.randint(1, 4)
    q_lens = [rng.randint(0, 5) for _ in range(batch)]
    kv_lens = [q + rng.randint(0, 300 if ratio == 128 else 20) for q in q_lens]
    if seed == 3:
        kv_lens[0] = max(q_lens[0] - 2, 0)  # rows before the first key output 0
    hist = [torch.randn(kv, kv_heads, D, generator=gen) for kv in kv_lens]
    cols = max(1, ceil_div(max(kv_lens), bs))
    ori_kv, ori_table = paged(hist, bs, cols, gen)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    rows = cu[-1] + 2  # two rows past the last request: never computed
    q = torch.randn(rows, kv_heads * N1, D, generator=gen)
    sinks = torch.randn(kv_heads * N1, generator=gen) if seed != 1 else None
    kwargs = dict(ori_kv=ori_kv, ori_block_table=ori_table, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                  seqused_kv=torch.tensor(kv_lens, dtype=torch.int32), sinks=sinks, softmax_scale=SCALE,
                  ori_win_left=window - 1, ori_win_right=right, cmp_ratio=ratio)
    chist, topk = [], None
    if ratio > 1:
        chist = [torch.randn(kv // ratio, kv_heads, D, generator=gen) for kv in kv_lens]
        cbs = 2
        cmp_kv, cmp_table = paged(chist, cbs, max(1, ceil_div(max(kv_lens) // ratio, cbs)), gen)
        kwargs.update(cmp_kv=cmp_kv, cmp_block_table=cmp_table)
        if ratio == 4:  # random top-k: shuffled visible ids, an out-of-range id, then -1
            k = 5
            topk = torch.full((rows, kv_heads, k), -1, dtype=torch.int32)
            for b in range(batch):
                for i in range(q_lens[b]):
                    p = kv_lens[b] - q_lens[b] + i
                    vis = max(0, (p + 1) // 4)
                    for n2 in range(kv_heads):
                        ids = rng.sample(range(vis), min(vis, k - 1)) + [vis + 3]
                        topk[cu[b] + i, n2, : len(ids)] = torch.tensor(ids[:k], dtype=torch.int32)
            kwargs["cmp_sparse_indices"] = topk
    out = reference_sparse_attn_sharedkv(q, **kwargs)

    group = N1
    expect = torch.zeros_like(q)
    for b in range(batch):
        for i in range(q_lens[b]):
            t, p = cu[b] + i, kv_lens[b] - q_lens[b] + i
            if p < 0:
                continue
            for n2 in range(kv_heads):
                keys = hist[b][max(0, p - window + 1) : min(p + right, kv_lens[b] - 1) + 1, n2]
                if ratio > 1:
                    vis = (p + 1) // ratio
                    if topk is None:
                        ids = list(range(vis))
                    else:
                        ids = [e for e in topk[t, n2, : min(5, vis)].tolist() if e != -1 and e < vis]
                    keys = torch.cat([keys, chist[b][ids, n2] if ids else keys[:0]])
                hs = slice(n2 * group, (n2 + 1) * group)
                expect[t, hs] = naive_attend(q[t, hs], keys, None if sinks is None else sinks[hs])
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_indexer_matches_naive_on_random_geometries(seed):
    rng, gen = random.Random(100 + seed), torch.Generator().manual_seed(100 + seed)
    ratio, k = (4, 4, 1, 128)[seed], rng.randint(1, 6)
    batch = rng.randint(1, 4)
    q_lens = [rng.randint(0, 5) for _ in range(batch)]
    kv_lens = [q + rng.randint(0, 600 if ratio == 128 else 30) for q in q_lens]
    keys = [torch.randn(kv // ratio, 1, DI, generator=gen) for kv in kv_lens]
    cache, table = paged(keys, 4, max(1, ceil_div(max(kv_lens) // ratio, 4)), gen)
    ends = np.cumsum(q_lens).tolist()
    rows = ends[-1]
    q = torch.randn(rows, NI, DI, generator=gen)
    w = torch.randn(rows, NI, generator=gen)
    mode = 0 if seed == 1 else 3
    idx, vals = reference_lightning_indexer(
        q, cache[:, :, :, :DI], w, actual_seq_lengths_query=torch.tensor(ends, dtype=torch.int32),
        actual_seq_lengths_key=torch.tensor(kv_lens, dtype=torch.int32), block_table=table, sparse_count=k,
        sparse_mode=mode, cmp_ratio=ratio)
    assert idx.shape == (rows, 1, k) and idx.dtype == torch.int32
    start = 0
    for b in range(batch):
        for i in range(q_lens[b]):
            t = start + i
            vis = kv_lens[b] // ratio
            if mode == 3:
                vis = min(vis, (kv_lens[b] - q_lens[b] + i + 1) // ratio)
            want_idx, want_val = naive_topk(q[t], w[t], keys[b][:vis, 0], k)
            assert idx[t, 0].tolist() == want_idx
            torch.testing.assert_close(vals[t, 0, : len(want_val)], torch.tensor(want_val),
                                       rtol=1e-5, atol=1e-5)
            assert torch.isinf(vals[t, 0, len(want_val) :]).all()
        start += q_lens[b]


def test_indexer_ties_keep_index_order():
    key = torch.ones(2, 4, 1, DI)
    q = torch.ones(1, NI, DI)
    idx, _ = reference_lightning_indexer(
        q, key, torch.ones(1, NI), actual_seq_lengths_query=torch.tensor([1], dtype=torch.int32),
        actual_seq_lengths_key=torch.tensor([32], dtype=torch.int32),
        block_table=torch.tensor([[1, 0]], dtype=torch.int32), sparse_count=10, cmp_ratio=4)
    assert idx[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, -1, -1]


# ----------------------------------------------------------------------------------------------------------
# planned verify steps


CFG = Dsv4StepConfig(num_draft_tokens=6, window=5, compress_ratios=(4, 128), swa_page_size=4,
                     swa_ring_size=12, cmp_page_sizes={4: 4, 128: 2}, index_topk=3)

STEPS = {  # name: (verify_lens, prefix_lens, tier, num_slots)
    "static_crossing_c128": ([6, 6, 6], [122, 3, 250], 18, 5),
    "compact_padded": ([2, 6, 1, 4], [126, 0, 7, 253], 24, 8),
    "compact_short_prefixes": ([3, 1, 5], [0, 1, 2], 12, 4),
    "padding_only": ([], [], 6, 2),
}


class Step:
    """A planned step with caches filled from per-request histories."""

    def __init__(self, lens, prefix, tier, num_slots, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.lens, self.prefix = lens, prefix
        self.kv = [p + n for p, n in zip(prefix, lens, strict=True)]
        r_count, ring_pages = len(lens), CFG.swa_ring_pages
        ids = iter(np.random.default_rng(seed).permutation(np.arange(1, 400)).tolist())
        swa = np.array([[next(ids) for _ in range(ring_pages)] for _ in range(r_count)], np.int32)
        swa = swa.reshape(r_count, ring_pages)
        cmp = {}
        for r, cps in CFG.cmp_page_sizes.items():
            width = max([1] + [ceil_div(kv // r, cps) for kv in self.kv])
            cmp[r] = np.array([[next(ids) for _ in range(width)] for _ in range(r_count)], np.int32)
            cmp[r] = cmp[r].reshape(r_count, width)
        self.tables = Dsv4PageTables(swa=swa, compressed=cmp)
        self.meta = plan_dsv4_verify(lens, prefix, CFG, self.tables, tier=tier, num_slots=num_slots)
        pages = 400
        ps, ring = CFG.swa_page_size, CFG.swa_ring_size
        self.hist = [torch.randn(kv, D, generator=gen) for kv in self.kv]
        self.ori_kv = torch.randn(pages, ps, 1, D, generator=gen)
        for b, h in enumerate(self.hist):
            for pos in range(self.kv[b]):  # in order: a later position overwrites its ring slot
                s = pos % ring
                self.ori_kv[swa[b][s // ps], s % ps, 0] = h[pos]
        self.cmp_hist, self.cmp_kv, self.idx_hist, self.idx_kv = {}, {}, {}, {}
        for r, cps in CFG.cmp_page_sizes.items():
            self.cmp_hist[r] = [torch.randn(kv // r, D, generator=gen) for kv in self.kv]
            self.idx_hist[r] = [torch.randn(kv // r, DI, generator=gen) for kv in self.kv]
            self.cmp_kv[r] = torch.randn(pages, cps, 1, D, generator=gen)
            self.idx_kv[r] = torch.randn(pages, cps, 1, DI, generator=gen)
            for b in range(r_count):
                for e in range(self.kv[b] // r):
                    page = cmp[r][b][e // cps]
                    self.cmp_kv[r][page, e % cps, 0] = self.cmp_hist[r][b][e]
                    self.idx_kv[r][page, e % cps, 0] = self.idx_hist[r][b][e]
        tier_rows = self.meta.tier
        self.q = torch.randn(tier_rows, N1, D, generator=gen)
        self.sinks = torch.randn(N1, generator=gen)
        self.iq = torch.randn(tier_rows, NI, DI, generator=gen)
        self.iw = torch.randn(tier_rows, NI, generator=gen)
        # (slot, position) of every real row, from the lengths alone
        self.real_rows = [(b, prefix[b] + i) for b in range(r_count) for i in range(lens[b])]

    def run(self, ratio, **kw):
        extra = {}
        if ratio:
            extra["cmp_kv"] = self.cmp_kv[ratio]
        if ratio == 4:
            extra.update(index_query=self.iq, index_key=self.idx_kv[4], index_weights=self.iw)
        return run_dsv4_layer_reference(self.meta, compress_ratio=ratio, q=self.q, ori_kv=self.ori_kv,
                                        softmax_scale=SCALE, sinks=self.sinks, **extra, **kw)

    def naive_row(self, t, ratio):
        b, p = self.real_rows[t]
        keys = self.hist[b][max(0, p - CFG.window + 1) : p + 1]
        topk = None
        if ratio:
            vis = (p + 1) // ratio
            ids = list(range(vis))
            if ratio == 4:
                topk, _ = naive_topk(self.iq[t], self.iw[t], self.idx_hist[4][b][:vis], CFG.index_topk)
                ids = [e for e in topk if e != -1]
            keys = torch.cat([keys, self.cmp_hist[ratio][b][ids]])
        return naive_attend(self.q[t], keys, self.sinks), topk


@pytest.mark.parametrize("name", STEPS)
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_planned_step_real_rows_match_naive(name, ratio):
    step = Step(*STEPS[name], seed=len(name))
    res = step.run(ratio)
    assert res.attention_out.shape == (step.meta.tier, N1, D)
    for t in range(len(step.real_rows)):
        want, topk = step.naive_row(t, ratio)
        torch.testing.assert_close(res.attention_out[t], want, rtol=1e-5, atol=1e-5)
        if ratio == 4:
            assert res.topk_indices[t, 0].tolist() == topk
    if ratio == 0:  # vllm-ascend's DSpark form: the window as explicit slots, no block table
        via_slots = step.run(0, use_swa_indices=True).attention_out
        real = len(step.real_rows)
        torch.testing.assert_close(via_slots[:real], res.attention_out[:real], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", STEPS)
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_padding_rows_read_only_the_null_page(name, ratio):
    """Padding requests (prefix 0, null-page tables) read only page 0, real rows never do; what padding rows
    output is the operator's attention over null-page garbage (both peers discard it). Through
    `swa_indices` (all -1 for padding rows) they read nothing and output 0."""
    step = Step(*STEPS[name], seed=7)
    reads: dict = {}
    idx_reads: dict = {}
    res = step.run(ratio, reads=reads)
    real, tier = len(step.real_rows), step.meta.tier
    ps = CFG.swa_page_size
    cps = CFG.cmp_page_sizes.get(ratio, 1)
    for t in range(tier):
        pages = {s // ps for s in reads["ori"][t]} | {s // cps for s in reads["cmp"][t]}
        if t < real:
            assert 0 not in pages and reads["ori"][t], t
        else:
            assert pages == {0}, t
    if ratio == 4:  # the indexer of padding rows scores null-page keys only
        plan = step.meta.compressed[4].device
        reference_lightning_indexer(
            step.iq, step.idx_kv[4], step.iw, actual_seq_lengths_query=step.meta.device.actual_seq_lengths_q,
            actual_seq_lengths_key=step.meta.device.seqused_kv, block_table=plan.cmp_block_table,
            sparse_count=CFG.index_topk, cmp_ratio=4, reads=idx_reads)
        for t in range(tier):
            assert all((s // cps == 0) == (t >= real) for s in idx_reads["key"][t]), t
    if ratio in (0, 128):  # padding row i of a padding request: window positions -> null-page slots q % ps
        h = step.meta.host
        for t in range(real, tier):
            i = t - int(h.cu_seqlens_q[h.row_slot[t]])
            keys = step.ori_kv[0, [q % ps for q in range(max(0, i - CFG.window + 1), i + 1)], 0]
            torch.testing.assert_close(res.attention_out[t], naive_attend(step.q[t], keys, step.sinks),
                                       rtol=1e-5, atol=1e-5)
        slot_reads: dict = {}
        via_slots = step.run(ratio, use_swa_indices=True, reads=slot_reads) if ratio == 0 else None
        if via_slots is not None:
            assert torch.equal(via_slots.attention_out[real:], torch.zeros(tier - real, N1, D))
            assert all(not slot_reads["ori"][t] for t in range(real, tier))


@pytest.mark.parametrize("name", STEPS)
@pytest.mark.parametrize("ratio", [4, 128])
def test_compressor_writes_each_block_to_its_entry_slot(name, ratio):
    step = Step(*STEPS[name], seed=3)
    gen = torch.Generator().manual_seed(11)
    slots_total = step.meta.num_slots
    width = max([1] + step.kv)
    kv_hist = torch.randn(slots_total, width, D, generator=gen)
    score = torch.randn(slots_total, width, D, generator=gen)
    cps = CFG.cmp_page_sizes[ratio]
    before = step.cmp_kv[ratio]
    expected = before.clone().view(-1, D)
    for b, p in step.real_rows:
        if (p + 1) % ratio == 0:
            e = (p + 1) // ratio - 1
            slot = int(step.tables.compressed[ratio][b][e // cps]) * cps + e % cps
            block = kv_hist[b, p - ratio + 1 : p + 1]
            expected[slot] = (block * score[b, p - ratio + 1 : p + 1].softmax(0)).sum(0)
    vllm_cache, entries = compressor_write_from_metadata(step.meta, ratio, before, kv_hist,
                                                         score_history=score, ascend_loc=False)
    torch.testing.assert_close(vllm_cache.view(-1, D), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(before.view(-1, D)[0], step.cmp_kv[ratio].view(-1, D)[0])  # input untouched
    ascend_cache, _ = compressor_write_from_metadata(step.meta, ratio, before, kv_hist, score_history=score)
    changed = (ascend_cache.view(-1, D) != expected).any(-1).nonzero().flatten().tolist()
    assert all(s // cps == 0 for s in changed)  # pads land in the null page only
    m_real = int((step.meta.compressed[ratio].host.boundary_rows >= 0).sum())
    if m_real < entries.shape[0]:
        assert torch.equal(ascend_cache.view(-1, D)[0], torch.zeros(D))
        assert torch.equal(entries[m_real:], torch.zeros(entries.shape[0] - m_real, D))


def test_compressor_mean_without_scores_and_refusals():
    cache = torch.zeros(2, 2, 1, D)
    hist = torch.arange(8 * D, dtype=torch.float32).view(1, 8, D)
    kw = dict(cmp_ratio=4, boundary_rows=torch.tensor([3, -1], dtype=torch.int32),
              cmp_positions=torch.tensor([0, 0]), slots=torch.tensor([2, -1]),
              positions=torch.arange(4, dtype=torch.int64), row_slot=torch.zeros(4, dtype=torch.int32))
    new, entries = reference_compressor_write(cache, hist, **kw)
    torch.testing.assert_close(new.view(-1, D)[2], hist[0, :4].mean(0))
    with pytest.raises(AscendOpArgumentError, match="does not close a block"):
        reference_compressor_write(cache, hist, **{**kw, "cmp_positions": torch.tensor([1, 0])})
    with pytest.raises(AscendOpArgumentError, match="outside the cache"):
        reference_compressor_write(cache, hist, **{**kw, "slots": torch.tensor([9, -1])})


# ----------------------------------------------------------------------------------------------------------
# refusals


def sas_args(**over):
    base = dict(q=torch.randn(3, 2, D), ori_kv=torch.randn(4, 4, 1, D),
                ori_block_table=torch.tensor([[1, 2]], dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32),
                seqused_kv=torch.tensor([6], dtype=torch.int32), softmax_scale=SCALE, ori_win_left=3)
    return {**base, **over}


C4 = {"cmp_ratio": 4, "cmp_kv": torch.randn(2, 2, 1, D),
      "cmp_block_table": torch.zeros(1, 1, dtype=torch.int32)}


@pytest.mark.parametrize(("over", "match"), [
    ({"q": torch.randn(3, D)}, "q must have 3 dims"),
    ({"q": torch.randn(3, 2, D, dtype=torch.float64)}, "q must be"),
    ({"ori_kv": torch.randn(4, 4, 1, D).half()}, "ori_kv must be float32"),
    ({"ori_kv": torch.randn(4, 4, 3, D)}, "multiple of ori_kv heads"),
    ({"cu_seqlens_q": torch.tensor([0, 3])}, "cu_seqlens_q must be int32"),
    ({"cu_seqlens_q": torch.tensor([1, 3], dtype=torch.int32)}, "must start with 0"),
    ({"cu_seqlens_q": torch.tensor([0, 4], dtype=torch.int32)}, "end at most at T=3"),
    ({"seqused_kv": torch.tensor([6, 6], dtype=torch.int32)}, "seqused_kv must have B=1"),
    ({"seqused_kv": torch.tensor([-1], dtype=torch.int32)}, "must be >= 0"),
    ({"seqused_kv": torch.tensor([20], dtype=torch.int32)}, "has 2 columns"),
    ({"ori_block_table": torch.tensor([[1, 7]], dtype=torch.int32)}, "outside the cache's 4 blocks"),
    ({"ori_block_table": torch.tensor([[1, -1]], dtype=torch.int32)}, "outside the cache"),
    ({"ori_block_table": None}, "ori_block_table"),
    ({"sinks": torch.zeros(3)}, r"sinks must be float32 \[N1=2\]"),
    ({"sinks": torch.zeros(2, dtype=torch.float64)}, "sinks must be float32"),
    ({"cmp_ratio": 4}, "cmp_kv must be given exactly when"),
    ({"cmp_ratio": 8, "cmp_kv": torch.randn(2, 2, 1, D)}, "cmp_ratio must be one of"),
    ({"cmp_ratio": 4, "cmp_kv": torch.randn(2, 2, 1, D)}, "cmp_block_table is required"),
    ({**C4, "cmp_sparse_indices": torch.zeros(2, 1, 4, dtype=torch.int32)},
     r"cmp_sparse_indices must be \[T=3"),
    ({**C4, "ori_sparse_indices": torch.zeros(3, 1, 4, dtype=torch.int32)}, "only honoured without cmp_kv"),
    ({"ori_sparse_indices": torch.full((3, 1, 4), 99, dtype=torch.int32)}, "outside ori_kv"),
    ({"ori_win_left": -2}, "ori_win_left"),
])
def test_sas_refuses_bad_inputs(over, match):
    with pytest.raises(AscendOpArgumentError, match=match):
        reference_sparse_attn_sharedkv(**sas_args(**over))


def test_unmodelled_modes_are_refused():
    with pytest.raises(NotImplementedError, match="TND"):
        reference_sparse_attn_sharedkv(**sas_args(layout_q="BSND"))
    with pytest.raises(NotImplementedError, match="ori_mask_mode"):
        reference_sparse_attn_sharedkv(**sas_args(ori_mask_mode=3))
    args = dict(actual_seq_lengths_query=torch.tensor([2], dtype=torch.int32),
                actual_seq_lengths_key=torch.tensor([8], dtype=torch.int32),
                block_table=torch.tensor([[1]], dtype=torch.int32), sparse_count=2, cmp_ratio=4)
    key, q, w = torch.randn(2, 4, 1, DI), torch.randn(2, NI, DI), torch.randn(2, NI)
    with pytest.raises(NotImplementedError, match="pre_tokens"):
        reference_lightning_indexer(q, key, w, **args, pre_tokens=5)
    with pytest.raises(AscendOpArgumentError, match="weights must be"):
        reference_lightning_indexer(q, key, torch.randn(2, NI + 1), **args)
    with pytest.raises(AscendOpArgumentError, match="sparse_count"):
        reference_lightning_indexer(q, key, w, **{**args, "sparse_count": 0})
    with pytest.raises(AscendOpArgumentError, match="sparse_mode"):
        reference_lightning_indexer(q, key, w, **args, sparse_mode=1)
    with pytest.raises(AscendOpArgumentError, match="non-decreasing"):
        reference_lightning_indexer(q, key, w, **{**args, "actual_seq_lengths_query": torch.tensor(
            [3], dtype=torch.int32)})
    with pytest.raises(AscendOpArgumentError, match="key must be"):
        reference_lightning_indexer(q, key.half(), w, **args)
    step = Step(*STEPS["compact_short_prefixes"])
    with pytest.raises(AscendOpArgumentError, match="needs index_query"):
        run_dsv4_layer_reference(step.meta, compress_ratio=4, q=step.q, ori_kv=step.ori_kv, softmax_scale=1.0,
                                 cmp_kv=step.cmp_kv[4])
    with pytest.raises(AscendOpArgumentError, match="compress_ratio"):
        run_dsv4_layer_reference(step.meta, compress_ratio=8, q=step.q, ori_kv=step.ori_kv, softmax_scale=1.0)
