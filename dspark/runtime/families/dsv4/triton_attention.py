"""DeepSeek-V4 (DSV4) attention of a ragged verify step over the paged SWA ring and compressed caches.

The math is `npu_sparse_attn_sharedkv`'s (modelled by `dspark.runtime.families.dsv4.ascend_op_models.
reference_sparse_attn_sharedkv`): one shared KV head whose value is its key, and for row t at position
p of slot b = row_slot[t] one softmax over
* its sliding window of raw K=V: positions max(0, p - wl + 1) .. p with wl = min(p + 1, window,
  window_lens[t]), position q at ring slot s = q % C (C = swa_ring_size), physical slot
  `ori_block_table[b, s // Ps] * Ps + s % Ps` (Ps = swa_kv.shape[1]);
* its compressed entries (layers with a compressor): entry e at `cmp_block_table[b, e // Cp] * Cp +
  e % Cp` (Cp = cmp_kv.shape[1]). C128-kind layers (no `topk`) see every e < cmp_visible[t]. C4 layers
  see the ids of `topk[t]` as the operator reads them: the first min(K, cmp_visible[t]) columns, up to
  the first negative id, ids >= cmp_visible[t] skipped, duplicates kept;
* and, with `sinks`, a per-head logit that adds exp(sink - max) to the denominator only.

Padding. The metadata gives padding rows (row_slot >= the real requests) `swa_window_lens = 0` and
`cmp_visible = 0`: passed as `window_lens` they see no key, so the sink takes all the mass and the row
writes zeros (as `dsv4.paged` does). Rows at a negative position see nothing and write zeros (the
operator's golden). With `window_lens=None` a row sees min(p + 1, window) positions whatever its slot, so
padding rows read the null page exactly as the Ascend operator does (the tests use both). A row that sees
no key writes zeros, with or without sinks.

`dsv4_attention_torch` is the oracle (any device, no host sync; it gathers the whole compressed-table
capacity of C128-kind rows); `launch_dsv4_attention` is the Triton kernel, reading only the keys a row
can see. Every size that shapes the grid or a tile is a Python int taken from shapes or the caller, so
the step can be captured in a CUDA graph and replayed with new metadata values.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from dspark.runtime.kernels.dispatch import Impl, jit, next_pow2, tl, use_triton

if TYPE_CHECKING:
    from dspark.runtime.families.dsv4.verify_metadata import Dsv4VerifyMetadata

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 512  # DSV4's head_dim; one program holds a [BLOCK_H, next_pow2(D)] accumulator
# `tl.dot` needs every operand dimension >= 16 on the GPU.
MIN_DOT = 16
# Elements of one program's fp32 accumulator and of one key tile: [16, 512] at DSV4's head_dim, which
# keeps the accumulator at 64 registers a thread with 4 warps.
TILE_ELEMS = 8192
MAX_BLOCK = 64
LOG2E = 1.4426950408889634


def dsv4_attention(q: torch.Tensor, swa_kv: torch.Tensor, cmp_kv: torch.Tensor | None,
                   sinks: torch.Tensor | None, *, positions: torch.Tensor, row_slot: torch.Tensor,
                   ori_block_table: torch.Tensor, swa_ring_size: int, window: int,
                   window_lens: torch.Tensor | None = None, cmp_block_table: torch.Tensor | None = None,
                   cmp_visible: torch.Tensor | None = None, topk: torch.Tensor | None = None, scale: float,
                   impl: Impl = "auto") -> torch.Tensor:
    """One DSV4 layer's attention output `[T, H, D]` in q's dtype (fp32 accumulation).

    `q [T, H, D]`; `swa_kv [pages, Ps, D]` and `cmp_kv [pages, Cp, D] | None` (q's dtype, the step's
    rows and entries already written); `sinks` float32 `[H] | None`; `positions` int64 `[T]`; `row_slot`,
    `window_lens` (the metadata's `swa_window_lens`) and `cmp_visible` int32 `[T]`; `ori_block_table` and
    `cmp_block_table` int32 `[B, pages]`; `topk` int32 `[T, K]` (C4 layers: entry ids, -1 padded). What
    is not checked here (reading it would sync): row_slot < B, page ids inside the caches, cmp_visible
    within the table's entries. Table columns past a table's width are not read. Any strides.
    """
    _check_inputs(q, swa_kv, cmp_kv, sinks, positions, row_slot, ori_block_table, swa_ring_size, window,
                  window_lens, cmp_block_table, cmp_visible, topk, scale)
    kwargs: dict[str, Any] = dict(positions=positions, row_slot=row_slot, ori_block_table=ori_block_table,
                                  swa_ring_size=swa_ring_size, window=window, window_lens=window_lens,
                                  cmp_block_table=cmp_block_table, cmp_visible=cmp_visible, topk=topk,
                                  scale=scale)
    tensors = [t for t in (q, swa_kv, cmp_kv, sinks, positions, row_slot, ori_block_table, window_lens,
                           cmp_block_table, cmp_visible, topk) if t is not None]
    if use_triton(impl, *tensors):
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        launch_dsv4_attention(q, swa_kv, cmp_kv, sinks, out, **kwargs)
        return out
    return dsv4_attention_torch(q, swa_kv, cmp_kv, sinks, **kwargs)


def dsv4_attention_args(meta: Dsv4VerifyMetadata, compress_ratio: int) -> dict[str, Any]:
    """The keyword arguments of `dsv4_attention` for one layer of a planned step (ratio 0: window only),
    from `meta.device`; the caller adds `topk` for C4 layers and `scale`."""
    dev, cfg = meta.device, meta.config
    args: dict[str, Any] = dict(positions=dev.positions, row_slot=dev.row_slot,
                                ori_block_table=dev.ori_block_table, swa_ring_size=cfg.swa_ring_size,
                                window=cfg.window, window_lens=dev.swa_window_lens)
    if compress_ratio:
        plan = meta.compressed[compress_ratio].device
        args.update(cmp_block_table=plan.cmp_block_table, cmp_visible=plan.cmp_visible)
    return args


def _check_int(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | None,
               ndim: int) -> None:
    if t.dtype != dtype or t.dim() != ndim or (shape is not None and tuple(t.shape) != shape):
        want = list(shape) if shape is not None else f"{ndim}-D"
        raise TypeError(f"{name} must be {str(dtype).removeprefix('torch.')} {want}, "
                        f"got {str(t.dtype).removeprefix('torch.')} {list(t.shape)}")


def _check_inputs(q: torch.Tensor, swa_kv: torch.Tensor, cmp_kv: torch.Tensor | None,
                  sinks: torch.Tensor | None, positions: torch.Tensor, row_slot: torch.Tensor,
                  ori_block_table: torch.Tensor, swa_ring_size: int, window: int,
                  window_lens: torch.Tensor | None, cmp_block_table: torch.Tensor | None,
                  cmp_visible: torch.Tensor | None, topk: torch.Tensor | None, scale: float) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got shape {list(q.shape)}")
    total, num_heads, head_dim = q.shape
    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    for name, cache in (("swa_kv", swa_kv), ("cmp_kv", cmp_kv)):
        if cache is None:
            continue
        if cache.dim() != 3 or cache.shape[2] != head_dim or cache.shape[1] < 1:
            raise ValueError(f"{name} must be [pages, page_size, D={head_dim}], got {list(cache.shape)}")
        if cache.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {cache.dtype}")
    if sinks is not None:
        _check_int("sinks", sinks, torch.float32, (num_heads,), 1)
    _check_int("positions", positions, torch.int64, (total,), 1)
    _check_int("row_slot", row_slot, torch.int32, (total,), 1)
    _check_int("ori_block_table", ori_block_table, torch.int32, None, 2)
    num_slots = ori_block_table.shape[0]
    if ori_block_table.shape[1] < 1:
        raise ValueError("ori_block_table must have at least one column")
    if window_lens is not None:
        _check_int("window_lens", window_lens, torch.int32, (total,), 1)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    page_size = swa_kv.shape[1]
    if swa_ring_size < window or swa_ring_size % page_size:
        raise ValueError(f"swa_ring_size must be a multiple of swa_kv's page size {page_size} and at least "
                         f"window={window}, got {swa_ring_size}")
    parts = (cmp_kv, cmp_block_table, cmp_visible)
    if any(p is None for p in parts) and any(p is not None for p in parts):
        raise ValueError("cmp_kv, cmp_block_table and cmp_visible must be given together (a compressed "
                         "layer) or not at all (a window-only layer)")
    if cmp_block_table is not None and cmp_visible is not None:
        _check_int("cmp_block_table", cmp_block_table, torch.int32, None, 2)
        if cmp_block_table.shape[0] != num_slots or cmp_block_table.shape[1] < 1:
            raise ValueError(f"cmp_block_table must be [B={num_slots}, >= 1 pages], "
                             f"got {list(cmp_block_table.shape)}")
        _check_int("cmp_visible", cmp_visible, torch.int32, (total,), 1)
    if topk is not None:
        if cmp_kv is None:
            raise ValueError("topk needs a compressed layer (cmp_kv, cmp_block_table, cmp_visible)")
        _check_int("topk", topk, torch.int32, None, 2)
        if topk.shape[0] != total or topk.shape[1] < 1:
            raise ValueError(f"topk must be [T={total}, K >= 1], got {list(topk.shape)}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    tensors = [t for t in (q, swa_kv, cmp_kv, sinks, positions, row_slot, ori_block_table, window_lens,
                           cmp_block_table, cmp_visible, topk) if t is not None]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(str(d) for d in devices)}")


# -- torch reference ---------------------------------------------------------------------------------------

def _paged_gather(cache: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, index: torch.Tensor,
                  ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys `[T, n, D]` (fp32) at logical indices `index [T, n]` of each row's table row; the mask `ok`
    loses the indices whose page column lies past the table (they are not read: zeros)."""
    page_size, cols = cache.shape[1], table.shape[1]
    col = torch.div(index, page_size, rounding_mode="floor")
    ok = ok & (col < cols) & (col >= 0)
    col = torch.where(ok, col, 0)
    page = table.long()[rows[:, None], col]
    slot = torch.where(ok, page * page_size + index.remainder(page_size), 0)
    keys = cache.reshape(-1, cache.shape[-1])[slot].float()
    return keys.masked_fill(~ok[..., None], 0.0), ok


def dsv4_attention_torch(q: torch.Tensor, swa_kv: torch.Tensor, cmp_kv: torch.Tensor | None,
                         sinks: torch.Tensor | None, *, positions: torch.Tensor, row_slot: torch.Tensor,
                         ori_block_table: torch.Tensor, swa_ring_size: int, window: int,
                         window_lens: torch.Tensor | None = None, cmp_block_table: torch.Tensor | None = None,
                         cmp_visible: torch.Tensor | None = None, topk: torch.Tensor | None = None,
                         scale: float) -> torch.Tensor:
    """Reference: every row's `window` window columns and its compressed candidates (C128-kind: the
    whole table capacity; C4: the K top-k columns) gathered into one `[T, n, D]` key block, masked, one
    fp32 softmax with the sink column. Sizes come from shapes and ints: nothing waits on the device."""
    total, num_heads, head_dim = q.shape
    device = q.device
    rows = row_slot.long()
    pos = positions
    live = pos >= 0
    lens = torch.minimum(pos + 1, torch.full_like(pos, window))
    if window_lens is not None:
        lens = torch.minimum(lens, window_lens.long())
    lens = torch.where(live, lens.clamp_min(0), 0)
    col = torch.arange(window, device=device)
    # Column j holds position p - window + 1 + j: the window ends at the row's own position.
    key_pos = pos[:, None] - window + 1 + col[None, :]
    win_ok = col[None, :] >= window - lens[:, None]
    ring = key_pos.remainder(swa_ring_size)
    keys, ok = _paged_gather(swa_kv, ori_block_table, rows, ring, win_ok)

    if cmp_kv is not None and cmp_block_table is not None and cmp_visible is not None:
        visible = torch.where(live, cmp_visible.long().clamp_min(0), 0)[:, None]
        if topk is None:
            ids = torch.arange(cmp_block_table.shape[1] * cmp_kv.shape[1], device=device)[None, :]
            ids = ids.expand(total, -1)
            cmp_ok = ids < visible
        else:
            ids = topk.long()
            j = torch.arange(ids.shape[1], device=device)[None, :]
            before_pad = torch.cumsum((ids < 0).int(), dim=1) == 0  # up to the first negative id
            cmp_ok = before_pad & (j < visible) & (ids >= 0) & (ids < visible)
        cmp_keys, cmp_ok = _paged_gather(cmp_kv, cmp_block_table, rows, ids, cmp_ok)
        keys, ok = torch.cat((keys, cmp_keys), 1), torch.cat((ok, cmp_ok), 1)

    logits = torch.einsum("thd,tnd->thn", q.float(), keys) * scale
    logits = logits.masked_fill(~ok[:, None, :], float("-inf"))
    if sinks is not None:
        sink_col = sinks.float()[None, :, None].expand(total, num_heads, 1)
        logits = torch.cat((logits, sink_col), 2)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row without key or sink: all -inf
    probs = probs[..., : keys.shape[1]]
    return torch.einsum("thn,tnd->thd", probs, keys).to(q.dtype)


# -- Triton kernel ---------------------------------------------------------------------------------------

def block_sizes(num_heads: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_H heads, BLOCK_N keys) of a program: fixed per model, never per step, so a row's result has
    the same bits whatever rows share its step (greedy losslessness), as in `paged_attention`."""
    block_d = max(next_pow2(head_dim), MIN_DOT)
    cap = max(TILE_ELEMS // block_d, MIN_DOT)
    block_h = min(max(next_pow2(num_heads), MIN_DOT), cap, MAX_BLOCK)
    block_n = min(cap, MAX_BLOCK)
    return block_h, block_n


def launch_dsv4_attention(q: torch.Tensor, swa_kv: torch.Tensor, cmp_kv: torch.Tensor | None,
                          sinks: torch.Tensor | None, out: torch.Tensor, *, positions: torch.Tensor,
                          row_slot: torch.Tensor, ori_block_table: torch.Tensor, swa_ring_size: int,
                          window: int, window_lens: torch.Tensor | None = None,
                          cmp_block_table: torch.Tensor | None = None,
                          cmp_visible: torch.Tensor | None = None, topk: torch.Tensor | None = None,
                          scale: float, block_h: int | None = None, block_n: int | None = None) -> None:
    """Write the attention of rows `< T`, heads `< H`, dims `< D` into `out` (`[>= T, >= H, >= D]`, any
    strides; nothing else is written). `block_h`/`block_n` override `block_sizes` (tests).

    Grid: one program per (row, block of heads). DSV4 has one shared KV head, so the heads are the
    matmul's M dimension (as in MQA decode kernels): each key tile a row loads serves BLOCK_H heads.
    Rows are not tiled together because every row sees its own keys: windows shift by one position per
    row and C4 rows pick their own top-k entries, so a multi-row tile would load the union and mask most
    of it. A program loops over its row's window, then its compressed entries (or top-k ids), in
    BLOCK_N tiles, with an fp32 online softmax; the sink joins at the end. head_dim stays one tile (up
    to 512): `block_sizes` shrinks BLOCK_H and BLOCK_N instead, so at DSV4's 64 heads x 512 a row's keys
    are loaded by 4 programs (from L2 after the first). Splitting D across programs for the value
    product (FlashMLA's layout) would cut that; the block sizes have not been tuned on a GPU yet.
    """
    total, num_heads, head_dim = q.shape
    default_h, default_n = block_sizes(num_heads, head_dim)
    block_h, block_n = block_h or default_h, block_n or default_n
    if block_h & (block_h - 1) or block_n & (block_n - 1) or block_h < MIN_DOT or block_n < MIN_DOT:
        raise ValueError(f"block_h={block_h} and block_n={block_n} must be powers of two >= {MIN_DOT}")
    if total == 0 or num_heads == 0:
        return
    block_d = max(next_pow2(head_dim), MIN_DOT)
    has_cmp = cmp_kv is not None and cmp_block_table is not None and cmp_visible is not None
    has_topk = has_cmp and topk is not None
    # Unused pointers get a live tensor of the right kind; the constexpr flags keep them unread.
    cmp = cmp_kv if cmp_kv is not None else swa_kv
    cbt = cmp_block_table if cmp_block_table is not None else ori_block_table
    vis = cmp_visible if cmp_visible is not None else row_slot
    tk = topk if topk is not None else ori_block_table
    wl = window_lens if window_lens is not None else row_slot
    sk = sinks if sinks is not None else q
    # fp32 inputs multiply in full precision: TF32 would miss the reference by ~1e-3.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (total, -(-num_heads // block_h))
    _dsv4_attention_kernel[grid](
        q, q.stride(0), q.stride(1), q.stride(2),
        swa_kv, swa_kv.stride(0), swa_kv.stride(1), swa_kv.stride(2),
        cmp, cmp.stride(0), cmp.stride(1), cmp.stride(2),
        out, out.stride(0), out.stride(1), out.stride(2),
        sk, positions, row_slot, wl,
        ori_block_table, ori_block_table.stride(0), ori_block_table.stride(1), ori_block_table.shape[1],
        cbt, cbt.stride(0), cbt.stride(1), cbt.shape[1],
        vis, tk, tk.stride(0), tk.stride(1), tk.shape[1],
        num_heads, head_dim, window, swa_ring_size, swa_kv.shape[1], cmp.shape[1],
        float(scale) * LOG2E, LOG2E,
        HAS_WLEN=window_lens is not None, HAS_CMP=has_cmp, HAS_TOPK=has_topk, HAS_SINK=sinks is not None,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=precision,
        num_warps=8 if block_h * block_d >= TILE_ELEMS else 4,
    )


@jit
def _online_update(q, k, ok, m_i, l_i, acc, qk_scale_log2, PRECISION: tl.constexpr):
    """Fold one key tile `k [BLOCK_N, BLOCK_D]` (value = key) into the running softmax of `q`'s heads."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale_log2
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=PRECISION)
    return m_new, l_i, acc


@jit
def _paged_keys(kv_ptr, kv_s_page, kv_s_off, kv_s_dim, bt_ptr, bt_s_slot, bt_s_col, slot, col, off, ok,
                d, d_ok):
    """The key tile of cache entries (`col` a block-table column, `off` the offset in its page) where `ok`:
    the page from the slot's block-table row, then the entries' `d` dims (zeros elsewhere)."""
    page = tl.load(bt_ptr + slot * bt_s_slot + col * bt_s_col, mask=ok, other=0).to(tl.int64)
    return tl.load(kv_ptr + page[:, None] * kv_s_page + off[:, None] * kv_s_off + d[None, :] * kv_s_dim,
                   mask=ok[:, None] & d_ok[None, :], other=0.0)


@jit
def _dsv4_attention_kernel(q_ptr, q_s_row, q_s_head, q_s_dim,
                           swa_ptr, swa_s_page, swa_s_off, swa_s_dim,
                           cmp_ptr, cmp_s_page, cmp_s_off, cmp_s_dim,
                           o_ptr, o_s_row, o_s_head, o_s_dim,
                           sink_ptr, pos_ptr, slot_ptr, wlen_ptr,
                           ori_ptr, ori_s_slot, ori_s_col, ori_cols,
                           cbt_ptr, cbt_s_slot, cbt_s_col, cbt_cols,
                           vis_ptr, topk_ptr, topk_s_row, topk_s_col, topk_k,
                           num_heads, head_dim, window, ring, swa_ps, cmp_ps, qk_scale_log2, log2e,
                           HAS_WLEN: tl.constexpr, HAS_CMP: tl.constexpr, HAS_TOPK: tl.constexpr,
                           HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + t * q_s_row + h[:, None].to(tl.int64) * q_s_head + d[None, :] * q_s_dim,
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    live = pos >= 0
    # The window's length: its positions are pos - wl + 1 .. pos, never below 0.
    wl = tl.minimum(pos + 1, window)
    if HAS_WLEN:
        wl = tl.minimum(wl, tl.load(wlen_ptr + t).to(tl.int64))
    wl = tl.where(live, tl.maximum(wl, 0), 0).to(tl.int32)
    first = pos - wl + 1

    # A finite floor for the running max keeps exp2(m_old - m_new) at 1, not NaN, before any key.
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    n_offs = tl.arange(0, BLOCK_N)

    # Raw window through the ring: only the wl positions the row sees are read.
    for n0 in range(0, wl, BLOCK_N):
        n = n0 + n_offs
        ring_slot = (first + n) % ring  # first + n >= 0 wherever n < wl
        col = ring_slot // swa_ps
        ok = (n < wl) & (col < ori_cols)
        k = _paged_keys(swa_ptr, swa_s_page, swa_s_off, swa_s_dim, ori_ptr, ori_s_slot, ori_s_col, slot, col,
                        ring_slot % swa_ps, ok, d, d_ok)
        m_i, l_i, acc = _online_update(q, k, ok, m_i, l_i, acc, qk_scale_log2, PRECISION)

    if HAS_CMP:
        visible = tl.where(live, tl.maximum(tl.load(vis_ptr + t), 0), 0)
        if HAS_TOPK:
            # C4: the first min(K, visible) ids up to the first negative one; ids >= visible skipped.
            cols = tl.minimum(visible, topk_k)
            stop = cols
            for n0 in range(0, cols, BLOCK_N):
                j = n0 + n_offs
                in_row = j < cols
                ids = tl.load(topk_ptr + t * topk_s_row + j * topk_s_col, mask=in_row, other=0)
                # Tiles run in column order, so the first negative id seen so far bounds this tile too.
                stop = tl.minimum(stop, tl.min(tl.where(in_row & (ids < 0), j, cols), axis=0))
                e = ids.to(tl.int64)
                col = e // cmp_ps
                ok = (j < stop) & (ids >= 0) & (ids < visible) & (col < cbt_cols)
                k = _paged_keys(cmp_ptr, cmp_s_page, cmp_s_off, cmp_s_dim, cbt_ptr, cbt_s_slot, cbt_s_col,
                                slot, col, e % cmp_ps, ok, d, d_ok)
                m_i, l_i, acc = _online_update(q, k, ok, m_i, l_i, acc, qk_scale_log2, PRECISION)
        else:
            # C128-kind: entries 0 .. visible - 1, nothing past them.
            for n0 in range(0, visible, BLOCK_N):
                e = (n0 + n_offs).to(tl.int64)
                col = e // cmp_ps
                ok = (e < visible) & (col < cbt_cols)
                k = _paged_keys(cmp_ptr, cmp_s_page, cmp_s_off, cmp_s_dim, cbt_ptr, cbt_s_slot, cbt_s_col,
                                slot, col, e % cmp_ps, ok, d, d_ok)
                m_i, l_i, acc = _online_update(q, k, ok, m_i, l_i, acc, qk_scale_log2, PRECISION)

    if HAS_SINK:
        # The sink joins the denominator only: rescale to max(m, sink) and add its exp.
        sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * log2e
        m_f = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_f)
        l_i = l_i * alpha + tl.exp2(sink - m_f)
        acc = acc * alpha[:, None]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that saw no key (and no sink) writes zeros
    tl.store(o_ptr + t * o_s_row + h[:, None].to(tl.int64) * o_s_head + d[None, :] * o_s_dim,
             out.to(o_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])
