"""DSV4 verify-step metadata (dspark.runtime.families.dsv4) against a per-row reference written from the
definitions.

The reference below walks every slot and row with plain loops; it shares no code with the library.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.runtime.families.dsv4 import (
    Dsv4MetadataError,
    Dsv4PageTables,
    Dsv4StepConfig,
    plan_dsv4_verify,
)


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def reference(lens, prefix, cfg: Dsv4StepConfig, tables: Dsv4PageTables, tier=None, num_slots=None,
              max_kv_len=None) -> dict:
    """Every field, row by row and slot by slot, straight from the definitions."""
    n_real = len(lens)
    tier = sum(lens) if tier is None else tier
    slot_lens, slot_prefix = list(lens), list(prefix)
    spare = tier - sum(lens)
    while spare > 0:
        take = min(cfg.padding_request_rows, spare)
        slot_lens.append(take)
        slot_prefix.append(0)
        spare -= take
    while num_slots is not None and len(slot_lens) < num_slots:
        slot_lens.append(0)
        slot_prefix.append(0)
    slots = len(slot_lens)
    rows = []  # (slot, position)
    for b in range(slots):
        for i in range(slot_lens[b]):
            rows.append((b, slot_prefix[b] + i))
    cu = [0]
    for length in slot_lens:
        cu.append(cu[-1] + length)
    kv = [max(slot_prefix[b] + slot_lens[b], 1) for b in range(slots)]
    width_len = max(kv) if max_kv_len is None else max_kv_len
    ps, ring, w = cfg.swa_page_size, cfg.swa_ring_size, cfg.window

    def raw_slot(b, p):
        page = int(tables.swa[b][(p % ring) // ps]) if b < n_real else 0
        return page * ps + (p % ring) % ps

    out = {
        "cu_seqlens_q": cu, "seqused_q": slot_lens, "start_pos": slot_prefix, "kv_lens": kv,
        "positions": [p for _, p in rows], "row_slot": [b for b, _ in rows],
        "swa_slot_mapping": [raw_slot(b, p) for b, p in rows],
        "swa_window_start": [], "swa_window_lens": [], "swa_indices": [], "ori_block_table": [],
    }
    for b, p in rows:
        if b < n_real:
            start = max(0, p - w + 1)
            window = [raw_slot(b, q) for q in range(start, p + 1)]
        else:
            start, window = 0, []
        out["swa_window_start"].append(start)
        out["swa_window_lens"].append(len(window))
        out["swa_indices"].append(window + [-1] * (w - len(window)))
    ring_pages = ring // ps
    for b in range(slots):
        row = []
        for j in range(ceil_div(width_len, ps)):
            used = b < n_real and j < ceil_div(slot_prefix[b] + slot_lens[b], ps)
            row.append(int(tables.swa[b][j % ring_pages]) if used else 0)
        out["ori_block_table"].append(row)

    for r in cfg.compress_ratios:
        cps = cfg.cmp_page_sizes[r]
        pages = tables.compressed[r]
        m = min(tier, tier // r + slots)
        bound, positions, slot_map = [], [], []
        for t, (b, p) in enumerate(rows):
            if b < n_real and (p + 1) % r == 0:
                e = (p + 1) // r - 1
                bound.append(t)
                positions.append(p - r + 1)
                slot_map.append(int(pages[b][e // cps]) * cps + e % cps)
        assert len(bound) <= m
        pad = m - len(bound)
        table = []
        for b in range(slots):
            entries = (slot_prefix[b] + slot_lens[b]) // r if b < n_real else 0
            table.append([int(pages[b][j]) if j < ceil_div(entries, cps) else 0
                          for j in range(max(1, ceil_div(width_len // r, cps)))])
        out[r] = {
            "boundary_rows": bound + [-1] * pad,
            "cmp_positions": positions + [0] * pad,
            "cmp_slot_mapping": slot_map + [-1] * pad,
            "cmp_loc": slot_map + [0] * pad,
            "cmp_writes": [(slot_prefix[b] + slot_lens[b]) // r - slot_prefix[b] // r if b < n_real else 0
                           for b in range(slots)],
            "cmp_kv_lens": [(slot_prefix[b] + slot_lens[b]) // r if b < n_real else 0 for b in range(slots)],
            "cmp_residual_k": [(slot_prefix[b] + slot_lens[b]) % r if b < n_real else 0
                               for b in range(slots)],
            "cmp_visible": [(p + 1) // r if b < n_real else 0 for b, p in rows],
            "cmp_block_table": table,
        }
    return out


def assert_matches(meta, ref: dict) -> None:
    for field in dataclasses.fields(meta.host):
        host = getattr(meta.host, field.name)
        assert host.tolist() == ref[field.name], field.name
        assert not host.flags.writeable, field.name
        assert torch.equal(getattr(meta.device, field.name).cpu(), torch.from_numpy(host.copy())), field.name
    for r, plan in meta.compressed.items():
        assert plan.num_cmp_rows == len(ref[r]["boundary_rows"])
        for field in dataclasses.fields(plan.host):
            host = getattr(plan.host, field.name)
            assert host.tolist() == ref[r][field.name], (r, field.name)
            device = getattr(plan.device, field.name)
            assert torch.equal(device.cpu(), torch.from_numpy(host.copy())), (r, field.name)


def config(**overrides) -> Dsv4StepConfig:
    base = dict(num_draft_tokens=8, window=4, compress_ratios=(4, 128), swa_page_size=4, swa_ring_size=12,
                cmp_page_sizes={4: 16, 128: 2}, index_topk=3)
    return Dsv4StepConfig(**{**base, **overrides})


def example_tables() -> Dsv4PageTables:
    return Dsv4PageTables(swa=np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], np.int32),
                          compressed={4: np.array([[10, -1], [11, 12], [-1, -1]], np.int32),
                                      128: np.array([[-1], [21], [-1]], np.int32)})


def test_worked_example_by_hand():
    # B=3 requests, P=[3, 126, 0], L=[2, 5, 1], N=8, T=16, W=4, ring of 12 slots in pages of 4.
    # The 8 spare rows form one padding request (prefix 0, 8 rows), so there are 4 slots.
    meta = plan_dsv4_verify([2, 5, 1], [3, 126, 0], config(), example_tables(), tier=16)
    h = meta.host
    assert (meta.num_requests, meta.num_slots, meta.tier, meta.total_rows) == (3, 4, 16, 8)
    assert h.cu_seqlens_q.tolist() == [0, 2, 7, 8, 16]
    assert h.actual_seq_lengths_q.tolist() == [2, 7, 8, 16]
    assert h.seqused_q.tolist() == [2, 5, 1, 8]
    assert h.start_pos.tolist() == [3, 126, 0, 0]
    assert h.kv_lens.tolist() == h.seqused_kv.tolist() == [5, 131, 1, 8]
    assert h.positions.tolist() == [3, 4, 126, 127, 128, 129, 130, 0, 0, 1, 2, 3, 4, 5, 6, 7]
    # Request 0: position 3 is ring slot 3 (page 1, offset 3), position 4 ring slot 4 (page 2, offset 0).
    # Request 1: position 126 is ring slot 6 (page 5, offset 2). Padding rows write the null page.
    assert h.swa_slot_mapping.tolist()[:3] == [7, 8, 22]
    assert h.swa_slot_mapping.tolist()[8:] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert h.swa_indices[0].tolist() == [4, 5, 6, 7]  # positions 0..3
    assert h.swa_indices[2].tolist() == [19, 20, 21, 22]  # positions 123..126
    assert h.swa_indices[7].tolist() == [28, -1, -1, -1]  # request 2 sees its position 0 only
    assert h.swa_indices[8].tolist() == [-1] * 4  # padding row
    assert h.ori_block_table[1, :6].tolist() == [4, 5, 6, 4, 5, 6]  # absolute page j -> ring page j % 3
    assert h.ori_block_table[0, :3].tolist() == [1, 2, 0]
    c4, c128 = meta.compressed[4].host, meta.compressed[128].host
    # C4 blocks close at position 3 (row 0) and 127 (row 3); request 1's entry 31 is on its page 1.
    assert meta.compressed[4].num_cmp_rows == min(16, 16 // 4 + 4) == 8
    assert c4.boundary_rows.tolist() == [0, 3, -1, -1, -1, -1, -1, -1]
    assert c4.cmp_positions.tolist() == [0, 124, 0, 0, 0, 0, 0, 0]
    assert c4.cmp_slot_mapping.tolist() == [10 * 16 + 0, 12 * 16 + 15, -1, -1, -1, -1, -1, -1]
    assert c4.cmp_loc.tolist() == [160, 207, 0, 0, 0, 0, 0, 0]
    assert c4.cmp_writes.tolist() == [1, 1, 0, 0]
    assert c4.cmp_kv_lens.tolist() == [1, 32, 0, 0]
    assert c4.cmp_residual_k.tolist() == [1, 3, 1, 0]
    assert c4.cmp_visible.tolist()[:8] == [1, 1, 31, 32, 32, 32, 32, 0]
    # ceil(floor(131 / 4) / 16) = 2 pages wide; request 0's one entry needs its first page only.
    assert c4.cmp_block_table.tolist() == [[10, 0], [11, 12], [0, 0], [0, 0]]
    # C128 closes only at position 127 (row 3), entry 0 of request 1 on page 21.
    assert meta.compressed[128].num_cmp_rows == min(16, 16 // 128 + 4) == 4
    assert c128.boundary_rows.tolist() == [3, -1, -1, -1]
    assert c128.cmp_positions.tolist() == [0, 0, 0, 0]
    assert c128.cmp_slot_mapping.tolist() == [42, -1, -1, -1]
    assert c128.cmp_writes.tolist() == [0, 1, 0, 0]
    assert (meta.max_seqlen_q, meta.max_seqlen_kv, meta.ori_win_left, meta.ori_win_right) == (8, 131, 3, 0)
    assert meta.topk_indices_shape == (16, 3)
    assert_matches(meta, reference([2, 5, 1], [3, 126, 0], config(), example_tables(), tier=16))


def test_static_step_and_empty_slots():
    cfg = config(compress_ratios=(4,), cmp_page_sizes={4: 16})
    tables = Dsv4PageTables(swa=np.array([[1, 2, 3], [4, 5, 6]]), compressed={4: np.array([[7, 8], [9, 10]])})
    meta = plan_dsv4_verify([8, 8], [24, 0], cfg, tables, num_slots=4, max_kv_len=100)
    assert meta.host.seqused_q.tolist() == [8, 8, 0, 0]
    assert meta.host.kv_lens.tolist() == [32, 8, 1, 1]
    assert meta.host.ori_block_table.shape == (4, 25)
    assert meta.compressed[4].host.cmp_block_table.shape == (4, 2)
    assert_matches(meta, reference([8, 8], [24, 0], cfg, tables, num_slots=4, max_kv_len=100))


def test_padding_only_step():
    # Graph capture plans a step of padding only: no real requests, every row a padding row.
    cfg = config(padding_request_rows=3)
    empty = Dsv4PageTables(swa=np.zeros((0, 3), np.int32),
                           compressed={4: np.zeros((0, 1), np.int32), 128: np.zeros((0, 1), np.int32)})
    meta = plan_dsv4_verify([], [], cfg, empty, tier=8, num_slots=4)
    assert meta.host.seqused_q.tolist() == [3, 3, 2, 0]
    assert (meta.compressed[4].host.boundary_rows == -1).all()
    assert_matches(meta, reference([], [], cfg, empty, tier=8, num_slots=4))


def test_device_tensors_share_one_device():
    meta = plan_dsv4_verify([2, 5, 1], [3, 126, 0], config(), example_tables(), device=torch.device("cpu"))
    assert meta.torch_device.type == "cpu"
    assert meta.device.swa_indices.dtype == torch.int32 and meta.device.positions.dtype == torch.int64


@st.composite
def steps(draw):
    n = draw(st.integers(1, 8))
    w = draw(st.integers(1, 20))
    ratios = tuple(r for r in (4, 128) if draw(st.booleans()))
    ps = draw(st.sampled_from([1, 2, 4, 8]))
    ring = ceil_div(w + n - 1 + draw(st.integers(0, 9)), ps) * ps
    cps = {r: draw(st.sampled_from([1, 2, 4, 16])) for r in ratios}
    cfg = Dsv4StepConfig(num_draft_tokens=n, window=w, compress_ratios=ratios, swa_page_size=ps,
                         swa_ring_size=ring, cmp_page_sizes=cps, index_topk=draw(st.integers(1, 64)),
                         padding_request_rows=draw(st.integers(1, n)))
    count = draw(st.integers(0, 6))
    static = draw(st.booleans())
    lens = [n] * count if static else draw(st.lists(st.integers(1, n), min_size=count, max_size=count))
    # Prefixes right at, just below and just past block boundaries of both ratios, and anywhere.
    near = st.builds(lambda k, r, d: max(0, k * r + d), st.integers(0, 3), st.sampled_from([4, 128]),
                     st.integers(-2, 1))
    prefix = draw(st.lists(st.one_of(near, st.integers(0, 600)), min_size=count, max_size=count))
    total = sum(lens)
    tier = draw(st.one_of(st.none(), st.integers(max(total, 1), total + 2 * n)))
    if count == 0 and tier is None:
        tier = draw(st.integers(1, 2 * n))
    spare = (tier or total) - total
    needed = count + ceil_div(spare, cfg.padding_request_rows)
    num_slots = draw(st.one_of(st.none(), st.integers(needed, needed + 3)))
    longest = max([p + length for p, length in zip(prefix, lens, strict=True)] + [spare, 1])
    max_kv_len = draw(st.one_of(st.none(), st.integers(longest, longest + 300)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    swa = rng.permutation(np.arange(1, 1 + count * (ring // ps))).reshape(count, ring // ps)
    compressed = {}
    for r in ratios:
        cols = max([ceil_div((p + length) // r, cps[r])
                    for p, length in zip(prefix, lens, strict=True)] + [0])
        cols += draw(st.integers(0, 2))
        table = rng.permutation(np.arange(1, 1 + count * cols)).reshape(count, cols)
        for b in range(count):  # columns past a request's pages hold whatever the allocator left there
            table[b, ceil_div((prefix[b] + lens[b]) // r, cps[r]):] = -1
        compressed[r] = table.astype(np.int32)
    tables = Dsv4PageTables(swa=swa.astype(np.int32), compressed=compressed)
    return lens, prefix, cfg, tables, tier, num_slots, max_kv_len


@given(steps())
@settings(max_examples=500, deadline=None)
def test_random_steps_match_reference(step):
    lens, prefix, cfg, tables, tier, num_slots, max_kv_len = step
    meta = plan_dsv4_verify(lens, prefix, cfg, tables, tier=tier, num_slots=num_slots, max_kv_len=max_kv_len)
    assert_matches(meta, reference(lens, prefix, cfg, tables, tier, num_slots, max_kv_len))
    for plan in meta.compressed.values():
        assert int((plan.host.boundary_rows >= 0).sum()) == int(plan.host.cmp_writes.sum())


@pytest.mark.parametrize(("overrides", "field"), [
    ({"num_draft_tokens": 0}, "num_draft_tokens"),
    ({"window": 0}, "window"),
    ({"compress_ratios": (1,), "cmp_page_sizes": {1: 1}}, "compress_ratios"),
    ({"compress_ratios": (4, 4)}, "compress_ratios"),
    ({"swa_page_size": 0}, "swa_page_size"),
    ({"swa_ring_size": 14}, "swa_ring_size"),  # not a multiple of the page size
    ({"swa_ring_size": 8}, "swa_ring_size"),  # below W + N - 1 = 11
    ({"cmp_page_sizes": {4: 16}}, "cmp_page_sizes"),
    ({"cmp_page_sizes": {4: 0, 128: 2}}, "cmp_page_sizes"),
    ({"index_topk": 0}, "index_topk"),
    ({"padding_request_rows": 9}, "padding_request_rows"),
])
def test_config_refusals(overrides, field):
    with pytest.raises(Dsv4MetadataError, match=field):
        config(**overrides)


def test_no_index_topk_needed_without_c4():
    assert config(compress_ratios=(128,), cmp_page_sizes={128: 2}, index_topk=0).index_topk == 0


@pytest.mark.parametrize(("lens", "prefix", "kwargs", "field"), [
    ([2, 5], [3, 126, 0], {}, "prefix_lens"),
    ([0, 5, 1], [3, 126, 0], {}, "verify_lens"),
    ([2, 9, 1], [3, 126, 0], {}, "verify_lens"),
    ([2, 5, 1], [3, -1, 0], {}, "prefix_lens"),
    ([2, 5, 1], [3, 126, 0], {"tier": 7}, "tier"),
    ([], [], {}, "tier"),
    ([2, 5, 1], [3, 126, 0], {"num_slots": 2}, "num_slots"),
    ([2, 5, 1], [3, 126, 0], {"tier": 24, "num_slots": 4}, "num_slots"),  # 2 padding requests needed
    ([2, 5, 1], [3, 126, 0], {"max_kv_len": 130}, "max_kv_len"),
])
def test_step_refusals(lens, prefix, kwargs, field):
    tables = example_tables()
    if not lens:
        tables = Dsv4PageTables(swa=np.zeros((0, 3), np.int32),
                                compressed={4: np.zeros((0, 0), np.int32), 128: np.zeros((0, 0), np.int32)})
    with pytest.raises(Dsv4MetadataError, match=field):
        plan_dsv4_verify(lens, prefix, config(), tables, **kwargs)


@pytest.mark.parametrize(("swa", "compressed", "field"), [
    (np.array([[1, 2], [4, 5], [7, 8]]), None, r"page_tables\.swa"),  # not the ring's 3 pages
    (np.array([[1, 2, 3], [4, 0, 6], [7, 8, 9]]), None, r"page_tables\.swa"),  # the null page
    (np.array([[1, 2, 3], [4, 5, 6]]), None, r"page_tables\.swa"),  # a row short
    (None, {4: np.array([[10], [11], [14]]), 128: np.array([[1], [21], [1]])}, r"compressed\[4\]"),
    (None, {4: np.array([[10, 1], [0, 12], [1, 1]]), 128: np.array([[1], [21], [1]])}, r"compressed\[4\]"),
    (None, {4: np.array([[10, 1], [11, 12], [1, 1]])}, r"compressed\[128\]"),
    (None, {4: np.array([[10, 1], [11, 12], [1, 1]]), 128: np.array([[1.0], [21], [1]])},
     r"compressed\[128\]"),
])
def test_page_table_refusals(swa, compressed, field):
    base = example_tables()
    tables = Dsv4PageTables(swa=base.swa if swa is None else swa,
                            compressed=base.compressed if compressed is None else compressed)
    with pytest.raises(Dsv4MetadataError, match=field):
        plan_dsv4_verify([2, 5, 1], [3, 126, 0], config(), tables)


def test_arrays_validate_themselves():
    meta = plan_dsv4_verify([2, 5, 1], [3, 126, 0], config(), example_tables(), tier=16)
    with pytest.raises(Dsv4MetadataError, match="kv_lens"):
        dataclasses.replace(meta.host, kv_lens=meta.host.kv_lens.astype(np.int64))
    with pytest.raises(Dsv4MetadataError, match="cu_seqlens_q"):
        dataclasses.replace(meta.host, cu_seqlens_q=meta.host.cu_seqlens_q[::-1].copy())
    with pytest.raises(Dsv4MetadataError, match="kv_lens"):
        dataclasses.replace(meta.host, kv_lens=meta.host.kv_lens + 1)
    with pytest.raises(Dsv4MetadataError, match="swa_window_lens"):
        dataclasses.replace(meta.host, swa_indices=meta.host.swa_indices[:, :2])
    with pytest.raises(Dsv4MetadataError, match="swa_indices must have window=5"):
        dataclasses.replace(meta, config=config(window=5))
    with pytest.raises(Dsv4MetadataError, match="positions"):
        dataclasses.replace(meta.device, positions=meta.device.positions.to(torch.int32))
    narrower = dataclasses.replace(meta.device, ori_block_table=meta.device.ori_block_table[:, :5])
    with pytest.raises(Dsv4MetadataError, match="ori_block_table: host"):
        dataclasses.replace(meta, device=narrower)
    c4 = meta.compressed[4]
    with pytest.raises(Dsv4MetadataError, match="boundary_rows"):
        dataclasses.replace(c4.host, boundary_rows=c4.host.boundary_rows[::-1].copy())
    with pytest.raises(Dsv4MetadataError, match="cmp_slot_mapping"):
        dataclasses.replace(c4.host, cmp_slot_mapping=np.full_like(c4.host.cmp_slot_mapping, 5))
    with pytest.raises(Dsv4MetadataError, match="num_cmp_rows"):
        dataclasses.replace(c4, num_cmp_rows=7)
    with pytest.raises(Dsv4MetadataError, match="cmp_loc"):
        dataclasses.replace(c4, device=dataclasses.replace(c4.device, cmp_loc=c4.device.cmp_loc[:3]))
