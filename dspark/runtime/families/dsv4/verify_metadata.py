"""Per-step metadata of a DeepSeek-V4 (DSV4) verify step, derived from `verify_lens` and prefix lengths.

A verify step has B request slots: the R real requests first (request b runs L[b] rows, 1 <= L[b] <= N,
after its committed prefix of P[b] positions), then padding requests and empty slots. As in
`dspark.runtime.layout`, a step padded up to a token tier T gets padding requests of prefix 0 carrying
at most `padding_request_rows` rows each, then empty slots of 0 rows up to the slot count a graph holds.
A static step is the case L[b] = N for every request. Rows are packed back to back, so row t of slot b
sits at position p = P[b] + (t - cu_seqlens_q[b]).

DSV4 layers keep raw K=V for a sliding window of W positions and, for compress ratio r in {4, 128},
one compressed entry per completed block of r positions, written by the row whose position p has
(p + 1) % r == 0 (entry e = (p + 1) // r - 1, its RoPE position the block's first position p - r + 1).
C4 layers add a lightning indexer that picks `index_topk` of the floor((p + 1) / 4) entries row p sees.

Every array comes twice: `meta.host.<field>` (numpy, for host-side planning and the kernels that take
host lists) and `meta.device.<field>` (torch, on the step's device), with identical names, shapes and
dtypes; per-ratio arrays live under `meta.compressed[r].host` / `.device`.

Layouts chosen here
-------------------
* Sliding-window raw KV: a per-request ring of C = `swa_ring_size` slots, position p at ring slot p % C,
  ring slot s in the request's ring page `s // swa_page_size`. A ring of exactly W slots is not enough
  for a verify step: its rows write positions P .. P+L-1 before attention reads, and row P still needs
  P-W+1, so C >= W + N - 1 (the width vllm-ascend gives its DSpark SWA indices, window + gamma).
  The Ascend operator indexes its `ori_block_table` by absolute page p // page_size, so that table
  repeats the ring pages (column j holds ring page j % (C / page_size)); C must be a multiple of the
  page size for that to hold. Both peers page the window over absolute positions and free the pages
  that fall out of it; the ring gives the same reads with a fixed number of pages per request.
  A runtime that keeps the compressor's per-position rows in the same ring (as `dsv4.paged` and
  SGLang do) needs C >= max(W, 2 * 4, largest other ratio) + N - 1, since a boundary row reads its
  block back (two blocks for the overlapping C4 compressor); `dsv4.paged.check_compatible` checks it.
* Compressed caches: entries in request order, entry e at page `cmp_block_table[b, e // page]`.
  Pages cover the floor((P + L) / r) complete entries, drafts included (a rejected draft's entry is
  rewritten by the next step); the partial block counted by ceil((P + L) / r) lives in the
  compressor's state cache, which this module does not plan.
* Page 0 is the null page (`dspark.runtime.kv_cache`): padding slots' tables and unused table columns
  point at it, and padding rows write their raw K=V into it (as `layout.plan_verify` does).
* Padding requests write no compressed entries: their boundary rows are left out of `boundary_rows`.

Pad values of the `num_cmp_rows = min(T, T // r + B)` compressed-write arrays (vllm-ascend
`_num_compressor_metadata_rows`, SGLang's `positions_cmp_padding` size; it bounds the boundary rows,
at most L // r + 1 per slot): `boundary_rows` and `cmp_slot_mapping` pad with -1 (vLLM's PAD_SLOT_ID,
which its cache writers skip; a gather must mask it), `cmp_positions` with 0 and `cmp_loc` with 0, a
slot of the null page, as SGLang's Ascend backend pads `c{r}_loc` (its NPU scatter has no skip).

Peer names (vllm-project/vllm-ascend `vllm_ascend/attention/dsa_v1.py`, `.../models/deepseek_v4/
compressor.py`, `.../indexer.py`; sgl-project/sglang `python/sglang/srt/hardware_backend/npu/attention/
ascend_dsv4_backend.py`; operators `npu_sparse_attn_sharedkv[_metadata]` (SAS),
`npu_[quant_]lightning_indexer[_v2][_metadata]` (QLI), `compressor` / `compressor_metadata`):
* `cu_seqlens_q` [B+1]: SAS/QLI-v2 `cu_seqlens_q`, compressor `cu_seqlens`, vLLM `query_start_loc`,
  SGLang `actual_seq_lengths_q_pa`; `actual_seq_lengths_q` = cu_seqlens_q[1:]: QLI
  `actual_seq_lengths_query`, SGLang `actual_seq_lengths_q` (TND takes cumulative ends).
* `seqused_q` [B] = L: SAS `seqused_q`. `start_pos` [B] = P: compressor `start_pos`.
* `kv_lens` [B] = max(P + L, 1) (alias `seqused_kv`): SAS `seqused_kv`, QLI `actual_seq_lengths_key`
  (raw length; the operator divides by `cmp_ratio`), SGLang `actual_seq_lengths_kv` (clamped to 1 as
  here), vLLM `seq_lens`. `max_seqlen_q` = N and `max_seqlen_kv` = max(kv_lens): SAS `max_seqlen_*`
  (N, not the step's widest request, so a captured graph's metadata does not depend on the step, as
  vllm-ascend does for adaptive verification). `ori_win_left` = W - 1, `ori_win_right` = 0: SAS.
* `swa_slot_mapping` [T]: vllm-ascend `slot_mapping` of the SWA cache, SGLang `swa_loc`.
  `swa_indices` [T, W] (pad -1): vllm-ascend `dspark_swa_indices`, SAS `ori_sparse_indices` (view it
  [T, 1, W]). `ori_block_table` [B, pages]: SAS `ori_block_table`, SGLang `swa_page_table`.
* Per ratio: `num_cmp_rows`: vllm-ascend `num_compressed_tokens`; `cmp_positions`: SGLang
  `positions_cmp_padding_c{r}`; `cmp_slot_mapping`: the slot output of vllm-ascend's
  `compressor_metadata`; `cmp_loc`: SGLang `c{r}_loc`; `cmp_block_table`: SAS `cmp_block_table`,
  SGLang `c{r}_page_table`, QLI `block_table` (C4); `cmp_kv_lens` = floor((P+L)/r): QLI-v2 `seqused_k`;
  `cmp_residual_k` = (P+L) % r: QLI-v2 `cmp_residual_k`; `cmp_visible` [T] = floor((p+1)/r): the
  per-row key count QLI derives under `sparse_mode=3`. `topk_indices_shape` = (T, index_topk):
  SGLang `c4_topk_indices`, SAS `cmp_sparse_indices` (viewed [T, 1, index_topk]).
Not found in the peers and decided here: the SWA ring (above); per-row window starts/lengths
(`swa_window_start`, `swa_window_lens`), which neither peer stores; `cmp_writes` (peers derive the
count inside `compressor_metadata`); SAS `cu_seqlens_ori_kv` / `cu_seqlens_cmp_kv`, whose decode-time
contents vllm-ascend takes from a device-specific helper, are not produced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

PUBLISHED_RATIOS = (4, 128)  # DeepSeek-V4's C4 and C128; any ratio >= 2 plans the same way
INDEXER_RATIO = 4  # the C4 layers, whose rows also get the lightning indexer's lengths and top-k
NULL_PAGE = 0
PAD_ROW = -1  # boundary_rows, swa_indices
PAD_SLOT = -1  # cmp_slot_mapping
PAD_LOC = NULL_PAGE  # cmp_loc: slot 0 lies in the null page
PAD_POSITION = 0  # cmp_positions

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)


class Dsv4MetadataError(ValueError):
    """A DSV4 verify step (or its configuration) that cannot be planned; the message names the field."""


def _dtype(a: np.ndarray | torch.Tensor) -> str:
    return a.dtype.name if isinstance(a, np.ndarray) else str(a.dtype).removeprefix("torch.")


def _check(name: str, a: np.ndarray | torch.Tensor, dtype: str, shape: tuple[int, ...]) -> None:
    if not isinstance(a, np.ndarray | torch.Tensor):
        raise Dsv4MetadataError(f"{name} must be a numpy array or torch tensor, got {type(a).__name__}")
    if _dtype(a) != dtype or tuple(a.shape) != shape:
        raise Dsv4MetadataError(f"{name} must be {dtype} {list(shape)}, got {_dtype(a)} {list(a.shape)}")


def _cdiv(a: np.ndarray | int, b: int) -> np.ndarray | int:
    return -(-a // b)


@dataclass(frozen=True)
class Dsv4StepConfig:
    """What stays fixed across a deployment's verify steps."""

    num_draft_tokens: int  # N = gamma + 1: most rows a request verifies
    window: int  # W: raw positions a row attends to, itself included
    compress_ratios: tuple[int, ...]  # the compressed ratios the model's layers use (4: C4, with the indexer)
    swa_page_size: int
    swa_ring_size: int  # C: raw-KV ring slots per request
    cmp_page_sizes: Mapping[int, int]  # ratio -> compressed entries per page
    index_topk: int = 0  # needed when 4 is among the ratios
    padding_request_rows: int = 0  # rows per padding request; 0 means N

    def __post_init__(self) -> None:
        n, w = self.num_draft_tokens, self.window
        if n < 1:
            raise Dsv4MetadataError(f"num_draft_tokens must be >= 1, got {n}")
        if w < 1:
            raise Dsv4MetadataError(f"window must be >= 1, got {w}")
        ratios = tuple(self.compress_ratios)
        # The published ratios are 4 and 128; smaller C128-kind ratios plan identically and make
        # boundaries frequent in tests. A ratio of 1 would compress nothing.
        if len(set(ratios)) != len(ratios) or any(r < 2 for r in ratios):
            raise Dsv4MetadataError(f"compress_ratios must be distinct integers >= 2 (DeepSeek-V4 uses "
                                    f"{PUBLISHED_RATIOS}), got {ratios}")
        object.__setattr__(self, "compress_ratios", tuple(sorted(ratios)))
        if self.swa_page_size < 1:
            raise Dsv4MetadataError(f"swa_page_size must be >= 1, got {self.swa_page_size}")
        ring = self.swa_ring_size
        if ring < w + n - 1 or ring % self.swa_page_size:
            raise Dsv4MetadataError(
                f"swa_ring_size must be a multiple of swa_page_size={self.swa_page_size} and at least "
                f"window + N - 1 = {w + n - 1} (a step writes its rows before its first row reads), "
                f"got {ring}")
        sizes = dict(self.cmp_page_sizes)
        if set(sizes) != set(ratios) or any(s < 1 for s in sizes.values()):
            raise Dsv4MetadataError(f"cmp_page_sizes must give a page size >= 1 for each ratio {ratios}, "
                                    f"got {sizes}")
        object.__setattr__(self, "cmp_page_sizes", sizes)
        if INDEXER_RATIO in ratios and self.index_topk < 1:
            raise Dsv4MetadataError(f"index_topk must be >= 1 with C4 layers, got {self.index_topk}")
        if self.padding_request_rows == 0:
            object.__setattr__(self, "padding_request_rows", n)
        if not 1 <= self.padding_request_rows <= n:
            raise Dsv4MetadataError(f"padding_request_rows must be in 1..N={n}, "
                                    f"got {self.padding_request_rows}")

    @property
    def swa_ring_pages(self) -> int:
        return self.swa_ring_size // self.swa_page_size


