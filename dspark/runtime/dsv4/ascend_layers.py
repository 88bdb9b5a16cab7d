"""DeepSeek-V4 (DSV4) layers on an Ascend NPU: the `Dsv4LayerBackend` around `Dsv4AscendAttention`.

`Dsv4AscendLayers.forward_layer` computes what `dspark.runtime.dsv4.paged.layer_forward` computes (same
weights, same caches, same metadata), written so that a captured NPU graph can replay it for any step of its
token tier.

What runs where
---------------
On the device, on the compute stream, per layer: the query/KV projections and RoPE; the step's raw K=V and
the compressor's per-position rows written into the SWA ring at `swa_slot_mapping` (`index_copy_`); the blocks
the step closes, for every one of the ratio's `num_cmp_rows` padded boundary entries at once: the block's ring
rows (and, for the overlapping C4 compressor, the previous block's) gathered through `ori_block_table` from
`cmp_positions` and the boundary row's slot, pooled, normalised, rotated to the block's first position and
scattered to `cmp_loc`; the same for the indexer's compressor on C4 layers; the indexer's query and head
weights; `Dsv4AscendAttention.attend` (the lightning indexer and sparse shared-KV attention operators); then
the output projection and the MLP. On the host: only integers that are fixed per step or tier (`tier`,
`num_cmp_rows`, `max_seqlen_kv`, the configuration) and, for graphs, `update_captured`.

Why no host reads
-----------------
A captured graph replays fixed launches over fixed memory: a value read back to the host while capturing would
be frozen into the graph (and a sync is not allowed while capturing), and in eager mode every read is a
device sync. So nothing here calls `.item()` / `.tolist()` or reads `meta.host` per row: every per-row and
per-entry quantity is a tensor op on the metadata's device arrays, and every shape follows from the tier alone
(T rows; M = num_cmp_rows = min(T, T // r + B) entries per ratio, padding included).

The reference's RoPE (`models.dsv4._rope`) reads the largest position back to the host to extend a host table
and indexes that table, so neither `DSV4Layer.attn_inputs` / `finish_rows` nor `Indexer.query` /
`Compressor.close_block` can run on an NPU. This module keeps the reference's angles (the same libm values,
`Dsv4RopeTables`, built once for `max_context_len` positions) in device tables and restates the pieces that
rotate with the same primitives (`row_linear`, `rms_norm`, `rowwise_silu`) in the same order, so on the CPU
they round as the reference does; `Compressor.project` takes batched device positions and is called as is.
`pool_blocks` is `Compressor.close_block` for M blocks at once (`Compressor.full`'s batched formula); block 0
of the overlapping compressor has no predecessor, so its overlap half is masked to value 0 with gate -inf, as
`close_block` substitutes, by a tensor mask instead of a host branch. (CPU torch's softmax over the positions
of a batch of blocks rounds differently from one block's, so the entries equal `close_block`'s within about
one ulp, not bitwise.)

Padding entries and the null page
---------------------------------
The boundary arrays of a ratio are padded to M: `boundary_rows` -1, `cmp_positions` 0, `cmp_loc` 0. Every
entry is computed, padding included, and scattered to `cmp_loc`; padding lands in slot 0, which lies in the
null page (page 0), which no real row reads: padding requests' tables point only at it and real rows read
their own pages. This is SGLang's convention for the Ascend backend, whose NPU scatter has no skip for
negative slots (vLLM's -1 in `cmp_slot_mapping` needs one). A padding entry gathers row 0's ring (its columns
clamped into the table, as are block 0's absent predecessor's): values thrown away into the null page.

The indexer's quantisation mode
-------------------------------
The operator is the quantised lightning indexer with query_quant_mode = key_quant_mode = 0 (per token and
head: an int8 query [T, IH, ID] and keys with float16 dequant scales [T, IH] and [blocks, block_size, 1], the
score being scale_q * scale_k * (q . k)). The reference model has no indexer quantisation, so this backend
passes the index query and keys as they are with unit float16 scales (a [T, IH] buffer per tier, one
[blocks, block_size, 1] buffer for every C4 layer): exactly the reference's scores on the operator model. The
device operator documents int8 inputs, so quantising the index query and keys (as the peers' fp8/int8 indexer
caches do) is still needed before this runs on an NPU.

NPU graphs per token tier
-------------------------
`capturing(tier, meta)` extends `Dsv4AscendAttention.capturing`: besides the attention's buffers the tier gets
static copies of the arrays this module reads (`positions`, `row_slot`, `swa_slot_mapping`, `ori_block_table`,
and per ratio `boundary_rows`, `cmp_positions`, `cmp_loc`). The tensors derived from them (RoPE angles, ring
slots, masks) are computed once per step, at its first layer, shared by all layers, and inside a capture that
means inside the graph, so a replay recomputes them from the static copies. `update_captured(tier, meta)`
hands the copies to `Dsv4AscendAttention.update_captured(..., extra=)`: they are written on its update stream
after it waits for the compute stream (a replay still running is never patched) and before the event it
records; the graph's first operation waits for that event (`await_update`, called before this module's first
captured op). Enter `capturing` before the graph capture starts.

Checked in tests/test_dsv4_ascend_layers.py against `paged.layer_forward` on a torch_npu stand-in whose
operators are the CPU models of `dspark.runtime.dsv4.ascend_ops`, with device arrays that refuse host reads
and a fake graph that records and replays: static and compact steps with padding across C4 and small C128-kind
boundaries, multi-step runs with rollback, and graph replays against eager steps. Never run on an NPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dspark.runtime.dsv4.ascend_backend import (
    TORCH_NPU_OPS,
    Dsv4AscendAttention,
    Dsv4AscendBackendError,
    Dsv4AscendOps,
)
from dspark.runtime.dsv4.paged import Dsv4LayerCache, Dsv4PagedCaches
from dspark.runtime.dsv4.verify_metadata import Dsv4StepConfig, Dsv4VerifyMetadata

# The reference's own row-invariant primitives and RoPE angles, so this path rounds as the reference does.
from dspark.runtime.models.dsv4 import (
    Compressor,
    DSV4Layer,
    rms_norm,
    rope_cos_sin,
    row_linear,
    rowwise_silu,
)

if TYPE_CHECKING:
    from dspark.formats.dsv4_config import Dsv4CacheLayout
    from dspark.runtime.dsv4.target import Dsv4ForCausalLM

INDEX_SCALE_DTYPE = torch.float16  # the quantised indexer's dequant scales


class Dsv4RopeTables:
    """The reference's RoPE angles (`models.dsv4.rope_cos_sin`, computed once on the host with libm) as
    device tables [length, rope_dim / 2] per theta, gathered by device positions."""

    def __init__(self, thetas: Iterable[float], rope_dim: int, length: int, device: torch.device) -> None:
        positions = torch.arange(length)
        self._tables = {theta: tuple(t.to(device) for t in rope_cos_sin(theta, rope_dim, positions))
                        for theta in sorted(set(thetas))}

    def at(self, theta: float, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [*positions.shape, rope_dim / 2] at device positions (int64, < length)."""
        cos, sin = self._tables[theta]
        return cos[positions], sin[positions]


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The reference's RoPE (interleaved pairs of the trailing rope_dim channels) with its angles gathered:
    x [..., D], cos, sin [..., rope_dim / 2] broadcasting against x's leading dims. -sin rotates back."""
    rope_dim = 2 * cos.shape[-1]
    nope, rot = x[..., : x.shape[-1] - rope_dim], x[..., x.shape[-1] - rope_dim :]
    a, b = rot[..., 0::2], rot[..., 1::2]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([nope, rot], dim=-1)


