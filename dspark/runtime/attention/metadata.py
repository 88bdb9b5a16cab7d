"""Attention metadata containers that the generated backend modules fill in from a step's layout.

CPU and CUDA's Triton kernel share the varlen form (`qo_indptr` = `cu_seqlens_q`, per-request KV
lengths, a page table); FlashInfer takes the same rows with its pages in CSR form (`paged_kv_indptr`,
`paged_kv_indices`, `paged_kv_last_page_len`); Ascend uses the TND inputs of
`npu_fused_infer_attention_score`. All are read off the step's ragged rows (`dspark.runtime.layout`),
never a fixed width, so the same containers serve static, cap-accept and compact steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

# The torch attention reads keys in chunks of this many positions, always in the same order, so a
# row's result does not depend on how far other requests' keys go (see torch_paged.py).
KV_CHUNK = 64
# The (query row, query head) pairs of one of its problems: the products' vector lanes, a whole number
# of AVX-512 registers.
PAIR_TILE = 16


def kv_read_bound(kv_lens: Sequence[int]) -> int:
    """Key positions a set of requests must read: their longest KV length, in whole chunks."""
    return max(KV_CHUNK, -(-max(kv_lens, default=1) // KV_CHUNK) * KV_CHUNK)


# A request with more rows than this (a long prefill chunk) runs in slabs of this many rows, each its
# own block reading keys only up to its last row: a block's scores stay bounded, and the early slabs
# of a causal prompt read fewer keys.
SLAB_ROWS = 128


def block_class(rows: int, query_group: int) -> int:
    """The query block a request with `rows` rows joins: the number of the attention's product tiles
    its (row, query head of a KV group) pairs fill, rounded up to a power of two. Padding a request to
    the widest of its class costs no products (the pairs of a one-tile class fill one tile however
    few rows a request has) and at most doubles a wider request's tiles, while every class is one
    more attention call per layer, which on a CPU costs more than a small block's products: a compact
    step's mixed verify lengths must not split into a block per power of two of rows."""
    tiles = -(-rows * query_group // PAIR_TILE)
    return 1 << (tiles - 1).bit_length()


def row_class_bounds(max_rows: int, query_group: int) -> tuple[int, ...]:
    """The most rows of each block class a request of 1..`max_rows` rows can join, in order: (4, 8)
    for 8 rows and 4 query heads per KV head. A step whose requests span two classes runs an attention
    call per class per layer (`AdaptiveVerifyPlan.row_classes`)."""
    return tuple(rows for rows in range(1, max_rows + 1)
                 if rows == max_rows or block_class(rows + 1, query_group) != block_class(rows, query_group))


@dataclass(frozen=True)
class QueryBlock:
    """Requests whose query rows run as one dense `[requests, width]` block of the torch attention,
    with what every layer reads the same way: built once per step, on the host side of it.

    `gather[b, i]` is the row index of the block's request b's i-th query (or `total_rows`, a zero
    row, past its end). The block reads each request's first `kv_bound` key positions, a whole page
    at a time: `pages` lists them request by request. `hidden[b, j, 0, i]` is True where key j is
    past query i's position (every key, for a padding entry).
    """

    gather: torch.Tensor  # int64 [b, width]
    pages: torch.Tensor  # int64 [b * ceil(kv_bound / page_size)]
    hidden: torch.Tensor  # bool [b, kv_bound, 1, width]
    kv_bound: int  # host: key positions read per request, a multiple of KV_CHUNK

    def __post_init__(self) -> None:
        if self.kv_bound <= 0 or self.kv_bound % KV_CHUNK:
            raise ValueError(f"kv_bound must be a positive multiple of KV_CHUNK={KV_CHUNK}, "
                             f"got {self.kv_bound}")

    @property
    def width(self) -> int:
        return self.gather.shape[1]

    @property
    def num_requests(self) -> int:
        return self.gather.shape[0]


@dataclass(frozen=True)
class QueryBlocks:
    """A step's ragged query rows as dense blocks of requests with similar row counts.

    Requests are grouped by `block_class` of their row count, so the attention's work follows the
    rows a step runs (a compact step of two rows per request does half the products of eight rows
    with four query heads per KV head) instead of padding every request to the widest one; a request
    of more than `SLAB_ROWS` rows runs as slabs, one block each. Requests with no rows join no block.
    `scatter[t]` is row t's index in the blocks' `[b * width]` outputs laid end to end.
    """

    blocks: tuple[QueryBlock, ...]
    scatter: torch.Tensor  # int64 [T]

    @staticmethod
    def plan(host_qo_indptr: Sequence[int], host_kv_lens: Sequence[int], positions: torch.Tensor,
             page_table: torch.Tensor, page_size: int, *, query_group: int) -> QueryBlocks:
        """`query_group` is the model's query heads per KV head (a rank's, under tensor parallelism)."""
        device = positions.device
        total = positions.shape[0]
        lens = [end - start for start, end in itertools.pairwise(host_qo_indptr)]
        # Entries (request, first row, rows): a request's rows, or one slab of a long prefill chunk.
        members: dict[tuple[int, ...], list[tuple[int, int, int]]] = {}
        for req, rows in enumerate(lens):
            if rows > SLAB_ROWS:
                for first in range(0, rows, SLAB_ROWS):
                    members[(-1, req, first)] = [(req, first, min(SLAB_ROWS, rows - first))]
            elif rows:
                members.setdefault((block_class(rows, query_group),), []).append((req, 0, rows))
        padded_pos = torch.cat((positions.long(), positions.new_full((1,), -1).long()))
        last_page = page_table.shape[1] - 1
        blocks, scatter, offset = [], [0] * total, 0
        for entries in (members[key] for key in sorted(members)):
            width = max(n for _, _, n in entries)
            gather = [[host_qo_indptr[r] + first + i if i < n else total for i in range(width)]
                      for r, first, n in entries]
            for b, (r, first, n) in enumerate(entries):
                for i in range(n):
                    scatter[host_qo_indptr[r] + first + i] = offset + b * width + i
            offset += len(entries) * width
            gather_t = torch.tensor(gather, dtype=torch.long, device=device)
            # Rows are their request's last positions: an entry needs keys up to its own last row.
            bound = kv_read_bound([host_kv_lens[r] - lens[r] + first + n for r, first, n in entries])
            # A bound past the page table reads its last page again; those keys are masked.
            columns = torch.arange(-(-bound // page_size), device=device).clamp_max(last_page)
            reqs = torch.tensor([r for r, _, _ in entries], device=device)
            pages = page_table[reqs][:, columns].long().flatten()
            key_pos = torch.arange(bound, device=device)[None, :, None, None]
            hidden = key_pos > padded_pos[gather_t][:, None, None]
            blocks.append(QueryBlock(gather=gather_t, pages=pages, hidden=hidden, kv_bound=bound))
        return QueryBlocks(tuple(blocks), torch.tensor(scatter, dtype=torch.long, device=device))


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
    products: the step's query blocks, each with how far its requests read keys."""

    blocks: QueryBlocks | None = None

    def __post_init__(self) -> None:
        if self.blocks is None:
            raise ValueError("TorchPagedMetadata needs the query blocks (QueryBlocks.plan)")


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


@dataclass(frozen=True)
class FlashInferMetadata:
    """The inputs of FlashInfer's paged prefill `plan()` (CSR page arrays) plus the KV write slots.

    FlashInfer plans a step on the host once and every layer's `run()` reuses the plan, so the row
    and page offsets stay on the host; only the page ids the kernel reads live on the device.
    """

    qo_indptr: torch.Tensor  # int32 [B + 1], host: cu_seqlens_q
    paged_kv_indptr: torch.Tensor  # int32 [B + 1], host: request b's pages are indices[indptr[b]:indptr[b+1]]
    paged_kv_indices: torch.Tensor  # int32 [paged_kv_indptr[-1]], device: page ids in position order
    paged_kv_last_page_len: torch.Tensor  # int32 [B], host: entries of each request's last page, 1..page_size
    page_size: int
    positions: torch.Tensor  # int64 [T]
    out_cache_loc: torch.Tensor  # int64 [T]: KV slot each row writes

    def __post_init__(self) -> None:
        num = self.paged_kv_last_page_len.shape[0]
        host = (self.qo_indptr, self.paged_kv_indptr, self.paged_kv_last_page_len)
        if any(t.device.type != "cpu" for t in host):
            raise ValueError("FlashInfer plans on the host: qo_indptr, paged_kv_indptr and "
                             "paged_kv_last_page_len must be CPU tensors")
        if self.qo_indptr.shape != (num + 1,) or self.paged_kv_indptr.shape != (num + 1,):
            raise ValueError(f"qo_indptr and paged_kv_indptr need {num + 1} entries for {num} requests, "
                             f"got {tuple(self.qo_indptr.shape)} and {tuple(self.paged_kv_indptr.shape)}")
        if self.paged_kv_indices.shape != (int(self.paged_kv_indptr[-1]),):
            raise ValueError(f"paged_kv_indices has {self.paged_kv_indices.shape[0]} pages, "
                             f"paged_kv_indptr ends at {int(self.paged_kv_indptr[-1])}")

    @classmethod
    def plan(cls, host_qo_indptr: Sequence[int], host_kv_lens: Sequence[int], page_table: torch.Tensor,
             page_size: int, positions: torch.Tensor, out_cache_loc: torch.Tensor) -> FlashInferMetadata:
        """The CSR page arrays of requests with KV lengths `host_kv_lens` (each at least 1) over their
        page-table rows: request b holds `ceil(kv_b / page_size)` pages, its last one
        `kv_b - (pages_b - 1) * page_size` entries. One host-to-device copy of the gather index."""
        kv = np.asarray(host_kv_lens, dtype=np.int64)
        if kv.size and kv.min() < 1:
            raise ValueError("every request of a FlashInfer plan holds at least one KV entry (a padding "
                             "slot reads the null page)")
        pages = -(-kv // page_size)
        if pages.size and pages.max() > page_table.shape[1]:
            raise ValueError(f"a KV length of {int(kv.max())} needs {int(pages.max())} pages, more than the "
                             f"page table's {page_table.shape[1]}")
        kv_indptr = np.concatenate(([0], np.cumsum(pages)))
        # Row b's first pages_b entries of the flattened page table, in order.
        first = np.repeat(np.arange(kv.size) * page_table.shape[1] - kv_indptr[:-1], pages)
        gather = torch.from_numpy(first + np.arange(kv_indptr[-1]))
        return cls(
            qo_indptr=torch.tensor(host_qo_indptr, dtype=torch.int32),
            paged_kv_indptr=torch.from_numpy(kv_indptr.astype(np.int32)),
            paged_kv_indices=page_table.reshape(-1)[gather.to(page_table.device, non_blocking=True)],
            paged_kv_last_page_len=torch.from_numpy((kv - (pages - 1) * page_size).astype(np.int32)),
            page_size=page_size,
            positions=positions,
            out_cache_loc=out_cache_loc,
        )

    @property
    def num_requests(self) -> int:
        return self.paged_kv_last_page_len.shape[0]

    @property
    def total_rows(self) -> int:
        return self.positions.shape[0]


AttentionMetadata = PagedAttnMetadata | AscendTndMetadata | FlashInferMetadata


class AttentionBackend(Protocol):
    """Writes a layer's new K/V rows into its cache and attends the ragged query rows."""

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor: ...