@dataclass(frozen=True)
class Dsv4PageTables:
    """The real requests' physical pages (host arrays, one row per real request, ids >= 1)."""

    swa: np.ndarray  # int32 [R, swa_ring_pages]: each request's ring pages
    compressed: Mapping[int, np.ndarray]  # ratio -> int32 [R, >= pages needed]: compressed-cache pages


@dataclass(frozen=True)
class Dsv4StepArrays(Generic[ArrayT]):
    """The ratio-independent arrays of a step (B slots, T rows, window W), host or device alike."""

    cu_seqlens_q: ArrayT  # int32 [B + 1]
    seqused_q: ArrayT  # int32 [B]: rows per slot (L; padding rows; 0 for empty slots)
    start_pos: ArrayT  # int32 [B]: committed prefix (0 for padding)
    kv_lens: ArrayT  # int32 [B]: max(P + L, 1)
    positions: ArrayT  # int64 [T]
    row_slot: ArrayT  # int32 [T]: slot of each row
    swa_slot_mapping: ArrayT  # int64 [T]: raw-KV slot each row writes
    swa_window_start: ArrayT  # int32 [T]: max(0, p - W + 1); 0 for padding rows
    swa_window_lens: ArrayT  # int32 [T]: p - start + 1; 0 for padding rows
    swa_indices: ArrayT  # int32 [T, W]: raw-KV slots of the window in position order, then -1
    ori_block_table: ArrayT  # int32 [B, pages]: absolute raw page -> physical ring page

    def __post_init__(self) -> None:
        b, t = self.seqused_q.shape[0], self.positions.shape[0]
        w = self.swa_indices.shape[1] if self.swa_indices.ndim == 2 else -1
        _check("cu_seqlens_q", self.cu_seqlens_q, "int32", (b + 1,))
        for name in ("seqused_q", "start_pos", "kv_lens"):
            _check(name, getattr(self, name), "int32", (b,))
        for name, dtype in (("positions", "int64"), ("row_slot", "int32"), ("swa_slot_mapping", "int64"),
                            ("swa_window_start", "int32"), ("swa_window_lens", "int32")):
            _check(name, getattr(self, name), dtype, (t,))
        _check("swa_indices", self.swa_indices, "int32", (t, w))
        _check("ori_block_table", self.ori_block_table, "int32", (b, self.ori_block_table.shape[-1]))
        if isinstance(self.positions, np.ndarray):
            self._check_host(t)

    def _check_host(self, t: int) -> None:
        # Invariants read the values, so only the host copy is checked: a device check would sync.
        cu = self.cu_seqlens_q
        if cu[0] != 0 or cu[-1] != t or (np.diff(cu) != self.seqused_q).any():
            raise Dsv4MetadataError(f"cu_seqlens_q must be [0, cumsum(seqused_q)] ending at T={t}, got "
                                    f"{cu.tolist()}")
        if (self.kv_lens != np.maximum(self.start_pos + self.seqused_q, 1)).any():
            raise Dsv4MetadataError("kv_lens must be max(start_pos + seqused_q, 1)")
        if t and ((self.row_slot < 0).any() or (self.row_slot >= self.seqused_q.shape[0]).any()):
            raise Dsv4MetadataError("row_slot must name a slot for every row")
        if (self.swa_window_lens > self.swa_indices.shape[1]).any():
            raise Dsv4MetadataError("swa_window_lens must not exceed the window")

    @property
    def actual_seq_lengths_q(self) -> ArrayT:
        """Cumulative row ends (TND `actual_seq_lengths_query`)."""
        return self.cu_seqlens_q[1:]

    @property
    def seqused_kv(self) -> ArrayT:
        return self.kv_lens