def pool_blocks(comp: Compressor, kv: Tensor, score: Tensor, prev_kv: Tensor | None,
                prev_score: Tensor | None, has_prev: Tensor | None, cos: Tensor, sin: Tensor) -> Tensor:
    """`Compressor.close_block` for M blocks at once -> entries [M, d].

    kv, score [M, r, width]: each block's projected rows as `Compressor.project` gave them; for the
    overlapping compressor also prev_kv, prev_score [M, r, width], the previous block's rows, which count only
    where has_prev [M] (bool: block > 0); block 0's are replaced by value 0 and gate -inf, close_block's
    stand-in for the missing predecessor. cos, sin [M, rope_dim / 2]: the angles at each block's first
    position.
    """
    if comp.overlap:
        if prev_kv is None or prev_score is None or has_prev is None:
            raise ValueError("an overlapping compressor pools the previous block's rows too")
        d = comp.out_dim
        keep = has_prev.view(-1, 1, 1)
        prev_kv = torch.where(keep, prev_kv[..., :d], 0.0)
        prev_score = torch.where(keep, prev_score[..., :d], float("-inf"))
        kv = torch.cat([prev_kv, kv[..., d:]], dim=1)  # [M, 2r, d]
        score = torch.cat([prev_score, score[..., d:]], dim=1)
    pooled = (kv * score.softmax(1)).sum(1)  # [M, d]: per channel, softmax over the block's positions
    return rotate(rms_norm(pooled, comp.norm, comp.eps), cos, sin)


