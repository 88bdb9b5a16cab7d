"""RaggedVerifyLayout: CSR offsets, tiers, padding requests, and graph-tier alignment."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.runtime.layout import (
    LayoutError,
    RaggedVerifyLayout,
    padding_requests,
    tier_aligned_budget,
    tier_for,
)


def lens(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_worked_example_packs_seven_rows() -> None:
    layout = RaggedVerifyLayout.from_verify_lens(lens(2, 1, 4))
    assert layout.qo_indptr.tolist() == [0, 2, 3, 7]
    assert layout.total_rows == 7 and layout.graph_num_tokens == 7
    assert layout.num_padding_rows == 0 and layout.max_verify_len == 4


def test_tier_rounds_up_and_errors_past_the_largest() -> None:
    layout = RaggedVerifyLayout.from_verify_lens(lens(2, 1, 4), grid=[4, 8, 16])
    assert layout.graph_num_tokens == 8 and layout.num_padding_rows == 1
    assert RaggedVerifyLayout.from_verify_lens(lens(4, 4), grid=[4, 8]).graph_num_tokens == 8
    with pytest.raises(LayoutError, match="exceeds the largest graph tier 8"):
        RaggedVerifyLayout.from_verify_lens(lens(5, 4), grid=[4, 8])


def test_rejects_empty_and_zero_lengths() -> None:
    with pytest.raises(LayoutError, match="non-empty"):
        RaggedVerifyLayout.from_verify_lens(lens())
    with pytest.raises(LayoutError, match="at least its root"):
        RaggedVerifyLayout.from_verify_lens(lens(2, 0))


def test_padding_requests_carry_the_tier_rows_then_empty_slots() -> None:
    layout = RaggedVerifyLayout.from_verify_lens(lens(2, 1, 4), grid=[24])
    padded = layout.padded(rows_per_padding_request=8, num_slots=7)
    assert padded.verify_lens.tolist() == [2, 1, 4, 8, 8, 1, 0]
    assert padded.qo_indptr.tolist() == [0, 2, 3, 7, 15, 23, 24, 24]
    assert padded.total_rows == 7 and padded.graph_num_tokens == 24 and padded.num_real_requests == 3
    with pytest.raises(LayoutError, match="exceed the 5 request slots"):
        layout.padded(rows_per_padding_request=8, num_slots=5)
    assert RaggedVerifyLayout.from_verify_lens(lens(3, 5)).padded(8).verify_lens.tolist() == [3, 5]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=12), st.integers(0, 40), st.integers(1, 8))
def test_padded_layout_is_consistent(values: list[int], slack: int, width: int) -> None:
    total = sum(values)
    layout = RaggedVerifyLayout.from_verify_lens(lens(*values), grid=[total + slack])
    padded = layout.padded(width)
    got = padded.verify_lens.tolist()
    assert got[: len(values)] == values
    assert all(0 < x <= width for x in got[len(values):])
    assert sum(got) == total + slack == int(padded.qo_indptr[-1])
    assert torch.equal(padded.qo_indptr[1:], torch.cumsum(padded.verify_lens, 0).to(torch.int32))


def test_padding_requests_own_only_the_null_page() -> None:
    prefix, table = padding_requests(torch.tensor([5, 9], dtype=torch.int32),
                                     torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), 4)
    assert prefix.tolist() == [5, 9, 0, 0]
    assert table.tolist() == [[1, 2], [3, 4], [0, 0], [0, 0]]
    with pytest.raises(LayoutError):
        padding_requests(prefix, table, 3)


def test_tier_alignment_fills_the_paid_tier() -> None:
    # B=10, floor 1: 10 + 27 = 37 rows replay in the 64-row tier, so its 27 padding rows are free.
    assert tier_aligned_budget(10, 27, floor=1, cap=8, grid=[16, 32, 64, 128]) == 54
    # ... but never past every request's cap: B=5 holds at most 5 * 8 = 40 rows.
    assert tier_aligned_budget(5, 32, floor=1, cap=8, grid=[16, 32, 64, 128]) == 35
    assert tier_aligned_budget(5, 20, floor=1, cap=5, grid=[16, 32, 64]) == 20  # 25 rows: B*cap
    assert tier_aligned_budget(2, 3, floor=2, cap=8, grid=[8, 16]) == 4  # 7 rows -> tier 8
    assert tier_for(9, [8, 16]) == 16