@dataclass(frozen=True)
class Dsv4CompressedArrays(Generic[ArrayT]):
    """One compress ratio's arrays (M = num_cmp_rows compressed writes), host or device alike."""

    boundary_rows: ArrayT  # int32 [M]: packed rows that close a block, in packed order, then -1
    cmp_positions: ArrayT  # int64 [M]: the block's first position (its RoPE position), then 0
    cmp_slot_mapping: ArrayT  # int64 [M]: compressed-cache slot written, then -1 (CUDA form)
    cmp_loc: ArrayT  # int32 [M]: the same slots, then 0, a null-page slot (Ascend form)
    cmp_writes: ArrayT  # int32 [B]: floor((P+L)/r) - floor(P/r); 0 for padding
    cmp_kv_lens: ArrayT  # int32 [B]: floor((P+L)/r); 0 for padding
    cmp_residual_k: ArrayT  # int32 [B]: (P+L) % r; 0 for padding
    cmp_visible: ArrayT  # int32 [T]: floor((p+1)/r) entries row p sees; 0 for padding rows
    cmp_block_table: ArrayT  # int32 [B, pages]

    def __post_init__(self) -> None:
        m, b, t = self.boundary_rows.shape[0], self.cmp_writes.shape[0], self.cmp_visible.shape[0]
        for name, dtype in (("boundary_rows", "int32"), ("cmp_positions", "int64"),
                            ("cmp_slot_mapping", "int64"), ("cmp_loc", "int32")):
            _check(name, getattr(self, name), dtype, (m,))
        for name in ("cmp_writes", "cmp_kv_lens", "cmp_residual_k"):
            _check(name, getattr(self, name), "int32", (b,))
        _check("cmp_visible", self.cmp_visible, "int32", (t,))
        _check("cmp_block_table", self.cmp_block_table, "int32", (b, self.cmp_block_table.shape[-1]))
        if isinstance(self.boundary_rows, np.ndarray):
            real = self.boundary_rows >= 0
            if int(real.sum()) != int(self.cmp_writes.sum()) or (real[1:] & ~real[:-1]).any():
                raise Dsv4MetadataError("boundary_rows must list one row per compressed write, then padding")
            if (np.diff(self.boundary_rows[real]) <= 0).any():
                raise Dsv4MetadataError("boundary_rows must be in packed order")
            if ((self.cmp_slot_mapping >= 0) != real).any():
                raise Dsv4MetadataError("cmp_slot_mapping must be padded exactly where boundary_rows is")