def _flat(cache: Tensor) -> Tensor:
    return cache.view(-1, cache.shape[-1])  # [pages * page_size, width]: slot-indexed


def _write(cache: Tensor | None, slots: Tensor, rows: Tensor) -> None:
    """rows [n, width] into the cache's slots [n] (int64); nothing is skipped, pads have null-page slots."""
    assert cache is not None
    _flat(cache).index_copy_(0, slots, rows.to(cache.dtype))


def _step_arrays(meta: Dsv4VerifyMetadata) -> dict[str, Tensor]:
    """The metadata's device arrays this module reads, by name (per ratio: "<name>.<ratio>")."""
    dev = meta.device
    arrays = {"positions": dev.positions, "row_slot": dev.row_slot, "swa_slot_mapping": dev.swa_slot_mapping,
              "ori_block_table": dev.ori_block_table}
    for ratio, plan in meta.compressed.items():
        for name in ("boundary_rows", "cmp_positions", "cmp_loc"):
            arrays[f"{name}.{ratio}"] = getattr(plan.device, name)
    return arrays


@dataclass(frozen=True)
class _Blocks:
    """Where one ratio's M boundary entries (padding included) read their rows and write their entry."""

    cur: Tensor  # int64 [M, r]: ring slots of the block's positions
    prev: Tensor | None  # int64 [M, r]: the previous block's (overlapping ratio); block 0's clamped, masked
    has_prev: Tensor | None  # bool [M]: block > 0
    loc: Tensor  # int64 [M]: the entry's slot; 0 (null page) for padding
    first: Tensor  # int64 [M]: the block's first position, its RoPE position; 0 for padding


