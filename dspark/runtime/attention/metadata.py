"""Attention metadata containers that the generated backend modules fill in from a step's layout.

CPU and CUDA share the FlashInfer / FlashAttention varlen form (`qo_indptr` = `cu_seqlens_q`,
per-request KV lengths, a page table); Ascend uses the TND inputs of
`npu_fused_infer_attention_score`. Both are read off the step's ragged rows (`dspark.runtime.layout`),
never a fixed width, so the same containers serve static, cap-accept and compact steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from dspark.runtime.models.ops import padded_rows

# Every step's query block (1 row per request when decoding, N when verifying) is padded to the same
# width, so the batched attention products have one shape whatever the step; their row count is
# (query heads per KV head) x width, which the GEMM floor does not need to raise further. Padding the
# block to the larger floor of the row-wise linears would double the CPU attention's work.
QUERY_BLOCK_MIN_ROWS = 8


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
        width = padded_rows(max_rows, QUERY_BLOCK_MIN_ROWS)
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


# The torch attention reads keys in chunks of this many positions, always in the same order, so a
# row's result does not depend on how far other requests' keys go (see torch_paged.py).
KV_CHUNK = 64


def kv_read_bound(kv_lens: Sequence[int]) -> int:
    """Key positions a step must read per request: its longest KV length, in whole chunks."""
    return max(KV_CHUNK, -(-max(kv_lens, default=1) // KV_CHUNK) * KV_CHUNK)


@dataclass(frozen=True)
class PagedAttnMetadata:
    """Varlen paged-attention inputs: FlashInfer's / FlashAttention's form (CUDA's Triton kernel)."""

    qo_indptr: torch.Tensor  # int32 [B + 1]: cu_seqlens_q
    kv_lens: torch.Tensor  # int32 [B]: prefix + new rows (cache_seqlens)
    page_table: torch.Tensor  # int32 [B, pages_per_request]
    positions: torch.Tensor  # int64 [T]
    out_cache_loc: torch.Tensor  # int64 [T]: KV slot each row writes
    max_seqlen_q: int  # host: the most rows one request has (sizes a kernel's grid)

    @property
    def num_requests(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def total_rows(self) -> int:
        return self.positions.shape[0]


@dataclass(frozen=True)
class TorchPagedMetadata(PagedAttnMetadata):
    """The varlen inputs plus what the plain-torch attention needs to run dense, batch-invariant
    products: the padded query blocks and how far to read keys."""

    padding: QueryPadding | None = None
    kv_bound: int = KV_CHUNK  # host: key positions read per request, a multiple of KV_CHUNK

    def __post_init__(self) -> None:
        if self.padding is None:
            raise ValueError("TorchPagedMetadata needs the query padding (QueryPadding.from_indptr)")
        if self.kv_bound % KV_CHUNK:
            raise ValueError(f"kv_bound must be a multiple of KV_CHUNK={KV_CHUNK}, got {self.kv_bound}")


@dataclass(frozen=True)
class AscendTndMetadata:
    """TND inputs of `torch_npu.npu_fused_infer_attention_score` (plus the KV write slots).

    The operator takes its sequence lengths as host lists; the step's layout already has them on the
    host, so attention never reads them back from the device.
    """

    actual_seq_lengths_q: torch.Tensor  # int32 [B]: cumulative query ends, qo_indptr[1:]
    actual_seq_lengths_kv: torch.Tensor  # int32 [B]: per-request KV lengths
    block_table: torch.Tensor  # int32 [B, pages_per_request]
    block_size: int
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    max_seqlen_q: int
    host_seq_lengths_q: tuple[int, ...]  # actual_seq_lengths_q, on the host
    host_seq_lengths_kv: tuple[int, ...]  # actual_seq_lengths_kv, on the host

    @property
    def num_requests(self) -> int:
        return self.actual_seq_lengths_kv.shape[0]

    @property
    def total_rows(self) -> int:
        return self.positions.shape[0]


AttentionMetadata = PagedAttnMetadata | AscendTndMetadata


class AttentionBackend(Protocol):
    """Writes a layer's new K/V rows into its cache and attends the ragged query rows."""

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor: ...