@dataclass(frozen=True)
class Dsv4CompressedPlan:
    """One compress ratio's part of a step: its page size, write-row count and arrays."""

    ratio: int
    page_size: int
    num_cmp_rows: int  # min(T, T // r + B)
    host: Dsv4CompressedArrays[np.ndarray]
    device: Dsv4CompressedArrays[torch.Tensor]

    def __post_init__(self) -> None:
        if self.host.boundary_rows.shape[0] != self.num_cmp_rows:
            raise Dsv4MetadataError(f"num_cmp_rows={self.num_cmp_rows} does not match boundary_rows")
        _same_shapes(self.host, self.device)


@dataclass(frozen=True)
class Dsv4VerifyMetadata:
    """Everything the CUDA and Ascend DSV4 backends read about one verify step."""

    config: Dsv4StepConfig
    num_requests: int  # R: real requests, slots 0 .. R-1
    num_slots: int  # B
    tier: int  # T: rows the step runs
    total_rows: int  # rows of the real requests
    max_seqlen_q: int  # N
    max_seqlen_kv: int
    host: Dsv4StepArrays[np.ndarray]
    device: Dsv4StepArrays[torch.Tensor]
    compressed: Mapping[int, Dsv4CompressedPlan]

    def __post_init__(self) -> None:
        if self.host.seqused_q.shape[0] != self.num_slots or self.host.positions.shape[0] != self.tier:
            raise Dsv4MetadataError("host arrays must have num_slots slots and tier rows")
        if not 0 <= self.num_requests <= self.num_slots or not 0 <= self.total_rows <= self.tier:
            raise Dsv4MetadataError("num_requests / total_rows out of range")
        if self.host.swa_indices.shape[1] != self.config.window:
            raise Dsv4MetadataError(f"swa_indices must have window={self.config.window} columns")
        if tuple(self.compressed) != self.config.compress_ratios:
            raise Dsv4MetadataError(f"compressed must hold ratios {self.config.compress_ratios}")
        _same_shapes(self.host, self.device)

    @property
    def ori_win_left(self) -> int:
        return self.config.window - 1

    @property
    def ori_win_right(self) -> int:
        return 0

    @property
    def topk_indices_shape(self) -> tuple[int, int] | None:
        """The C4 top-k buffer `[T, index_topk]`; None without C4 layers."""
        return (self.tier, self.config.index_topk) if INDEXER_RATIO in self.compressed else None

    @property
    def torch_device(self) -> torch.device:
        return self.device.positions.device