class _Step:
    """Tensors derived from one step's arrays, computed at first use and shared by every layer of the step.

    In a capture the first use is inside the graph, so a replay recomputes them from the tier's static arrays.
    """

    def __init__(self, owner: Dsv4AscendLayers, arrays: dict[str, Tensor], meta: Dsv4VerifyMetadata) -> None:
        self.owner = owner
        self.arrays = arrays
        self.meta = meta  # the step they belong to (keeps its device arrays alive while they may be read)
        self._memo: dict[tuple[Any, ...], Any] = {}

    def _once(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def rows_rope(self, theta: float) -> tuple[Tensor, Tensor]:
        """cos, sin [T, rope_dim / 2] at the rows' positions."""
        return self._once(("rows", theta), lambda: self.owner.rope.at(theta, self.arrays["positions"]))

    def blocks_rope(self, ratio: int, theta: float) -> tuple[Tensor, Tensor]:
        """cos, sin [M, rope_dim / 2] at the first positions of the ratio's blocks."""
        return self._once(("blocks", ratio, theta),
                          lambda: self.owner.rope.at(theta, self.blocks(ratio).first))

    def blocks(self, ratio: int) -> _Blocks:
        return self._once(("slots", ratio), lambda: self._make_blocks(ratio))

    def _make_blocks(self, ratio: int) -> _Blocks:
        a, ps = self.arrays, self.owner.caches.step_config.swa_page_size
        table = a["ori_block_table"]  # [B, pages]: absolute page -> ring page
        rows = a[f"boundary_rows.{ratio}"]  # int32 [M], -1 for padding
        first = a[f"cmp_positions.{ratio}"]  # int64 [M]
        # A padding entry takes row 0's slot: its reads are harmless and its entry goes to the null page.
        slot = a["row_slot"][rows.clamp(min=0).long()].long()[:, None]  # [M, 1]
        offsets = self.owner.offsets[ratio]  # [r]

        def ring(start: Tensor) -> Tensor:  # [M] first positions -> [M, r] ring slots
            pos = start[:, None] + offsets
            # Real blocks lie inside the table; the clamp only keeps padding and block 0's predecessor in it.
            page = table[slot, (pos // ps).clamp(0, table.shape[1] - 1)]
            return page.long() * ps + pos % ps

        overlap = ratio == self.owner.caches.model_config.csa_ratio
        return _Blocks(cur=ring(first), prev=ring(first - ratio) if overlap else None,
                       has_prev=first >= ratio if overlap else None, loc=a[f"cmp_loc.{ratio}"].long(),
                       first=first)


@dataclass
class _Tier:
    """A captured tier: static copies of the arrays this module reads, and the step derived from them."""

    arrays: dict[str, Tensor]
    step: _Step | None = None


class Dsv4AscendLayers:
    """DSV4 layers over paged caches on an Ascend NPU (`Dsv4LayerBackend`), attention by the operators.

    `max_context_len` bounds the positions a step may hold (P + L), which sizes the device RoPE tables.
    """

    def __init__(self, caches: Dsv4PagedCaches, attention: Dsv4AscendAttention, max_extend_rows: int,
                 max_context_len: int) -> None:
        cfg = caches.model_config
        ratios = tuple(lc.ratio for lc in caches.layers)
        if attention.layer_ratios != ratios:
            raise Dsv4AscendBackendError(f"the attention was built for layer ratios "
                                         f"{attention.layer_ratios}, the caches hold {ratios}")
        self.caches = caches
        self.attention = attention
        self.max_extend_rows = max_extend_rows
        self.max_context_len = max_context_len
        self.device = device = caches.layers[0].swa_kv.device
        thetas = {cfg.compress_rope_theta if r else cfg.rope_theta for r in ratios}
        self.rope = Dsv4RopeTables(thetas, cfg.rope_dim, max_context_len, device)
        self.offsets = {r: torch.arange(r, device=device) for r in caches.step_config.compress_ratios}
        # Unit dequant scales of the index keys [blocks, block_size, 1], one for all C4 layers (module docs).
        index_kv = next((lc.index_kv for lc in caches.layers if lc.index_kv is not None), None)
        self._key_scale = None if index_kv is None else torch.ones(
            *index_kv.shape[:2], 1, dtype=INDEX_SCALE_DTYPE, device=device)
        self._query_scale: dict[int, Tensor] = {}  # tier -> unit [T, index_n_heads]
        self._eager: _Step | None = None
        self._tiers: dict[int, _Tier] = {}
        self._capture: int | None = None

    @classmethod
    def allocate(cls, target: Dsv4ForCausalLM, layout: Dsv4CacheLayout, config: Dsv4StepConfig,
                 max_requests: int, max_context_len: int, *, device: torch.device | str,
                 dtype: torch.dtype | None = None, ops: Dsv4AscendOps = TORCH_NPU_OPS) -> Dsv4AscendLayers:
        """Zeroed caches on `device` for `max_requests` slots, each slot's pages in order (`slot_page_tables`,
        as `Dsv4PagedCaches.allocate(seed=None)` assigns them), in `dtype` (default: the target's), and the
        attention over them."""
        cfg = target.model.cfg
        with torch.device(device):  # allocated in place, not on the host and then copied
            caches = Dsv4PagedCaches.allocate(cfg, config, max_requests, max_context_len)
        dtype = target.lm_head.weight.dtype if dtype is None else dtype
        layers = [Dsv4LayerCache(lc.ratio, **{k: t.to(dtype) for k, t in lc.tensors().items()})
                  for lc in caches.layers]
        caches = dataclasses.replace(caches, layers=layers)
        attention = Dsv4AscendAttention(cfg.compress_ratios, num_heads=cfg.n_heads, head_dim=cfg.head_dim,
                                        softmax_scale=cfg.head_dim**-0.5, index_num_heads=cfg.index_n_heads,
                                        index_head_dim=cfg.index_head_dim, ops=ops)
        return cls(caches, attention, layout.max_rows_per_request, max_context_len)

    # ------------------------------------------------------------------------------------------------------
    # per-step state

    def _check(self, meta: Dsv4VerifyMetadata) -> None:
        """Host-side facts only: the step's layout is the caches' and its positions fit the RoPE tables."""
        mine = self.caches.step_config
        # Page size, ring and ratios must be the caches' own; only the row counts may differ (prefill chunks).
        if dataclasses.replace(meta.config, num_draft_tokens=mine.num_draft_tokens,
                               padding_request_rows=mine.padding_request_rows) != mine:
            raise Dsv4AscendBackendError("the step was planned with another cache layout than the caches'")
        if meta.max_seqlen_kv > self.max_context_len:
            raise Dsv4AscendBackendError(f"the step reaches {meta.max_seqlen_kv} positions, more than "
                                         f"max_context_len {self.max_context_len}")

    def _query_scale_for(self, tier: int) -> Tensor:
        """The tier's unit query dequant scales [T, index_n_heads], allocated once (outside any capture)."""
        scale = self._query_scale.get(tier)
        if scale is None:
            scale = torch.ones(tier, self.caches.model_config.index_n_heads, dtype=INDEX_SCALE_DTYPE,
                               device=self.device)
            self._query_scale[tier] = scale
        return scale

    def _step_for(self, meta: Dsv4VerifyMetadata) -> _Step:
        if self._capture is not None:
            if meta.tier != self._capture:
                raise Dsv4AscendBackendError(f"capturing tier {self._capture}, got a step of tier "
                                             f"{meta.tier}")
            tier = self._tiers[self._capture]
            if tier.step is None:  # the graph's first layer: wait for update_captured, then read its arrays
                self.attention.await_update()
                tier.step = _Step(self, tier.arrays, meta)
            return tier.step
        if self._eager is None or self._eager.meta is not meta:  # the step's first layer
            self._check(meta)
            self._eager = _Step(self, _step_arrays(meta), meta)
        return self._eager

    # ------------------------------------------------------------------------------------------------------
    # the layer

    @torch.no_grad()
    def forward_layer(self, layer_id: int, layer: DSV4Layer, h: Tensor, meta: Dsv4VerifyMetadata) -> Tensor:
        """h [T, dim] -> [T, dim]: the step's cache writes, the indexer and attention, the layer's MLP."""
        lc = self.caches.layers[layer_id]
        if layer.ratio != lc.ratio:
            raise Dsv4AscendBackendError(f"layer {layer_id} has compress ratio {layer.ratio}; its cache "
                                         f"{lc.ratio}")
        step = self._step_for(meta)
        cfg, eps = layer.cfg, layer.cfg.norm_eps
        pos, swa = step.arrays["positions"], step.arrays["swa_slot_mapping"]  # [T]
        cos, sin = step.rows_rope(layer.theta)  # [T, rope_dim / 2]
        # DSV4Layer.attn_inputs, rotated with the device tables
        x = rms_norm(h, layer.attn_norm, eps)
        qr = rms_norm(row_linear(x, layer.wq_a), layer.q_norm, eps)  # [T, q_lora]
        q = row_linear(qr, layer.wq_b).unflatten(-1, (cfg.n_heads, cfg.head_dim))
        q = rotate(rms_norm(q, None, eps), cos[:, None], sin[:, None])  # [T, H, D]
        kv = rotate(rms_norm(row_linear(x, layer.wkv), layer.kv_norm, eps), cos, sin)  # [T, D]
        _write(lc.swa_kv, swa, kv)
        if layer.compressor is not None:
            self._compress(layer.compressor, step, x, pos, lc.state_kv, lc.state_score, lc.cmp_kv)
        extra: dict[str, Tensor] = {}
        if layer.indexer is not None:
            indexer = layer.indexer
            self._compress(indexer.compressor, step, x, pos, lc.index_state_kv, lc.index_state_score,
                           lc.index_kv)
            # Indexer.query, rotated with the device tables
            iq = row_linear(qr, indexer.wq_b).unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))
            extra = dict(index_query=rotate(iq, cos[:, None], sin[:, None]),  # [T, IH, ID]
                         index_weights=row_linear(x, indexer.weights_proj)
                         * (cfg.index_head_dim * cfg.index_n_heads) ** -0.5,  # [T, IH]
                         query_dequant_scale=self._query_scale_for(meta.tier),
                         key_dequant_scale=self._key_scale)
        o = self.attention.attend(layer_id, q, lc, meta, sinks=layer.attn_sink, **extra)  # [T, H, D]
        # DSV4Layer.finish_rows: V carried rotated channels, so the output is rotated back by its row's angle
        o = rotate(o, cos[:, None], -sin[:, None])
        h = h + row_linear(o.flatten(1), layer.wo)
        x = rms_norm(h, layer.ffn_norm, eps)
        return h + row_linear(rowwise_silu(row_linear(x, layer.w1)) * row_linear(x, layer.w3), layer.w2)

    def _compress(self, comp: Compressor, step: _Step, x: Tensor, pos: Tensor, state_kv: Tensor | None,
                  state_score: Tensor | None, entries: Tensor | None) -> None:
        """Write the step's compressor rows into the ring, then close every block its boundary rows close (and
        compute the padding entries, which go to the null page)."""
        assert state_kv is not None and state_score is not None and entries is not None
        ckv, cscore = comp.project(x, pos)  # [T, width] each
        swa = step.arrays["swa_slot_mapping"]
        _write(state_kv, swa, ckv)
        _write(state_score, swa, cscore)
        # Every row is written before any block is read back: a block may end in this step's own rows.
        blocks = step.blocks(comp.ratio)
        kv_flat, score_flat = _flat(state_kv), _flat(state_score)
        prev_kv = prev_score = None
        if comp.overlap:
            assert blocks.prev is not None
            prev_kv, prev_score = kv_flat[blocks.prev], score_flat[blocks.prev]  # [M, r, width]
        cos, sin = step.blocks_rope(comp.ratio, comp.theta)
        entry = pool_blocks(comp, kv_flat[blocks.cur], score_flat[blocks.cur], prev_kv, prev_score,
                            blocks.has_prev, cos, sin)  # [M, d]
        _write(entries, blocks.loc, entry)

    # ------------------------------------------------------------------------------------------------------
    # graphs

    @contextmanager
    def capturing(self, tier: int, meta: Dsv4VerifyMetadata) -> Iterator[None]:
        """Capture tier `tier` with the step `meta`: layers called inside read the tier's static copies.

        Enter it before the graph capture starts: the copies and the attention's buffers are set up here.
        """
        if meta.tier != tier:
            raise Dsv4AscendBackendError(f"capturing tier {tier} with a step of tier {meta.tier}")
        self._check(meta)
        entry = _Tier({name: t.clone() for name, t in _step_arrays(meta).items()})
        if self._key_scale is not None:
            self._query_scale_for(tier)
        with self.attention.capturing(tier, meta):
            self._tiers[tier] = entry
            self._capture = tier
            try:
                yield
            finally:
                self._capture = None

    def update_captured(self, tier: int, meta: Dsv4VerifyMetadata) -> None:
        """Point tier `tier`'s captured graph at the step `meta`: the attention's buffers and this module's
        static copies, all on the attention's update stream before the event the graph waits on."""
        entry = self._tiers.get(tier)
        if entry is None:
            raise Dsv4AscendBackendError(f"tier {tier} was not captured (captured: {sorted(self._tiers)})")
        self._check(meta)
        new = _step_arrays(meta)
        self.attention.update_captured(tier, meta, extra=[(entry.arrays[k], new[k]) for k in entry.arrays])


__all__ = ["Dsv4AscendLayers", "Dsv4RopeTables", "pool_blocks", "rotate"]
