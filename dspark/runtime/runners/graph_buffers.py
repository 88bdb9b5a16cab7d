"""Static device buffers holding a verify step's layout, which captured graphs read.

A graph replays fixed device addresses, so every tier's graph is captured reading slices of one set
of buffers sized for the largest tier. Before a replay the step's layout (planned once, outside the
graph) is copied in; inside the graph only the attention metadata is derived from it.
"""

from __future__ import annotations

import torch

from dspark.runtime.layout import VerifyLayout


class StepBuffers:
    def __init__(self, max_slots: int, max_rows: int, pages_per_request: int, num_draft_tokens: int,
                 device: torch.device) -> None:
        def ints(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.num_draft_tokens = num_draft_tokens
        self.input_ids = ints(max_rows, dtype=torch.long)
        self.rows_per_slot = ints(max_slots)
        self.prefix_lens = ints(max_slots)
        self.page_table = ints(max_slots, pages_per_request)
        self.qo_indptr = ints(max_slots + 1)
        self.kv_lens = ints(max_slots)
        self.positions = ints(max_rows, dtype=torch.long)
        self.row_req = ints(max_rows, dtype=torch.long)
        self.out_cache_loc = ints(max_rows, dtype=torch.long)

    def load(self, layout: VerifyLayout, input_ids: torch.Tensor) -> None:
        """Copy a step's layout and input ids in (the padding rows' ids are zero)."""
        slots, tier, rows = layout.num_slots, layout.tier, layout.total_rows
        self.input_ids[:rows].copy_(input_ids)
        self.input_ids[rows:tier].zero_()
        self.rows_per_slot[:slots].copy_(layout.rows_per_slot)
        self.prefix_lens[:slots].copy_(layout.prefix_lens)
        self.page_table[:slots].copy_(layout.page_table)
        self.qo_indptr[: slots + 1].copy_(layout.qo_indptr)
        self.kv_lens[:slots].copy_(layout.kv_lens)
        self.positions[:tier].copy_(layout.positions)
        self.row_req[:tier].copy_(layout.row_req)
        self.out_cache_loc[:tier].copy_(layout.out_cache_loc)

    def view(self, captured: VerifyLayout) -> VerifyLayout:
        """The layout a tier's graph reads: `captured`'s host fields over slices of these buffers."""
        slots, tier = captured.num_slots, captured.tier
        return VerifyLayout(
            verify_lens=captured.verify_lens,
            rows_per_slot=self.rows_per_slot[:slots],
            prefix_lens=self.prefix_lens[:slots],
            page_table=self.page_table[:slots],
            qo_indptr=self.qo_indptr[: slots + 1],
            kv_lens=self.kv_lens[:slots],
            positions=self.positions[:tier],
            row_req=self.row_req[:tier],
            out_cache_loc=self.out_cache_loc[:tier],
            src_index=captured.src_index,
            num_requests=captured.num_requests,
            num_draft_tokens=captured.num_draft_tokens,
            total_rows=captured.total_rows,
            tier=tier,
            packed=captured.packed,
            host_qo_indptr=captured.host_qo_indptr,
            host_kv_lens=captured.host_kv_lens,
            host_slots=captured.host_slots,
        )