def _same_shapes(host: Dsv4StepArrays | Dsv4CompressedArrays, device: Dsv4StepArrays | Dsv4CompressedArrays
                 ) -> None:
    devices = set()
    for field in dataclasses.fields(host):
        h, d = getattr(host, field.name), getattr(device, field.name)
        if not isinstance(h, np.ndarray) or not isinstance(d, torch.Tensor):
            raise Dsv4MetadataError(f"{field.name}: host must be numpy and device torch")
        if tuple(h.shape) != tuple(d.shape) or _dtype(h) != _dtype(d):
            raise Dsv4MetadataError(f"{field.name}: host {_dtype(h)} {list(h.shape)} and device "
                                    f"{_dtype(d)} {list(d.shape)} differ")
        devices.add(d.device)
    if len(devices) > 1:
        raise Dsv4MetadataError(f"device arrays must share one device, got {sorted(map(str, devices))}")


def _to_device(host: Dsv4StepArrays | Dsv4CompressedArrays, device: torch.device):
    """The host arrays on `device`: one copy per dtype, not one per field."""
    names = [f.name for f in dataclasses.fields(host)]
    out: dict[str, torch.Tensor] = {}
    for dtype in {getattr(host, n).dtype for n in names}:
        group = [n for n in names if getattr(host, n).dtype == dtype]
        flat = torch.from_numpy(np.concatenate([getattr(host, n).ravel() for n in group])).to(device)
        sizes = [getattr(host, n).size for n in group]
        for n, part in zip(group, flat.split(sizes), strict=True):
            out[n] = part.view(getattr(host, n).shape)
    return type(host)(**out)


