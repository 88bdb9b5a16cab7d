"""Attention metadata containers that the generated backend modules fill in.

CPU and CUDA share the FlashInfer / FlashAttention varlen form (`qo_indptr` = `cu_seqlens_q`,
per-request KV lengths, a page table); Ascend uses the TND inputs of
`npu_fused_infer_attention_score`. Both are built from the ragged rows of a step, never from a
fixed width, so the same containers serve static, cap-accept and compact steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.runtime.models.ops import padded_rows


@dataclass(frozen=True)
class QueryPadding:
    """How ragged query rows map onto a dense `[B, rows_padded]` block.

    `gather[b, i]` is the row index of request b's i-th query (or `total_rows`, a zero row, past
    its end); `scatter[t]` is row t's flat index in the dense block; `positions[b, i]` is the
    query's position (-1 for padding). Precomputing these keeps the attention free of host
    synchronisation, so it can run inside a captured graph.
    """

    gather: torch.Tensor
    scatter: torch.Tensor
    positions: torch.Tensor

    @staticmethod
    def from_indptr(qo_indptr: torch.Tensor, positions: torch.Tensor, max_rows: int) -> QueryPadding:
        num_reqs = qo_indptr.shape[0] - 1
        total = positions.shape[0]
        width = padded_rows(max_rows)
        starts = qo_indptr[:-1].long()
        lens = (qo_indptr[1:] - qo_indptr[:-1]).long()
        col = torch.arange(width, device=positions.device)
        valid = col[None, :] < lens[:, None]
        past_end = torch.full_like(valid, total, dtype=torch.long)
        gather = torch.where(valid, starts[:, None] + col[None, :], past_end)
        req = torch.repeat_interleave(torch.arange(num_reqs, device=positions.device), lens,
                                      output_size=total)
        scatter = req * width + (torch.arange(total, device=positions.device) - starts[req])
        padded_pos = torch.cat((positions.long(), positions.new_full((1,), -1).long()))[gather]
        return QueryPadding(gather, scatter, padded_pos)


@dataclass(frozen=True)
class PagedAttnMetadata:
    """Varlen paged-attention inputs (CPU and CUDA)."""

    qo_indptr: torch.Tensor  # int32 [B + 1]: cu_seqlens_q
    kv_lens: torch.Tensor  # int32 [B]: prefix + new rows (cache_seqlens)
    page_table: torch.Tensor  # int32 [B, pages_per_request]
    positions: torch.Tensor  # int64 [T]
    out_cache_loc: torch.Tensor  # int64 [T]: KV slot each row writes
    max_seqlen_q: int
    padding: QueryPadding

    @property
    def num_requests(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def total_rows(self) -> int:
        return self.positions.shape[0]


@dataclass(frozen=True)
class AscendTndMetadata:
    """TND inputs of `torch_npu.npu_fused_infer_attention_score` (plus the KV write slots)."""

    actual_seq_lengths_q: torch.Tensor  # int64 [B]: cumulative query ends
    actual_seq_lengths_kv: torch.Tensor  # int64 [B]: per-request KV lengths
    block_table: torch.Tensor  # int32 [B, pages_per_request]
    block_size: int
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    max_seqlen_q: int

    @property
    def num_requests(self) -> int:
        return self.actual_seq_lengths_kv.shape[0]

    @property
    def total_rows(self) -> int:
        return self.positions.shape[0]


def cache_slots(page_table: torch.Tensor, row_req: torch.Tensor, positions: torch.Tensor,
                page_size: int) -> torch.Tensor:
    """Flat KV slot of each row: its request's page for the position, times page size, plus offset."""
    pages = page_table[row_req, positions // page_size].long()
    return pages * page_size + positions % page_size


def prefix_slots(page_table: torch.Tensor, page_size: int, length: int) -> torch.Tensor:
    """`[B, length]` flat KV slots of positions `0 … length-1` of every request."""
    offs = torch.arange(length, device=page_table.device)
    return page_table[:, offs // page_size].long() * page_size + offs % page_size


def ragged_rows(prefix_lens: torch.Tensor, extend_lens: torch.Tensor, ends: torch.Tensor,
                total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request index and absolute position of every packed row.

    Requests own consecutive rows ending at `ends` (cumulative); request r's rows continue its
    cached prefix, so their positions are `prefix_lens[r], prefix_lens[r] + 1, ...`.
    """
    device = prefix_lens.device
    row_req = torch.repeat_interleave(torch.arange(prefix_lens.shape[0], device=device),
                                      extend_lens.long(), output_size=total)
    starts = (ends - extend_lens.long())[row_req]
    positions = prefix_lens.long()[row_req] + torch.arange(total, device=device) - starts
    return row_req, positions
