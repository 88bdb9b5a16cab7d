"""The ragged row layout of one verify step: which rows each request puts into the target forward.

`static` and `cap-accept` steps are the full `B x N` block; a `compact` step packs only the
planned rows, `verify_lens = [2, 1, 4]` giving `qo_indptr = [0, 2, 3, 7]`. With graph capture the
step is padded up to a token tier (`graph_num_tokens`); the padding rows belong to padding
requests that own no KV pages (their writes land in the null page), so no real row sees them.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class LayoutError(ValueError):
    """A step that the compiled tier grid or slot count cannot hold (says what to change)."""


def tier_for(num_rows: int, grid: Sequence[int]) -> int:
    """The smallest tier holding `num_rows` rows; an error past the largest."""
    i = bisect.bisect_left(grid, num_rows)
    if i == len(grid):
        raise LayoutError(f"a step of {num_rows} rows exceeds the largest graph tier {grid[-1]}; "
                          "add a larger tier (graph.token_tiers / capture_batch_sizes) or lower "
                          "serving.max_running_requests")
    return grid[i]


@dataclass(frozen=True)
class RaggedVerifyLayout:
    """Rows per request (`verify_lens`), their CSR offsets, and the tier the step replays in.

    `num_real_requests` of the `verify_lens` belong to real requests; any after them are padding
    requests added by `padded`.
    """

    verify_lens: torch.Tensor  # int32 [B]
    qo_indptr: torch.Tensor  # int32 [B + 1] = cu_seqlens_q
    total_rows: int  # rows of the real requests
    graph_num_tokens: int  # rows the step is padded to (total_rows without a grid)
    num_real_requests: int

    @staticmethod
    def from_verify_lens(verify_lens: torch.Tensor, grid: Sequence[int] | None = None) -> RaggedVerifyLayout:
        if verify_lens.dim() != 1 or verify_lens.shape[0] == 0:
            raise LayoutError(f"verify_lens must be a non-empty 1-D tensor, got shape "
                              f"{tuple(verify_lens.shape)}")
        lens = verify_lens.to(torch.int32)
        qo_indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
        torch.cumsum(lens, 0, out=qo_indptr[1:])
        total = int(qo_indptr[-1])  # one host sync per step: the tier choice needs it
        if int(lens.min()) < 1:
            raise LayoutError(f"every request verifies at least its root row, got verify_lens "
                              f"{lens.tolist()}")
        tier = tier_for(total, grid) if grid else total
        return RaggedVerifyLayout(lens, qo_indptr, total, tier, lens.shape[0])

    @property
    def num_requests(self) -> int:
        return self.verify_lens.shape[0]

    @property
    def max_verify_len(self) -> int:
        return int(self.verify_lens.max())

    @property
    def num_padding_rows(self) -> int:
        return self.graph_num_tokens - self.total_rows

    def padded(self, rows_per_padding_request: int, num_slots: int | None = None) -> RaggedVerifyLayout:
        """This layout with the tier's padding rows as padding requests (at most
        `rows_per_padding_request` rows each, so attention widths do not grow), then — when
        `num_slots` is given, as a captured graph's fixed request count needs — empty requests
        up to that count."""
        pad = self.num_padding_rows
        full, rest = divmod(pad, rows_per_padding_request)
        extra = [rows_per_padding_request] * full + ([rest] if rest else [])
        count = self.num_requests + len(extra)
        if num_slots is not None:
            if count > num_slots:
                raise LayoutError(f"{self.num_requests} requests plus {len(extra)} padding requests "
                                  f"exceed the {num_slots} request slots captured for tier "
                                  f"{self.graph_num_tokens}")
            extra += [0] * (num_slots - count)
        if not extra:
            return self
        lens = torch.cat((self.verify_lens, self.verify_lens.new_tensor(extra)))
        tail = torch.cumsum(lens.new_tensor(extra), 0) + self.qo_indptr[-1]
        return RaggedVerifyLayout(lens, torch.cat((self.qo_indptr, tail.to(torch.int32))),
                                  self.total_rows, self.graph_num_tokens, self.num_real_requests)


def tier_aligned_budget(num_reqs: int, budget: int, floor: int, cap: int, grid: Sequence[int]) -> int:
    """Graph-tier alignment ("paid padding reclamation").

    The rows of the chosen budget replay in the smallest tier that holds them; its padding rows
    cost nothing extra, so the budget grows to fill the tier with the next-best candidates:
    `min(G, B * cap) - B * floor`. Allocation still never takes a candidate below survival_eps,
    so the step may stay short of the tier.
    """
    rows = num_reqs * floor + budget
    tier = tier_for(rows, grid)
    return max(budget, min(tier, num_reqs * cap) - num_reqs * floor)


def padding_requests(prefix_lens: torch.Tensor, page_table: torch.Tensor,
                     num_requests: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`prefix_lens` and `page_table` extended to `num_requests` rows by padding requests:
    prefix 0 and an all-null page table (page 0), so whatever they write lands in the null page."""
    extra = num_requests - prefix_lens.shape[0]
    if extra < 0:
        raise LayoutError(f"{prefix_lens.shape[0]} requests do not fit {num_requests} slots")
    if extra == 0:
        return prefix_lens, page_table
    return (torch.cat((prefix_lens, prefix_lens.new_zeros(extra))),
            torch.cat((page_table, page_table.new_zeros(extra, page_table.shape[1]))))