def _frozen(**arrays: np.ndarray) -> dict[str, np.ndarray]:
    for a in arrays.values():
        a.flags.writeable = False
    return arrays


def _slot_lens(lens: np.ndarray, config: Dsv4StepConfig, tier: int, num_slots: int | None) -> np.ndarray:
    """The real requests' row counts, then padding requests carrying the tier's spare rows, then empty
    slots up to `num_slots` (the layout of `dspark.runtime.layout.plan_verify`)."""
    full, rest = divmod(tier - int(lens.sum()), config.padding_request_rows)
    needed = lens.size + full + (1 if rest else 0)
    slots = needed if num_slots is None else num_slots
    if needed > slots:
        raise Dsv4MetadataError(f"num_slots: {lens.size} requests plus {needed - lens.size} padding "
                                f"requests (tier {tier}, {config.padding_request_rows} rows each) exceed "
                                f"{slots} slots")
    out = np.zeros(slots, np.int64)
    out[: lens.size] = lens
    out[lens.size : lens.size + full] = config.padding_request_rows
    if rest:
        out[lens.size + full] = rest
    return out


def _table(name: str, pages: np.ndarray, rows: int, needed: np.ndarray) -> np.ndarray:
    """A real requests' page table, checked to hold the pages they need, none of them the null page."""
    pages = np.asarray(pages)
    if pages.ndim != 2 or pages.shape[0] != rows or not np.issubdtype(pages.dtype, np.integer):
        raise Dsv4MetadataError(f"{name} must be an integer array [R={rows}, pages], got "
                                f"{pages.dtype} {list(pages.shape)}")
    if rows and int(needed.max()) > pages.shape[1]:
        raise Dsv4MetadataError(f"{name} has {pages.shape[1]} pages per request; a request needs "
                                f"{int(needed.max())}")
    used = np.arange(pages.shape[1])[None, :] < needed[:, None]
    if (pages[used] <= NULL_PAGE).any():
        raise Dsv4MetadataError(f"{name}: a real request's pages must be ids >= 1 (page 0 is the null page)")
    return pages.astype(np.int64)


