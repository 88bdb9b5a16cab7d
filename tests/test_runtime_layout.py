"""Step layouts: CSR offsets, positions and write slots, tiers, padding requests, empty slots, and
the pack/scatter indices between the packed rows and the fixed stride."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.runtime.layout import LayoutError, StepShape, plan_extend, plan_verify, tier_for
from dspark.runtime.planner.budget import tier_aligned_budget

CPU = torch.device("cpu")
PAGE = 4
N = 4
TABLE = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]], dtype=torch.int32)


def shape(tiers: tuple[int, ...] = (), padding_rows: int = N, slots=None) -> StepShape:
    return StepShape(page_size=PAGE, num_draft_tokens=N, tiers=tiers,
                     padding_request_rows=padding_rows if tiers else 0, slots_for_tier=slots)


def test_worked_example_packs_seven_rows() -> None:
    layout = plan_verify((2, 1, 4), (2, 1, 4), [5, 0, 9], TABLE, shape(), CPU)
    assert layout.qo_indptr.tolist() == [0, 2, 3, 7] and layout.host_qo_indptr == (0, 2, 3, 7)
    assert layout.total_rows == 7 and layout.tier == 7 and layout.num_padding_rows == 0
    assert layout.positions.tolist() == [5, 6, 0, 9, 10, 11, 12]
    assert layout.kv_lens.tolist() == [7, 1, 13] and layout.host_kv_lens == (7, 1, 13)
    # position 9 of request 2 is in its third page (id 11), offset 1
    assert layout.out_cache_loc.tolist()[3] == 11 * PAGE + 1
    assert layout.src_index.tolist() == [0, 1, 4, 8, 9, 10, 11] and layout.packed


def test_a_full_block_is_not_packed_and_pack_is_the_identity() -> None:
    layout = plan_verify((N, N), (2, N), [3, 0], TABLE[:2], shape(), CPU)
    assert not layout.packed and layout.verify_lens.tolist() == [2, N]  # cap-accept: caps, all rows run
    ids = torch.arange(2 * N)
    assert layout.pack(ids) is ids and layout.unpack(ids) is ids


def test_pack_and_unpack_move_rows_between_orders() -> None:
    layout = plan_verify((2, 1, 3), (2, 1, 3), [0, 0, 0], TABLE, shape(), CPU)
    fixed = torch.arange(3 * N) * 10
    packed = layout.pack(fixed)
    assert packed.tolist() == [0, 10, 40, 80, 90, 100]
    back = layout.unpack(packed, fill=-1).tolist()
    assert back == [0, 10, -1, -1, 40, -1, -1, -1, 80, 90, 100, -1]


def test_tier_rounds_up_with_padding_requests_on_the_null_page() -> None:
    layout = plan_verify((2, 1, 4), (2, 1, 4), [5, 0, 9], TABLE, shape(tiers=(4, 12, 16)), CPU)
    assert layout.tier == 12 and layout.num_padding_rows == 5 and layout.num_slots == 5
    assert layout.rows_per_slot.tolist() == [2, 1, 4, N, 1]
    assert layout.qo_indptr.tolist() == [0, 2, 3, 7, 11, 12]
    assert layout.prefix_lens.tolist() == [5, 0, 9, 0, 0]
    assert layout.page_table[3:].eq(0).all()  # the padding requests write only the null page
    assert layout.out_cache_loc[7:].tolist() == [0, 1, 2, 3, 0]
    assert layout.src_index.numel() == 7  # padding rows are never packed or unpacked
    with pytest.raises(LayoutError, match="exceeds the largest graph tier 16"):
        plan_verify((4, 4, 4, 4, 4), (4,) * 5, [0] * 5, torch.zeros(5, 4, dtype=torch.int32),
                    shape(tiers=(4, 12, 16)), CPU)


def test_fixed_slot_graphs_get_empty_slots_with_a_kv_length_of_one() -> None:
    layout = plan_verify((2, 1), (2, 1), [3, 0], TABLE[:2], shape(tiers=(8,), slots=lambda tier: 5), CPU)
    assert layout.rows_per_slot.tolist() == [2, 1, N, 1, 0]
    assert layout.kv_lens.tolist() == [5, 1, N, 1, 1]
    with pytest.raises(LayoutError, match="exceed the 3 request slots"):
        plan_verify((2, 1), (2, 1), [3, 0], TABLE[:2], shape(tiers=(8,), slots=lambda tier: 3), CPU)


def test_a_forced_tier_lays_out_padding_only() -> None:
    empty = torch.zeros(0, 4, dtype=torch.int32)
    layout = plan_verify((), (), [], empty, shape(tiers=(8, 16), slots=lambda tier: tier // N + 1), CPU,
                         tier=16)
    assert layout.num_requests == 0 and layout.total_rows == 0 and layout.tier == 16
    assert layout.rows_per_slot.tolist() == [N, N, N, N, 0]
    # a shape without padding requests cannot be forced to a larger tier (it used to give 0-row padding)
    with pytest.raises(LayoutError, match="padding_request_rows 0"):
        plan_verify((2,), (2,), [3], torch.zeros(1, 4, dtype=torch.int32), shape(padding_rows=0), CPU, tier=8)


def test_bad_lengths_are_refused() -> None:
    with pytest.raises(LayoutError, match="1..N=4 rows"):
        plan_verify((2, 0), (2, 0), [0, 0], TABLE[:2], shape(), CPU)
    with pytest.raises(LayoutError, match="at most the rows it runs"):
        plan_verify((2, 1), (3, 1), [0, 0], TABLE[:2], shape(), CPU)
    with pytest.raises(LayoutError, match="one run length"):
        plan_verify((2, 1), (2, 1), [0], TABLE[:2], shape(), CPU)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, N), min_size=1, max_size=3), st.integers(0, 9), st.integers(1, N))
def test_padded_layout_is_consistent(run_lens: list[int], slack: int, width: int) -> None:
    total = sum(run_lens)
    tier = total + slack
    layout = plan_verify(tuple(run_lens), tuple(run_lens), [1] * len(run_lens), TABLE[: len(run_lens)],
                         shape(tiers=(tier,), padding_rows=width), CPU)
    got = layout.rows_per_slot.tolist()
    assert got[: len(run_lens)] == run_lens
    assert all(0 < x <= width for x in got[len(run_lens):])
    assert sum(got) == tier == int(layout.qo_indptr[-1]) == layout.positions.numel()
    assert layout.host_qo_indptr == tuple(layout.qo_indptr.tolist())


def test_extend_layout_is_ragged() -> None:
    layout = plan_extend([0, 3, 9], [4, 1, 2], TABLE, PAGE, CPU)
    assert layout.qo_indptr.tolist() == [0, 4, 5, 7] and layout.num_rows == 7 and layout.max_rows == 4
    assert layout.positions.tolist() == [0, 1, 2, 3, 3, 9, 10]
    assert layout.row_req.tolist() == [0, 0, 0, 0, 1, 2, 2]
    assert layout.kv_lens.tolist() == [4, 4, 11]
    assert layout.out_cache_loc.tolist()[-2:] == [11 * PAGE + 1, 11 * PAGE + 2]
    with pytest.raises(LayoutError, match="at least one row"):
        plan_extend([0], [0], TABLE[:1], PAGE, CPU)


def test_an_extend_step_pads_with_a_request_on_the_null_page() -> None:
    # DP attention: this DP rank runs 5 rows where another runs 8, or none at all
    layout = plan_extend([0, 3], [4, 1], TABLE[:2], PAGE, CPU, slots=[2, 0], padding_rows=3)
    assert layout.num_rows == 8 and layout.num_real_rows == 5 and layout.num_padding_rows == 3
    assert layout.qo_indptr.tolist() == [0, 4, 5, 8] and layout.kv_lens.tolist() == [4, 4, 3]
    assert layout.positions.tolist()[5:] == [0, 1, 2] and layout.out_cache_loc.tolist()[5:] == [0, 1, 2]
    assert layout.page_table[2].tolist() == [0, 0, 0, 0] and layout.host_slots == (2, 0)
    idle = plan_extend([], [], TABLE[:0], PAGE, CPU, slots=[], padding_rows=2)
    assert idle.num_rows == 2 and idle.num_real_rows == 0 and idle.out_cache_loc.tolist() == [0, 1]
    with pytest.raises(LayoutError, match="one prefix length"):
        plan_extend([], [], TABLE[:0], PAGE, CPU)


def test_an_idle_verify_step_is_padding_requests_of_the_global_tier() -> None:
    idle = plan_verify((), (), [], TABLE[:0], shape(tiers=(8, 16)), CPU, tier=16, slots=[])
    assert idle.num_requests == 0 and idle.total_rows == 0 and idle.tier == 16
    assert idle.rows_per_slot.tolist() == [N] * 4 and idle.out_cache_loc.lt(PAGE).all()


def test_tier_alignment_fills_the_paid_tier() -> None:
    # B=10, floor 1: 10 + 27 = 37 rows replay in the 64-row tier, so its 27 padding rows are free.
    assert tier_aligned_budget(10, 27, floor=1, cap=8, tiers=[16, 32, 64, 128]) == 54
    # ... but never past every request's cap: B=5 holds at most 5 * 8 = 40 rows.
    assert tier_aligned_budget(5, 32, floor=1, cap=8, tiers=[16, 32, 64, 128]) == 35
    assert tier_aligned_budget(5, 20, floor=1, cap=5, tiers=[16, 32, 64]) == 20  # 25 rows: B*cap
    assert tier_aligned_budget(2, 3, floor=2, cap=8, tiers=[8, 16]) == 4  # 7 rows -> tier 8
    assert tier_for(9, [8, 16]) == 16
