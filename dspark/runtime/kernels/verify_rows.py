"""Ragged layout of a verify step: which packed row belongs to which request, position and KV slot.

Request r verifies `verify_lens[r]` rows (its root plus the first drafts). The step packs them
back to back (`qo_indptr` = `cu_seqlens_q`), while drafting and acceptance keep the fixed stride
`N = num_draft_tokens` rows per request; `src_index` links the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.runtime.kernels.dispatch import Impl, jit, next_pow2, tl, use_triton


@dataclass(frozen=True)
class VerifyRows:
    qo_indptr: torch.Tensor  # int32 [B + 1]: 0, then the cumulative verify_lens
    row_req: torch.Tensor  # int64 [T]: request of each packed row
    positions: torch.Tensor  # int64 [T]: prefix_lens[r] + offset within the request
    out_cache_loc: torch.Tensor  # int64 [T]: flat KV slot the row writes
    src_index: torch.Tensor  # int64 [T]: r * N + offset, the row's slot in the fixed-stride block

    @property
    def total_rows(self) -> int:
        return self.row_req.shape[0]


def build_verify_rows(verify_lens: torch.Tensor, prefix_lens: torch.Tensor, page_table: torch.Tensor,
                      page_size: int, total_rows: int, *, num_draft_tokens: int,
                      impl: Impl = "auto") -> VerifyRows:
    """Lay out the packed rows of a verify step without reading any tensor on the host.

    `total_rows` must equal `sum(verify_lens)` and `verify_lens` must lie in `[1, num_draft_tokens]`;
    the caller knows both on the host (the planner chose them), and checking them here would cost
    a device sync and break graph capture. Rows past `total_rows` are never written.
    """
    _check_inputs(verify_lens, prefix_lens, page_table, page_size, total_rows, num_draft_tokens)
    if use_triton(impl, verify_lens, prefix_lens, page_table):
        return build_verify_rows_triton(verify_lens, prefix_lens, page_table, page_size, total_rows,
                                        num_draft_tokens)
    return build_verify_rows_torch(verify_lens, prefix_lens, page_table, page_size, total_rows,
                                   num_draft_tokens)


def _check_inputs(verify_lens: torch.Tensor, prefix_lens: torch.Tensor, page_table: torch.Tensor,
                  page_size: int, total_rows: int, num_draft_tokens: int) -> None:
    if verify_lens.dim() != 1:
        raise ValueError(f"verify_lens must be 1-D [B], got shape {tuple(verify_lens.shape)}")
    num_reqs = verify_lens.shape[0]
    if prefix_lens.shape != (num_reqs,):
        raise ValueError(f"prefix_lens must be [B={num_reqs}], got shape {tuple(prefix_lens.shape)}")
    if page_table.dim() != 2 or page_table.shape[0] != num_reqs:
        raise ValueError(f"page_table must be [B={num_reqs}, pages], got shape {tuple(page_table.shape)}")
    for name, t in (("verify_lens", verify_lens), ("prefix_lens", prefix_lens), ("page_table", page_table)):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    # A real request verifies 1..N rows; 0 is allowed for the empty request slots of a graph
    # captured with more slots than the step has requests.
    if not 0 <= total_rows <= num_reqs * num_draft_tokens:
        raise ValueError(f"total_rows={total_rows} is outside [0, B*N] = [0, "
                         f"{num_reqs * num_draft_tokens}]: every request verifies at most N rows")


def build_verify_rows_torch(verify_lens: torch.Tensor, prefix_lens: torch.Tensor, page_table: torch.Tensor,
                            page_size: int, total_rows: int, num_draft_tokens: int) -> VerifyRows:
    """Reference implementation: plain torch ops, any device, no host sync (`output_size` is given)."""
    device = verify_lens.device
    lens = verify_lens.long()
    ends = torch.cumsum(lens, 0)
    qo_indptr = torch.cat((ends.new_zeros(1), ends)).to(torch.int32)
    row_req = torch.repeat_interleave(torch.arange(lens.shape[0], device=device), lens,
                                      output_size=total_rows)
    offset = torch.arange(total_rows, device=device) - (ends - lens)[row_req]
    positions = prefix_lens.long()[row_req] + offset
    out_cache_loc = page_table[row_req, positions // page_size].long() * page_size + positions % page_size
    src_index = row_req * num_draft_tokens + offset
    return VerifyRows(qo_indptr, row_req, positions, out_cache_loc, src_index)


def build_verify_rows_triton(verify_lens: torch.Tensor, prefix_lens: torch.Tensor, page_table: torch.Tensor,
                             page_size: int, total_rows: int, num_draft_tokens: int) -> VerifyRows:
    device = verify_lens.device
    num_reqs = verify_lens.shape[0]
    out = VerifyRows(
        qo_indptr=torch.empty(num_reqs + 1, dtype=torch.int32, device=device),
        row_req=torch.empty(total_rows, dtype=torch.int64, device=device),
        positions=torch.empty(total_rows, dtype=torch.int64, device=device),
        out_cache_loc=torch.empty(total_rows, dtype=torch.int64, device=device),
        src_index=torch.empty(total_rows, dtype=torch.int64, device=device),
    )
    launch_verify_rows(verify_lens, prefix_lens, page_table, page_size, total_rows, num_draft_tokens, out)
    return out


def launch_verify_rows(verify_lens: torch.Tensor, prefix_lens: torch.Tensor, page_table: torch.Tensor,
                       page_size: int, row_capacity: int, num_draft_tokens: int, out: VerifyRows) -> None:
    """Fill preallocated `out` buffers: `qo_indptr` at least B + 1 long, the row buffers at least
    `row_capacity` (>= sum(verify_lens)) long. Nothing at or past `row_capacity` is written, nor any
    row past `sum(verify_lens)` (the tests rely on both to see the masks work)."""
    num_reqs = verify_lens.shape[0]
    if num_reqs == 0:
        out.qo_indptr[:1].zero_()
        return
    # One program per request. Each program finds where its rows start by summing the
    # verify_lens of the requests before it: B is at most a few hundred, so this O(B) masked
    # reduction per program costs less than the extra launch and scratch buffer of a separate
    # scan kernel, and keeps the layout a single launch inside a captured graph.
    _verify_rows_kernel[(num_reqs,)](
        verify_lens, prefix_lens, page_table, page_table.stride(0), page_table.stride(1),
        out.qo_indptr, out.row_req, out.positions, out.out_cache_loc, out.src_index,
        num_reqs, row_capacity, page_size, num_draft_tokens,
        BLOCK_B=next_pow2(num_reqs), BLOCK_N=next_pow2(num_draft_tokens),
    )


@jit
def _verify_rows_kernel(verify_lens_ptr, prefix_lens_ptr, page_table_ptr, pt_stride_req, pt_stride_page,
                        qo_indptr_ptr, row_req_ptr, positions_ptr, out_cache_loc_ptr, src_index_ptr,
                        num_reqs, row_capacity, page_size, num_draft_tokens,
                        BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr):
    req = tl.program_id(0).to(tl.int64)
    others = tl.arange(0, BLOCK_B)
    lens = tl.load(verify_lens_ptr + others, mask=others < num_reqs, other=0).to(tl.int64)
    start = tl.sum(tl.where(others < req, lens, 0), axis=0)
    length = tl.load(verify_lens_ptr + req).to(tl.int64)
    tl.store(qo_indptr_ptr + req + 1, (start + length).to(tl.int32))
    if req == 0:
        tl.store(qo_indptr_ptr, start.to(tl.int32))  # no requests precede request 0: start is 0

    offs = tl.arange(0, BLOCK_N).to(tl.int64)
    rows = start + offs
    # Only `offs < length` matters for valid inputs; the other two keep a verify_len that breaks the
    # contract from writing into another request's rows or past the buffers.
    valid = (offs < length) & (offs < num_draft_tokens) & (rows < row_capacity)
    positions = tl.load(prefix_lens_ptr + req).to(tl.int64) + offs
    page = tl.load(page_table_ptr + req * pt_stride_req + (positions // page_size) * pt_stride_page,
                   mask=valid, other=0).to(tl.int64)
    tl.store(row_req_ptr + rows, tl.zeros_like(offs) + req, mask=valid)
    tl.store(positions_ptr + rows, positions, mask=valid)
    tl.store(out_cache_loc_ptr + rows, page * page_size + positions % page_size, mask=valid)
    tl.store(src_index_ptr + rows, req * num_draft_tokens + offs, mask=valid)
