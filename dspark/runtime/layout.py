"""The layout of one forward pass, planned once per step and read by everything that runs it.

An extend step (prefill chunk, target-only decode) appends `extend_lens[r]` rows after request r's
cached prefix; under DP attention a padding request after them brings the step to the rows every DP rank
runs. A verify step runs, for request r, its root and first drafts: `run_lens[r]` rows
(compact: the planned `verify_len`; static and cap-accept: all N), packed back to back, so
`qo_indptr = [0, cumsum(run_lens)]`. With graph tiers a verify step is padded up to the smallest
tier that holds it: the padding rows belong to padding requests (prefix 0, an all-null page table,
so their K/V writes land in the null page no real request reads) and, where a captured graph holds
a fixed number of request slots, to empty slots after them (docs/architecture.md, "A decode step").

A layout is planned once per step (FlashInfer's plan/run split): the small per-request arithmetic
on the host (numpy), from values the host already has, then one host-to-device copy and one kernel
for the per-row arrays; when the device is the host itself, numpy lays out the rows as well, as that
kernel would be a dozen torch dispatches on a few hundred values. The engine (pack/scatter indices,
draft-context rows), the verify runner (tier, static graph buffers) and the generated metadata
builder (qo_indptr, KV lengths, write slots) all read the same object; nothing is built twice and
nothing here waits on the device.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark.runtime.kernels import build_verify_rows, pack_rows, scatter_rows


class LayoutError(ValueError):
    """A step that the compiled tier grid or slot count cannot hold (says what to change)."""


def tier_for(num_rows: int, tiers: Sequence[int]) -> int:
    """The smallest tier holding `num_rows` rows; an error past the largest."""
    i = bisect.bisect_left(tiers, num_rows)
    if i == len(tiers):
        raise LayoutError(f"a step of {num_rows} rows exceeds the largest graph tier {tiers[-1]}; "
                          "add a larger tier (graph.token_tiers / capture_batch_sizes) or lower "
                          "serving.max_running_requests")
    return tiers[i]


def cache_slots(page_table: torch.Tensor, row_req: torch.Tensor, positions: torch.Tensor,
                page_size: int) -> torch.Tensor:
    """Flat KV slot of each row: its request's page for the position, times page size, plus offset."""
    pages = page_table[row_req, positions // page_size].long()
    return pages * page_size + positions % page_size


def prefix_slots(page_table: torch.Tensor, page_size: int, length: int) -> torch.Tensor:
    """`[B, length]` flat KV slots of positions `0 … length-1` of every request."""
    offs = torch.arange(length, device=page_table.device)
    return page_table[:, offs // page_size].long() * page_size + offs % page_size


@dataclass(frozen=True)
class StepShape:
    """How a verify runner lays out its steps: its graph tiers and how it pads a step up to one.

    `padding_request_rows` bounds the rows of one padding request (the attention's widest query
    block stays the widest real one); `slots_for_tier(tier)`, when a captured graph holds a fixed
    number of request slots, is that number, and the layout fills it with empty slots.
    """

    page_size: int
    num_draft_tokens: int  # N: rows of a full request, and the stride of the fixed-stride block
    tiers: tuple[int, ...] = ()
    padding_request_rows: int = 0
    slots_for_tier: Callable[[int], int] | None = None

    def __post_init__(self) -> None:
        if self.tiers and not 1 <= self.padding_request_rows <= self.num_draft_tokens:
            raise LayoutError(f"padding_request_rows must be in [1, N={self.num_draft_tokens}] when a "
                              f"step is padded to tiers, got {self.padding_request_rows}")


@dataclass(frozen=True)
class ExtendLayout:
    """Rows appended after each request's cached prefix; device tensors unless named `host_`."""

    qo_indptr: torch.Tensor  # int32 [B + 1]: cu_seqlens_q
    kv_lens: torch.Tensor  # int32 [B]: prefix + new rows
    page_table: torch.Tensor  # int32 [B, pages_per_request]
    positions: torch.Tensor  # int64 [T]
    row_req: torch.Tensor  # int64 [T]: request of each row
    out_cache_loc: torch.Tensor  # int64 [T]: KV slot each row writes
    host_qo_indptr: tuple[int, ...]
    host_kv_lens: tuple[int, ...]
    host_slots: tuple[int, ...]  # each real request's slot in the runtime's pool (what per-slot caches index)
    max_rows: int  # widest request, for max_seqlen_q
    num_padding_rows: int = 0  # rows of the padding request after the real ones (prefix 0, null page)

    @property
    def num_rows(self) -> int:
        return self.host_qo_indptr[-1]

    @property
    def num_real_rows(self) -> int:
        return self.num_rows - self.num_padding_rows


def _slots(slots: Sequence[int] | None, num_reqs: int) -> tuple[int, ...]:
    if slots is None:
        return tuple(range(num_reqs))
    if len(slots) != num_reqs:
        raise LayoutError(f"a step needs one slot per request, got {len(slots)} for {num_reqs}")
    return tuple(slots)


def plan_extend(prefix_lens: Sequence[int], extend_lens: Sequence[int], page_table: torch.Tensor,
                page_size: int, device: torch.device, slots: Sequence[int] | None = None,
                padding_rows: int = 0) -> ExtendLayout:
    """The layout of an extend step; `page_table` is the requests' host page table `[B, P]`, `slots`
    their slots in the runtime's pool (default 0 .. B-1, for a caller without a pool). `padding_rows`
    adds a padding request of that many rows after them: prefix 0 and an all-null page table, so its
    K/V writes land in the null page no real request reads (a DP rank with fewer rows than another's,
    or none: every DP rank runs the same rows)."""
    if len(prefix_lens) != len(extend_lens) or len(extend_lens) != page_table.shape[0] or not (
            extend_lens or padding_rows):
        raise LayoutError(f"an extend step needs one prefix length, extend length and page-table row "
                          f"per request, got {len(prefix_lens)}, {len(extend_lens)} and "
                          f"{page_table.shape[0]}")
    if extend_lens and min(extend_lens) < 1 or padding_rows < 0:
        raise LayoutError(f"every request of an extend step appends at least one row, got "
                          f"{list(extend_lens)} and {padding_rows} padding rows")
    host_slots = _slots(slots, len(extend_lens))
    if padding_rows:
        prefix_lens, extend_lens = (*prefix_lens, 0), (*extend_lens, padding_rows)
        page_table = torch.cat((page_table, page_table.new_zeros(1, page_table.shape[1])))
    qo = tuple(itertools.accumulate(extend_lens, initial=0))
    kv = tuple(p + e for p, e in zip(prefix_lens, extend_lens, strict=True))
    # The rows are laid out on the host (a prefill chunk's arithmetic is tiny next to its forward).
    host = torch.device("cpu")
    row_req = torch.repeat_interleave(torch.arange(len(extend_lens), device=host),
                                      torch.tensor(extend_lens, dtype=torch.long, device=host))
    starts = torch.tensor(qo[:-1], dtype=torch.long, device=host)[row_req]
    positions = (torch.tensor(prefix_lens, dtype=torch.long, device=host)[row_req]
                 + torch.arange(qo[-1], device=host) - starts)
    out_cache_loc = cache_slots(page_table.cpu(), row_req, positions, page_size)
    return ExtendLayout(
        qo_indptr=torch.tensor(qo, dtype=torch.int32, device=host).to(device),
        kv_lens=torch.tensor(kv, dtype=torch.int32, device=host).to(device),
        page_table=page_table.to(device),
        positions=positions.to(device),
        row_req=row_req.to(device),
        out_cache_loc=out_cache_loc.to(device),
        host_qo_indptr=qo,
        host_kv_lens=kv,
        host_slots=host_slots,
        max_rows=max(extend_lens),
        num_padding_rows=padding_rows,
    )


@dataclass(frozen=True)
class VerifyLayout:
    """The rows of one verify step, for its `num_requests` real requests and the padding after them.

    Slots `0 … num_requests-1` are the real requests in batch order; the rest are padding requests
    and empty slots. Device tensors unless named `host_`.
    """

    verify_lens: torch.Tensor  # int32 [B]: the plan's verify_lens (root included), which cap acceptance
    rows_per_slot: torch.Tensor  # int32 [S]: rows each slot runs
    prefix_lens: torch.Tensor  # int32 [S]: cached positions before the slot's rows (0 for padding)
    page_table: torch.Tensor  # int32 [S, pages_per_request]; padding slots point at the null page
    qo_indptr: torch.Tensor  # int32 [S + 1]: cu_seqlens_q
    kv_lens: torch.Tensor  # int32 [S]: prefix + rows, at least 1 (a padding slot reads the null page)
    positions: torch.Tensor  # int64 [tier]
    row_req: torch.Tensor  # int64 [tier]: slot of each row
    out_cache_loc: torch.Tensor  # int64 [tier]: KV slot each row writes
    src_index: torch.Tensor  # int64 [total_rows]: each real row's index r * N + k in the fixed-stride block
    num_requests: int
    num_draft_tokens: int
    total_rows: int  # rows of the real requests
    tier: int  # rows the step runs (total_rows without tiers)
    packed: bool  # whether some request runs fewer than N rows, so rows move between the two orders
    host_qo_indptr: tuple[int, ...]
    host_kv_lens: tuple[int, ...]
    host_slots: tuple[int, ...]  # [num_requests]: each real request's slot in the runtime's pool

    @property
    def num_slots(self) -> int:
        return self.rows_per_slot.shape[0]

    @property
    def num_padding_rows(self) -> int:
        return self.tier - self.total_rows

    def pack(self, fixed: torch.Tensor) -> torch.Tensor:
        """The rows this step runs, in packed order, from a fixed-stride `[B * N, ...]` tensor."""
        return pack_rows(fixed, self.src_index) if self.packed else fixed

    def unpack(self, rows: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Packed outputs of the real rows back to the fixed stride; rows not run are `fill`."""
        if not self.packed:
            return rows
        return scatter_rows(rows, self.src_index, self.num_requests * self.num_draft_tokens, fill=fill)


def _padded_slots(run_lens: np.ndarray, shape: StepShape, tier: int) -> np.ndarray:
    """`run_lens` followed by the padding requests that carry the tier's unused rows and the empty
    slots a fixed-slot graph needs."""
    unused = tier - int(run_lens.sum())
    if unused and shape.padding_request_rows < 1:
        raise LayoutError(f"tier {tier} leaves {unused} rows to padding requests, but this step shape has "
                          "none (padding_request_rows 0); give it padding_request_rows in [1, N]")
    full, rest = divmod(unused, shape.padding_request_rows or 1)
    count = run_lens.size + full + (1 if rest else 0)
    slots = count
    if shape.slots_for_tier is not None:
        slots = shape.slots_for_tier(tier)
        if count > slots:
            raise LayoutError(f"{run_lens.size} requests plus {count - run_lens.size} padding requests "
                              f"exceed the {slots} request slots captured for tier {tier}")
    lens = np.zeros(max(slots, count), np.int64)
    lens[: run_lens.size] = run_lens
    lens[run_lens.size : run_lens.size + full] = shape.padding_request_rows
    if rest:
        lens[run_lens.size + full] = rest
    return lens


def _host_rows(lens: np.ndarray, ends: np.ndarray, prefix: np.ndarray, table: np.ndarray, page_size: int,
               num_rows: int, num_draft_tokens: int) -> tuple[np.ndarray, ...]:
    """`build_verify_rows` computed with numpy (`ends` = cumsum(lens)), for a step whose device is the
    host: a dozen numpy calls on a few hundred rows cost a fraction of the same dozen torch
    dispatches."""
    qo_indptr = np.zeros(lens.size + 1, np.int32)
    qo_indptr[1:] = ends
    row_req = np.repeat(np.arange(lens.size), lens)
    offset = np.arange(num_rows) - (ends - lens)[row_req]
    positions = prefix[row_req] + offset
    pages = table[row_req, positions // page_size].astype(np.int64)
    out_cache_loc = pages * page_size + positions % page_size
    return qo_indptr, row_req, positions, out_cache_loc, row_req * num_draft_tokens + offset


def plan_verify(run_lens: Sequence[int], verify_lens: Sequence[int], prefix_lens: Sequence[int],
                page_table: torch.Tensor, shape: StepShape, device: torch.device,
                tier: int | None = None, slots: Sequence[int] | None = None) -> VerifyLayout:
    """The layout of a verify step.

    `run_lens` are the rows each request runs, `verify_lens` the plan's (they differ in cap-accept),
    `prefix_lens` the cached positions, `page_table` the requests' host page table `[B, P]`, `slots`
    their slots in the runtime's pool (default 0 .. B-1, for a caller without a pool). `tier`
    forces the tier (graph capture lays out a step of padding only); by default it is the smallest
    of `shape.tiers` that holds the rows, or the row count without tiers.
    """
    num_reqs, n = len(run_lens), shape.num_draft_tokens
    if not (len(verify_lens) == len(prefix_lens) == page_table.shape[0] == num_reqs):
        raise LayoutError(f"a verify step needs one run length, verify_len, prefix length and page-table "
                          f"row per request, got {num_reqs}, {len(verify_lens)}, {len(prefix_lens)} and "
                          f"{page_table.shape[0]}")
    # The per-request arithmetic in numpy: a step's B values cost one conversion each, not a Python
    # loop per check and a list per tensor.
    run = np.fromiter(run_lens, np.int64, num_reqs)
    verify = np.fromiter(verify_lens, np.int64, num_reqs)
    if num_reqs and (run.min() < 1 or run.max() > n or verify.min() < 1 or (verify > run).any()):
        raise LayoutError(f"every request runs 1..N={n} rows and verifies at most the rows it runs, got "
                          f"run_lens {list(run_lens)} and verify_lens {list(verify_lens)}")
    total = int(run.sum())
    if tier is None:
        tier = tier_for(total, shape.tiers) if shape.tiers else total
    elif tier < total:
        raise LayoutError(f"a step of {total} rows does not fit tier {tier}")
    lens = _padded_slots(run, shape, tier) if tier > total or shape.slots_for_tier else run
    num_slots = lens.size
    prefix = np.zeros(num_slots, np.int64)
    prefix[:num_reqs] = np.fromiter(prefix_lens, np.int64, num_reqs)
    kv = np.maximum(prefix + lens, 1)
    ends = np.cumsum(lens)
    # One host-to-device copy of every per-slot value.
    host = torch.from_numpy(np.concatenate((lens, prefix, kv, verify)).astype(np.int32))
    lens_d, prefix_d, kv_d, verify_d = host.to(device).split([num_slots] * 3 + [num_reqs])
    table = page_table
    if num_slots > num_reqs:
        table = torch.cat((page_table, page_table.new_zeros(num_slots - num_reqs, page_table.shape[1])))
    table = table.to(device)
    if device.type == "cpu" and table.device.type == "cpu" and (ends[-1] if num_slots else 0) == tier:
        qo_indptr, row_req, positions, out_cache_loc, src_index = (torch.from_numpy(a) for a in _host_rows(
            lens, ends, prefix, table.numpy(), shape.page_size, tier, n))
    else:
        rows = build_verify_rows(lens_d, prefix_d, table, shape.page_size, tier, num_draft_tokens=n)
        qo_indptr, row_req, positions, out_cache_loc, src_index = (
            rows.qo_indptr, rows.row_req, rows.positions, rows.out_cache_loc, rows.src_index)
    return VerifyLayout(
        verify_lens=verify_d,
        rows_per_slot=lens_d,
        prefix_lens=prefix_d,
        page_table=table,
        qo_indptr=qo_indptr,
        kv_lens=kv_d,
        positions=positions,
        row_req=row_req,
        out_cache_loc=out_cache_loc,
        src_index=src_index[:total],
        num_requests=num_reqs,
        num_draft_tokens=n,
        total_rows=total,
        tier=tier,
        packed=total < num_reqs * n,
        host_qo_indptr=(0, *ends.tolist()),
        host_kv_lens=tuple(kv.tolist()),
        host_slots=_slots(slots, num_reqs),
    )
