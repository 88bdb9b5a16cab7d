"""Ragged causal attention over the paged KV cache, costing what the rows and their keys cost.

Slot r owns query rows `qo_indptr[r] … qo_indptr[r+1]-1`; row t attends to its slot's keys at
positions `0 … positions[t]` (and below `kv_lens[r]`), read through `page_table[r]`: the slot of
position p is `page_table[r, p // page_size] * page_size + p % page_size`. Query head h reads KV
head `h // (H // Hkv)`. These are the semantics of `TorchPagedAttention.attend` once it has written
the step's K/V. The Triton kernel reads each request's keys only up to its rows' largest position,
so a step costs what its rows and their KV lengths cost, and a slot without rows costs nothing.

`paged_attention_torch` is the oracle (any device, no host sync, gathers the whole page-table
capacity); `paged_attention_triton` is a FlashAttention-style kernel with fp32 online softmax.
Sizes that shape the grid are Python ints from the caller, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch

from dspark.runtime.kernels.dispatch import Impl, jit, next_pow2, tl, use_triton

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# `tl.dot` needs every operand dimension >= 16 on the GPU.
MIN_DOT = 16
# (query row, head) pairs in one program's tile: a verify request's rows for the whole group fit in
# one program (N <= 64 / group), and the fp32 accumulator [64, head_dim] stays in registers at 128.
TILE = 64
LOG2E = 1.4426950408889634


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr: torch.Tensor,
                    kv_lens: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor, *,
                    page_size: int, scale: float, max_rows_per_request: int,
                    impl: Impl = "auto") -> torch.Tensor:
    """Attention output `[T, H, D]` in q's dtype (fp32 accumulation) for the ragged rows of a step.

    `q [T, H, D]`; `k_cache`, `v_cache` one layer's `[num_slots, Hkv, D]` (the step's K/V already
    written); `qo_indptr` int32 `[S + 1]`; `kv_lens` int32 `[S]`; `positions` int64 `[T]`;
    `page_table` int32 `[S, P]`. The caller guarantees, on the host, what is not checked here
    because reading it would cost a device sync: `qo_indptr` runs from 0 to T, no slot has more
    than `max_rows_per_request` rows, and every row's position is below its slot's KV length and
    its pages' capacity. Any strides are accepted.
    """
    _check_inputs(q, k_cache, v_cache, qo_indptr, kv_lens, positions, page_table, page_size, scale,
                  max_rows_per_request)
    args = (q, k_cache, v_cache, qo_indptr, kv_lens, positions, page_table)
    if use_triton(impl, *args):
        return paged_attention_triton(*args, page_size=page_size, scale=scale,
                                      max_rows_per_request=max_rows_per_request)
    return paged_attention_torch(*args, page_size=page_size, scale=scale,
                                 max_rows_per_request=max_rows_per_request)


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr: torch.Tensor,
                  kv_lens: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor, page_size: int,
                  scale: float, max_rows_per_request: int) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got shape {tuple(q.shape)}")
    total, num_heads, head_dim = q.shape
    if k_cache.dim() != 3 or k_cache.shape[2] != head_dim:
        raise ValueError(f"k_cache must be [num_slots, Hkv, D={head_dim}], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, "
                         f"got {tuple(v_cache.shape)}")
    num_kv = k_cache.shape[1]
    if num_kv < 1 or num_heads % num_kv:
        raise ValueError(f"the {num_heads} query heads must be a multiple of the {num_kv} KV heads")
    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"k_cache and v_cache must have q's dtype {q.dtype}, "
                        f"got {k_cache.dtype} and {v_cache.dtype}")
    if kv_lens.dim() != 1 or kv_lens.dtype != torch.int32:
        raise TypeError(f"kv_lens must be 1-D int32 [S], got {kv_lens.dtype} of shape {tuple(kv_lens.shape)}")
    num_slots = kv_lens.shape[0]
    if qo_indptr.shape != (num_slots + 1,) or qo_indptr.dtype != torch.int32:
        raise TypeError(f"qo_indptr must be int32 [S + 1 = {num_slots + 1}], got {qo_indptr.dtype} "
                        f"of shape {tuple(qo_indptr.shape)}")
    if positions.shape != (total,) or positions.dtype != torch.int64:
        raise TypeError(f"positions must be int64 [T = {total}], got {positions.dtype} "
                        f"of shape {tuple(positions.shape)}")
    if page_table.dim() != 2 or page_table.shape[0] != num_slots or page_table.dtype != torch.int32:
        raise TypeError(f"page_table must be int32 [S = {num_slots}, pages], got {page_table.dtype} "
                        f"of shape {tuple(page_table.shape)}")
    devices = {t.device for t in (q, k_cache, v_cache, qo_indptr, kv_lens, positions, page_table)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(str(d) for d in devices)}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if max_rows_per_request < (1 if total else 0):
        raise ValueError(f"max_rows_per_request must be >= 1 for a step with rows, "
                         f"got {max_rows_per_request}")


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          qo_indptr: torch.Tensor, kv_lens: torch.Tensor, positions: torch.Tensor,
                          page_table: torch.Tensor, *, page_size: int, scale: float,
                          max_rows_per_request: int) -> torch.Tensor:
    """Reference: each slot's rows padded to a `[S, max_rows_per_request]` block attend over every
    position its page table can hold, masked to `key <= min(position, kv_len - 1)`; fp32 math.

    Every size comes from shapes and the caller's ints, so nothing waits on the device. A row that
    may see no key (only possible for inputs outside the contract) gets zeros, as in the kernel.
    """
    total, num_heads, head_dim = q.shape
    num_slots, num_kv = kv_lens.shape[0], k_cache.shape[1]
    group, width = num_heads // num_kv, max_rows_per_request
    device = q.device
    starts = qo_indptr[:-1].long()
    lens = qo_indptr[1:].long() - starts
    col = torch.arange(width, device=device)
    # Row index of each block entry; `total` (a zero query at position -1) past a slot's rows.
    gather = torch.where(col[None, :] < lens[:, None], starts[:, None] + col[None, :], total)
    q_blk = torch.cat((q.float(), q.new_zeros(1, num_heads, head_dim, dtype=torch.float32)))[gather]
    pos_blk = torch.cat((positions, positions.new_full((1,), -1)))[gather]  # S, W
    limit = torch.minimum(pos_blk, kv_lens.long()[:, None] - 1)

    cap = page_table.shape[1] * page_size
    offs = torch.arange(cap, device=device)
    slots = page_table.long()[:, offs // page_size] * page_size + offs % page_size  # S, C
    keys = k_cache[slots].float()  # S, C, Hkv, D
    vals = v_cache[slots].float()
    q_blk = q_blk.view(num_slots, width, num_kv, group, head_dim)
    scores = torch.einsum("swkgd,sckd->skgwc", q_blk, keys) * scale
    hidden = offs[None, None, :] > limit[:, :, None]  # S, W, C
    scores = scores.masked_fill(hidden[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    out_blk = torch.einsum("skgwc,sckd->swkgd", probs, vals).reshape(num_slots, width, num_heads, head_dim)

    row_slot = torch.repeat_interleave(torch.arange(num_slots, device=device), lens, output_size=total)
    row_col = torch.arange(total, device=device) - starts[row_slot]
    return out_blk[row_slot, row_col].to(q.dtype)


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           qo_indptr: torch.Tensor, kv_lens: torch.Tensor, positions: torch.Tensor,
                           page_table: torch.Tensor, *, page_size: int, scale: float,
                           max_rows_per_request: int) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    launch_paged_attention(q, k_cache, v_cache, qo_indptr, kv_lens, positions, page_table, out,
                           page_size=page_size, scale=scale, max_rows_per_request=max_rows_per_request)
    return out


def block_sizes(group: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M query rows, BLOCK_N key positions) of a program: fixed per model, never per step.

    A row's result then has the same bits in every step it could run in (a decode, a verify step, a
    prefill chunk, beside any other rows), which greedy losslessness needs: the tile has one shape,
    keys are read in BLOCK_N tiles from position 0, and the tiles a block reads past a row's position
    leave that row's running max, sum and accumulator exactly as they were. BLOCK_M = TILE / group
    rows (at least 1) cover a verify request in one program, so each K/V tile is loaded once for
    all its rows and heads; a decode wastes the tile's other rows, but it is bound by loading K/V,
    not by the products. BLOCK_N = 64 keys keep a bf16 K and V tile at 16 KiB each at head_dim 128
    (32 keys above that).
    """
    block_m = max(TILE // next_pow2(group), 1)
    block_n = 64 if next_pow2(head_dim) <= 128 else 32
    return block_m, block_n


def launch_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           qo_indptr: torch.Tensor, kv_lens: torch.Tensor, positions: torch.Tensor,
                           page_table: torch.Tensor, out: torch.Tensor, *, page_size: int, scale: float,
                           max_rows_per_request: int, block_m: int | None = None,
                           block_n: int | None = None) -> None:
    """Write the attention of every slot's rows into `out` (`[>= T, H, D]`, any strides).

    Only rows `qo_indptr[0] … qo_indptr[-1]-1`, heads `< H` and dims `< D` are written (the tests
    rely on it to see the masks work). `block_m`/`block_n` override `block_sizes` (tests).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_slots, num_kv = kv_lens.shape[0], k_cache.shape[1]
    group = num_heads // num_kv
    default_m, default_n = block_sizes(group, head_dim)
    block_m, block_n = block_m or default_m, block_n or default_n
    if (block_m & (block_m - 1) or block_n & (block_n - 1) or block_m * next_pow2(group) < MIN_DOT
            or block_n < MIN_DOT):
        raise ValueError(f"block_m={block_m} and block_n={block_n} must be powers of two with "
                         f"block_m * next_pow2(group={group}) and block_n >= {MIN_DOT}")
    num_blocks = -(-max_rows_per_request // block_m)
    if num_slots == 0 or q.shape[0] == 0 or num_blocks == 0:
        return
    # fp32 inputs multiply in full precision: TF32 would miss the reference by ~1e-3.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _paged_attention_kernel[(num_slots, num_kv, num_blocks)](
        q, q.stride(0), q.stride(1), q.stride(2),
        k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out, out.stride(0), out.stride(1), out.stride(2),
        qo_indptr, kv_lens, positions, page_table, page_table.stride(0), page_table.stride(1),
        page_size, float(scale) * LOG2E, head_dim,
        GROUP=group, GROUP_P=next_pow2(group), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(next_pow2(head_dim), MIN_DOT), PRECISION=precision,
    )


@jit
def _paged_attention_kernel(q_ptr, q_s_row, q_s_head, q_s_dim, k_ptr, k_s_slot, k_s_head, k_s_dim,
                            v_ptr, v_s_slot, v_s_head, v_s_dim, o_ptr, o_s_row, o_s_head, o_s_dim,
                            qo_indptr_ptr, kv_lens_ptr, positions_ptr, pt_ptr, pt_s_req, pt_s_page,
                            page_size, qk_scale_log2, head_dim,
                            GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    slot = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    first = tl.program_id(2).to(tl.int64) * BLOCK_M
    start = tl.load(qo_indptr_ptr + slot).to(tl.int64)
    num_rows = tl.load(qo_indptr_ptr + slot + 1).to(tl.int64) - start
    if first >= num_rows:
        return  # a slot without rows, or fewer rows than this block starts at
    kv_len = tl.load(kv_lens_ptr + slot).to(tl.int64)

    # The tile's rows are (query row, head of the group) pairs: one K/V tile serves the whole group.
    i = tl.arange(0, BLOCK_M * GROUP_P)
    row = first + i // GROUP_P
    head = kv_head * GROUP + i % GROUP_P
    live = (row < num_rows) & (i % GROUP_P < GROUP)
    t = start + row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + t[:, None] * q_s_row + head[:, None] * q_s_head + d[None, :] * q_s_dim,
                mask=live[:, None] & d_ok[None, :], other=0.0)
    # Each pair sees keys 0 … min(position, kv_len - 1); dead pairs see none (-1).
    pos = tl.load(positions_ptr + t, mask=live, other=-1)
    limit = tl.where(live, tl.minimum(pos, kv_len - 1), -1)
    hi = (tl.max(limit, axis=0) + 1).to(tl.int32)  # this block's keys end at its largest position

    # A finite floor for the running max keeps exp2(m_old - m_new) at 1, not NaN, before any key.
    m_i = tl.full([BLOCK_M * GROUP_P], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_P], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_P, BLOCK_D], dtype=tl.float32)
    n_offs = tl.arange(0, BLOCK_N)
    for key_start in range(0, hi, BLOCK_N):
        n = key_start + n_offs
        n_ok = n < hi
        page = tl.load(pt_ptr + slot * pt_s_req + (n // page_size) * pt_s_page, mask=n_ok, other=0)
        kv_slot = page.to(tl.int64) * page_size + n % page_size
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_slot[:, None] * k_s_slot + kv_head * k_s_head + d[None, :] * k_s_dim,
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_slot[:, None] * v_s_slot + kv_head * v_s_head + d[None, :] * v_s_dim,
                    mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale_log2
        s = tl.where(n[None, :] <= limit[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a pair that saw no key writes zeros
    tl.store(o_ptr + t[:, None] * o_s_row + head[:, None] * o_s_head + d[None, :] * o_s_dim,
             out.to(o_ptr.dtype.element_ty), mask=live[:, None] & d_ok[None, :])