def _padded_table(pages: np.ndarray, needed: np.ndarray, num_slots: int, width: int) -> np.ndarray:
    """`[num_slots, width]` table: each real request's needed pages, the null page elsewhere."""
    out = np.full((num_slots, width), NULL_PAGE, np.int32)
    cols = min(width, pages.shape[1])
    used = np.arange(cols)[None, :] < needed[:, None]
    out[: pages.shape[0], :cols] = np.where(used, pages[:, :cols], NULL_PAGE)
    return out


def plan_dsv4_verify(verify_lens: Sequence[int], prefix_lens: Sequence[int], config: Dsv4StepConfig,
                     page_tables: Dsv4PageTables, *, tier: int | None = None, num_slots: int | None = None,
                     max_kv_len: int | None = None, device: torch.device | str = "cpu") -> Dsv4VerifyMetadata:
    """Plan a DSV4 verify step from its real requests' `verify_lens` (L) and committed `prefix_lens` (P).

    `tier` (T) pads the rows with padding requests (default: the real rows, no padding); `num_slots` (B)
    is the slot count of a captured graph (default: the slots the step needs). `max_kv_len` fixes the
    page tables' width for graph capture (default: this step's longest KV length).
    """
    n, w = config.num_draft_tokens, config.window
    r_count = len(verify_lens)
    if len(prefix_lens) != r_count:
        raise Dsv4MetadataError(f"prefix_lens has {len(prefix_lens)} entries for {r_count} verify_lens")
    lens = np.asarray(verify_lens, np.int64).reshape(r_count)
    prefix = np.asarray(prefix_lens, np.int64).reshape(r_count)
    if r_count and (lens.min() < 1 or lens.max() > n):
        raise Dsv4MetadataError(f"verify_lens must each be in 1..N={n}, got {lens.tolist()}")
    if r_count and prefix.min() < 0:
        raise Dsv4MetadataError(f"prefix_lens must be >= 0, got {prefix.tolist()}")
    total = int(lens.sum())
    tier = total if tier is None else tier
    if tier < total or tier < 1:
        raise Dsv4MetadataError(f"tier {tier} must be >= 1 and hold the step's {total} rows")
    slot_lens = _slot_lens(lens, config, tier, num_slots)
    b = slot_lens.size
    slot_prefix = np.zeros(b, np.int64)
    slot_prefix[:r_count] = prefix
    raw_kv = slot_prefix + slot_lens
    kv_lens = np.maximum(raw_kv, 1)
    longest = int(kv_lens.max())
    if max_kv_len is not None and max_kv_len < longest:
        raise Dsv4MetadataError(f"max_kv_len {max_kv_len} is shorter than the step's longest KV length "
                                f"{longest}")
    width_len = longest if max_kv_len is None else max_kv_len

    ends = np.cumsum(slot_lens)
    cu = np.zeros(b + 1, np.int64)
    cu[1:] = ends
    row_slot = np.repeat(np.arange(b), slot_lens)
    positions = slot_prefix[row_slot] + np.arange(tier) - cu[row_slot]
    real_row = row_slot < r_count

    # Raw K=V: ring slot p % C of the request's ring pages (padding slots: the null page).
    ring_pages, ps, ring = config.swa_ring_pages, config.swa_page_size, config.swa_ring_size
    swa = _table("page_tables.swa", page_tables.swa, r_count, np.full(r_count, ring_pages))
    if swa.shape[1] != ring_pages:
        raise Dsv4MetadataError(f"page_tables.swa must have swa_ring_pages={ring_pages} columns, got "
                                f"{swa.shape[1]}")
    ring_table = np.full((b, ring_pages), NULL_PAGE, np.int64)
    ring_table[:r_count] = swa
    ring_slot = positions % ring
    swa_slot_mapping = ring_table[row_slot, ring_slot // ps] * ps + ring_slot % ps
    win_start = np.where(real_row, np.maximum(positions - w + 1, 0), 0)
    win_lens = np.where(real_row, positions - win_start + 1, 0)
    grid = (win_start[:, None] + np.arange(w)[None, :]) % ring
    swa_indices = ring_table[row_slot[:, None], grid // ps] * ps + grid % ps
    swa_indices = np.where(np.arange(w)[None, :] < win_lens[:, None], swa_indices, PAD_ROW)
    # The Ascend operator pages by absolute position; column j is ring page j % ring_pages.
    ori_cols = max(1, int(_cdiv(width_len, ps)))
    ori_needed = np.where(np.arange(b) < r_count, _cdiv(raw_kv, ps), 0)
    ori_block_table = _padded_table(ring_table[:, np.arange(ori_cols) % ring_pages], ori_needed, b, ori_cols)

    host = Dsv4StepArrays(**_frozen(
        cu_seqlens_q=cu.astype(np.int32), seqused_q=slot_lens.astype(np.int32),
        start_pos=slot_prefix.astype(np.int32), kv_lens=kv_lens.astype(np.int32), positions=positions,
        row_slot=row_slot.astype(np.int32), swa_slot_mapping=swa_slot_mapping,
        swa_window_start=win_start.astype(np.int32), swa_window_lens=win_lens.astype(np.int32),
        swa_indices=swa_indices.astype(np.int32), ori_block_table=ori_block_table))
    dev = torch.device(device)

    compressed = {}
    real_slot = np.arange(b) < r_count
    for ratio in config.compress_ratios:
        cps = config.cmp_page_sizes[ratio]
        entries = np.where(real_slot, raw_kv // ratio, 0)
        needed = _cdiv(entries, cps)
        given = page_tables.compressed.get(ratio, np.zeros((0, 0), np.int32))
        pages = _table(f"page_tables.compressed[{ratio}]", given, r_count, needed[:r_count])
        num_cmp_rows = min(tier, tier // ratio + b)
        closing = np.flatnonzero(real_row & ((positions + 1) % ratio == 0))
        # At most L // r + 1 closing rows per slot, so they always fit num_cmp_rows.
        count = closing.size
        entry = (positions[closing] + 1) // ratio - 1
        slots = pages[row_slot[closing], entry // cps] * cps + entry % cps
        boundary_rows = np.full(num_cmp_rows, PAD_ROW, np.int32)
        boundary_rows[:count] = closing
        cmp_positions = np.full(num_cmp_rows, PAD_POSITION, np.int64)
        cmp_positions[:count] = positions[closing] - ratio + 1
        cmp_slot_mapping = np.full(num_cmp_rows, PAD_SLOT, np.int64)
        cmp_slot_mapping[:count] = slots
        cmp_loc = np.full(num_cmp_rows, PAD_LOC, np.int32)
        cmp_loc[:count] = slots
        table_cols = max(1, int(_cdiv(width_len // ratio, cps)))
        cmp_host = Dsv4CompressedArrays(**_frozen(
            boundary_rows=boundary_rows, cmp_positions=cmp_positions, cmp_slot_mapping=cmp_slot_mapping,
            cmp_loc=cmp_loc,
            cmp_writes=np.where(real_slot, entries - slot_prefix // ratio, 0).astype(np.int32),
            cmp_kv_lens=entries.astype(np.int32),
            cmp_residual_k=np.where(real_slot, raw_kv % ratio, 0).astype(np.int32),
            cmp_visible=np.where(real_row, (positions + 1) // ratio, 0).astype(np.int32),
            cmp_block_table=_padded_table(pages, needed[:r_count], b, table_cols)))
        compressed[ratio] = Dsv4CompressedPlan(ratio=ratio, page_size=cps, num_cmp_rows=num_cmp_rows,
                                               host=cmp_host, device=_to_device(cmp_host, dev))

    return Dsv4VerifyMetadata(
        config=config, num_requests=r_count, num_slots=b, tier=tier, total_rows=total, max_seqlen_q=n,
        max_seqlen_kv=longest, host=host, device=_to_device(host, dev), compressed=compressed)
