"""DeepSeek-V4 (DSV4) layers on an accelerator as tensor ops: what every device's `Dsv4LayerBackend` shares.

`Dsv4DeviceLayers.forward_layer` computes what `dspark.runtime.families.dsv4.cpu_paged.layer_forward`
computes (same weights, same caches, same metadata), written so that a captured device graph can replay it
for any step of its token tier. Subclasses supply the attention and the indexer (`_attend`: the Ascend
operators in `dspark.runtime.families.dsv4.ascend_layers`, the Triton kernel in
`dspark.runtime.families.dsv4.cuda_layers`) and how a captured tier's static arrays are refreshed
(`_refresh_captured`).

What runs where
---------------
On the device, per layer: the query/KV projections and RoPE; the step's raw K=V and the compressor's
per-position rows written into the SWA ring at `swa_slot_mapping` (`index_copy_`); the blocks the step closes,
for every one of the ratio's `num_cmp_rows` padded boundary entries at once: the block's ring rows (and, for
the overlapping C4 compressor, the previous block's) gathered through `ori_block_table` from `cmp_positions`
and the boundary row's slot, pooled, normalised, rotated to the block's first position and scattered to
`cmp_loc`; the same for the indexer's compressor on C4 layers; the indexer's query and head weights; the
subclass's `_attend`; then the output projection and the MLP. On the host: only integers that are fixed per
step or tier (`tier`, `num_cmp_rows`, `max_seqlen_kv`, the configuration) and, for graphs, `update_captured`.

Why no host reads
-----------------
A captured graph replays fixed launches over fixed memory: a value read back to the host while capturing would
be frozen into the graph (and a sync is not allowed while capturing), and in eager mode every read is a
device sync. So nothing here calls `.item()` / `.tolist()` or reads `meta.host` per row: every per-row and
per-entry quantity is a tensor op on the metadata's device arrays, and every shape follows from the tier alone
(T rows; M = num_cmp_rows = min(T, T // r + B) entries per ratio, padding included).

The reference's RoPE (`models.dsv4._rope`) reads the largest position back to the host to extend a host table
and indexes that table, so neither `DSV4Layer.attn_inputs` / `finish_rows` nor `Indexer.query` /
`Compressor.close_block` can run on a device. This module keeps the reference's angles (the same libm values,
`Dsv4RopeTables`, built once for `max_context_len` positions) in device tables and restates the pieces that
rotate with the same primitives (`row_linear`, `rms_norm`) in the same order, so on the CPU they round as the
reference does; `Compressor.project` takes batched device positions and `DSV4Layer.output_rows` (the output
projection and the MLP, after the inverse rotation) reads none, so both are called as they are.
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
negative slots (vLLM's -1 in `cmp_slot_mapping` needs one); one fixed-shape scatter serves every device. A
padding entry gathers row 0's ring (its columns clamped into the table, as are block 0's absent
predecessor's): values thrown away into the null page.

Graphs per token tier
---------------------
`capturing(tier, meta)` gives the tier static copies of the arrays the layers read (`_step_arrays`: here
`positions`, `row_slot`, `swa_slot_mapping`, `ori_block_table`, and per ratio `boundary_rows`,
`cmp_positions`, `cmp_loc`; a subclass adds what its attention reads). Layers called inside read those copies.
The tensors derived from them (RoPE angles, ring slots, masks) are computed once per pass through the layers,
at layer 0, and shared by all layers; inside a capture that pass is the graph's, so a replay recomputes them
from the static copies (a warm-up pass inside `capturing` derives its own, never reused by the graph).
`update_captured(tier, meta)` checks the step on the host and hands (static copy, the step's array) pairs to
the subclass's `_refresh_captured`, which copies them so that the next replay reads them. Enter `capturing`
before the graph capture starts (the copies are made there, outside the graph's memory).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from dspark.runtime.families.dsv4.cpu_paged import Dsv4LayerCache, Dsv4PagedCaches

# The reference's own row-invariant primitives and RoPE angles, so this path rounds as the reference does.
from dspark.runtime.families.dsv4.model import Compressor, DSV4Layer
from dspark.runtime.families.dsv4.ops import Rope, rms_norm, rope_cos_sin, row_linear
from dspark.runtime.families.dsv4.verify_metadata import Dsv4StepConfig, Dsv4VerifyMetadata

if TYPE_CHECKING:
    from dspark.runtime.families.dsv4.target import Dsv4ForCausalLM


class Dsv4DeviceLayersError(ValueError):
    """A layer, cache, step or captured tier that does not fit the layers; the message says which."""


class Dsv4RopeTables:
    """The reference's RoPE angles (`models.dsv4_ops.rope_cos_sin`, computed once on the host with libm) as
    device tables [length, rope_dim / 2] per `Rope` (base, YaRN), gathered by device positions."""

    def __init__(self, ropes: Iterable[Rope], length: int, device: torch.device) -> None:
        positions = torch.arange(length)
        self._tables = {rope: tuple(t.to(device) for t in rope_cos_sin(rope, positions))
                        for rope in set(ropes)}

    def at(self, rope: Rope, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [*positions.shape, rope_dim / 2] at device positions (int64, < length)."""
        cos, sin = self._tables[rope]
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


def flat(cache: Tensor) -> Tensor:
    """A paged cache [pages, page_size, width] as slot-indexed rows [pages * page_size, width] (a view)."""
    return cache.view(-1, cache.shape[-1])


def _write(cache: Tensor | None, slots: Tensor, rows: Tensor) -> None:
    """rows [n, width] into the cache's slots [n] (int64); nothing is skipped, pads have null-page slots."""
    assert cache is not None
    flat(cache).index_copy_(0, slots, rows.to(cache.dtype))


@dataclass(frozen=True)
class _Blocks:
    """Where one ratio's M boundary entries (padding included) read their rows and write their entry."""

    cur: Tensor  # int64 [M, r]: ring slots of the block's positions
    prev: Tensor | None  # int64 [M, r]: the previous block's (overlapping ratio); block 0's clamped, masked
    has_prev: Tensor | None  # bool [M]: block > 0
    loc: Tensor  # int64 [M]: the entry's slot; 0 (null page) for padding
    first: Tensor  # int64 [M]: the block's first position, its RoPE position; 0 for padding


class Dsv4Step:
    """One step's arrays (the metadata's own, or a captured tier's static copies) and the tensors derived from
    them, computed at first use and shared by every layer of the pass.

    In a capture the first use is inside the graph, so a replay recomputes them from the tier's static arrays.
    """

    def __init__(self, owner: Dsv4DeviceLayers, arrays: Mapping[str, Tensor],
                 meta: Dsv4VerifyMetadata) -> None:
        self.owner = owner
        self.arrays = arrays  # name -> device array (per ratio: "<name>.<ratio>"), see `_step_arrays`
        self.meta = meta  # the step they belong to (keeps its device arrays alive while they may be read)
        self._memo: dict[tuple[Any, ...], Any] = {}

    def _once(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def rows_rope(self, rope: Rope) -> tuple[Tensor, Tensor]:
        """cos, sin [T, rope_dim / 2] at the rows' positions."""
        return self._once(("rows", rope), lambda: self.owner.rope.at(rope, self.arrays["positions"]))

    def blocks_rope(self, ratio: int, rope: Rope) -> tuple[Tensor, Tensor]:
        """cos, sin [M, rope_dim / 2] at the first positions of the ratio's blocks."""
        return self._once(("blocks", ratio, rope),
                          lambda: self.owner.rope.at(rope, self.blocks(ratio).first))

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
    """A captured tier: static copies of the arrays the layers read, and the pass derived from them."""

    arrays: dict[str, Tensor]
    step: Dsv4Step | None = None


class Dsv4DeviceLayers(ABC):
    """DSV4 layers over paged caches on a device (`Dsv4LayerBackend`); a subclass supplies the attention.

    `max_context_len` bounds the positions a step may hold (P + L), which sizes the device RoPE tables.
    """

    error: ClassVar[type[ValueError]] = Dsv4DeviceLayersError  # what a subclass raises for misuse

    def __init__(self, caches: Dsv4PagedCaches, max_extend_rows: int, max_context_len: int) -> None:
        cfg = caches.model_config
        self.caches = caches
        self.max_extend_rows = max_extend_rows
        self.max_context_len = max_context_len
        self.device = device = caches.layers[0].swa_kv.device
        self.rope = Dsv4RopeTables({cfg.rope_for(lc.ratio) for lc in caches.layers}, max_context_len, device)
        self.offsets = {r: torch.arange(r, device=device) for r in caches.step_config.compress_ratios}
        self._eager: Dsv4Step | None = None
        self._tiers: dict[int, _Tier] = {}
        self._capture: int | None = None

    @staticmethod
    def allocate_caches(target: Dsv4ForCausalLM, config: Dsv4StepConfig, max_requests: int,
                        max_context_len: int, device: torch.device | str,
                        dtype: torch.dtype | None) -> Dsv4PagedCaches:
        """Zeroed caches on `device` for `max_requests` slots, each slot's pages in order (`slot_page_tables`,
        as `Dsv4PagedCaches.allocate(seed=None)` assigns them), in `dtype` (default: the target's)."""
        with torch.device(device):  # allocated in place, not on the host and then copied
            caches = Dsv4PagedCaches.allocate(target.model.cfg, config, max_requests, max_context_len)
        dtype = target.lm_head.weight.dtype if dtype is None else dtype
        layers = [Dsv4LayerCache(lc.ratio, **{k: t.to(dtype) for k, t in lc.tensors().items()})
                  for lc in caches.layers]
        return dataclasses.replace(caches, layers=layers)

    # ------------------------------------------------------------------------------------------------------
    # what a subclass supplies

    @abstractmethod
    def _attend(self, layer_id: int, layer: DSV4Layer, lc: Dsv4LayerCache, step: Dsv4Step, q: Tensor,
                index: tuple[Tensor, Tensor] | None) -> Tensor:
        """The layer's attention output [T, H, D] for its rotated queries q [T, H, D] over caches that already
        hold the step's writes; C4 layers also get the indexer's rotated query [T, IH, ID] and head weights
        [T, IH] (`index`), and pick their entries here."""

    @abstractmethod
    def _refresh_captured(self, tier: int, meta: Dsv4VerifyMetadata,
                          pairs: Mapping[str, tuple[Tensor, Tensor]]) -> None:
        """Make tier `tier`'s next replay read the step `meta`: `pairs` maps each static array's name to
        (the tier's static copy, the step's array)."""

    def _step_arrays(self, meta: Dsv4VerifyMetadata) -> dict[str, Tensor]:
        """The metadata's device arrays the layers read, by name (per ratio: "<name>.<ratio>"); a subclass
        adds those its attention reads."""
        dev = meta.device
        arrays = {"positions": dev.positions, "row_slot": dev.row_slot,
                  "swa_slot_mapping": dev.swa_slot_mapping, "ori_block_table": dev.ori_block_table}
        for ratio, plan in meta.compressed.items():
            for name in ("boundary_rows", "cmp_positions", "cmp_loc"):
                arrays[f"{name}.{ratio}"] = getattr(plan.device, name)
        return arrays

    def _capture_context(self, tier: int, meta: Dsv4VerifyMetadata) -> AbstractContextManager[Any]:
        """What a subclass sets up around a tier's capture (entered before the tier's static arrays are
        published to the layers)."""
        return nullcontext()

    def _captured_pass_begins(self) -> None:  # noqa: B027  (a hook: most devices have nothing to do here)
        """Called inside `capturing` before a pass's first op reads the tier's static arrays."""

    # ------------------------------------------------------------------------------------------------------
    # per-step state

    def _check(self, meta: Dsv4VerifyMetadata) -> None:
        """Host-side facts only: the step's layout is the caches' and its positions fit the RoPE tables."""
        mine = self.caches.step_config
        # Page size, ring and ratios must be the caches' own; only the row counts may differ (prefill chunks).
        if dataclasses.replace(meta.config, num_draft_tokens=mine.num_draft_tokens,
                               padding_request_rows=mine.padding_request_rows) != mine:
            raise self.error("the step was planned with another cache layout than the caches'")
        if meta.max_seqlen_kv > self.max_context_len:
            raise self.error(f"the step reaches {meta.max_seqlen_kv} positions, more than "
                             f"max_context_len {self.max_context_len}")

    def _step_for(self, layer_id: int, meta: Dsv4VerifyMetadata) -> Dsv4Step:
        if self._capture is not None:
            if meta.tier != self._capture:
                raise self.error(f"capturing tier {self._capture}, got a step of tier {meta.tier}")
            tier = self._tiers[self._capture]
            # Each pass starts at layer 0 and derives its own tensors: the captured pass's are recorded by the
            # graph (recomputed on replay), a warm-up pass's never leak into it.
            if tier.step is None or layer_id == 0:
                self._captured_pass_begins()
                tier.step = Dsv4Step(self, tier.arrays, meta)
            return tier.step
        if self._eager is None or self._eager.meta is not meta:  # the step's first layer
            self._check(meta)
            self._eager = Dsv4Step(self, self._step_arrays(meta), meta)
        return self._eager

    # ------------------------------------------------------------------------------------------------------
    # the layer

    @torch.no_grad()
    def forward_layer(self, layer_id: int, layer: DSV4Layer, h: Tensor, tokens: Tensor,
                      meta: Dsv4VerifyMetadata) -> Tensor:
        """The residual h of the rows' tokens [T] -> the layer's: the step's cache writes, the indexer and
        attention, the output projection and the FFN."""
        lc = self.caches.layers[layer_id]
        if layer.ratio != lc.ratio:
            raise self.error(f"layer {layer_id} has compress ratio {layer.ratio}; its cache {lc.ratio}")
        step = self._step_for(layer_id, meta)
        cfg, eps = layer.cfg, layer.cfg.norm_eps
        pos, swa = step.arrays["positions"], step.arrays["swa_slot_mapping"]  # [T]
        cos, sin = step.rows_rope(layer.rope)  # [T, rope_dim / 2]
        # DSV4Layer.attn_inputs, rotated with the device tables
        x, mixes = layer.attn_input(h)
        qr = rms_norm(row_linear(x, layer.wq_a), layer.q_norm, eps)  # [T, q_lora]
        q = row_linear(qr, layer.wq_b).unflatten(-1, (layer.local_heads, cfg.head_dim))  # this rank's heads
        q = rotate(rms_norm(q, None, eps), cos[:, None], sin[:, None])  # [T, H, D]
        kv = rotate(rms_norm(row_linear(x, layer.wkv), layer.kv_norm, eps), cos, sin)  # [T, D]
        _write(lc.swa_kv, swa, kv)
        if layer.compressor is not None:
            self._compress(layer.compressor, step, x, pos, lc.state_kv, lc.state_score, lc.cmp_kv)
        index = None
        if layer.indexer is not None:
            indexer = layer.indexer
            self._compress(indexer.compressor, step, x, pos, lc.index_state_kv, lc.index_state_score,
                           lc.index_kv)
            self._index_keys_written(layer_id, lc, step.blocks(indexer.compressor.ratio).loc)
            # Indexer.query, rotated with the device tables
            iq = row_linear(qr, indexer.wq_b).unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))
            index = (rotate(iq, cos[:, None], sin[:, None]),  # [T, IH, ID]
                     row_linear(x, indexer.weights_proj) * (cfg.index_head_dim * cfg.index_n_heads) ** -0.5)
        o = self._attend(layer_id, layer, lc, step, q, index)  # [T, H, D]
        # DSV4Layer.finish_rows: V carried rotated channels, so the output is rotated back by its row's angle
        o = rotate(o, cos[:, None], -sin[:, None])
        return layer.output_rows(h, o, tokens, mixes, static_shapes=True)  # summed over the ranks under TP

    def _index_keys_written(self, layer_id: int, lc: Dsv4LayerCache, loc: Tensor) -> None:
        """The step's index keys are in `lc.index_kv` at slots `loc` [M] (padding at the null page): a
        backend that keeps them in another form too (Ascend: int8 with scales) writes it here."""
        return  # the CUDA layers read `index_kv` as it is

    def _compress(self, comp: Compressor, step: Dsv4Step, x: Tensor, pos: Tensor, state_kv: Tensor | None,
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
        kv_flat, score_flat = flat(state_kv), flat(state_score)
        prev_kv = prev_score = None
        if comp.overlap:
            assert blocks.prev is not None
            prev_kv, prev_score = kv_flat[blocks.prev], score_flat[blocks.prev]  # [M, r, width]
        cos, sin = step.blocks_rope(comp.ratio, comp.rope)
        entry = pool_blocks(comp, kv_flat[blocks.cur], score_flat[blocks.cur], prev_kv, prev_score,
                            blocks.has_prev, cos, sin)  # [M, d]
        _write(entries, blocks.loc, entry)

    # ------------------------------------------------------------------------------------------------------
    # graphs

    @contextmanager
    def capturing(self, tier: int, meta: Dsv4VerifyMetadata) -> Iterator[None]:
        """Capture tier `tier` with the step `meta`: layers called inside read the tier's static copies.

        Enter it before the graph capture starts: the copies (and the subclass's buffers) are set up here.
        """
        if meta.tier != tier:
            raise self.error(f"capturing tier {tier} with a step of tier {meta.tier}")
        self._check(meta)
        entry = _Tier({name: t.clone() for name, t in self._step_arrays(meta).items()})
        with self._capture_context(tier, meta):
            self._tiers[tier] = entry
            self._capture = tier
            try:
                yield
            finally:
                self._capture = None

    def update_captured(self, tier: int, meta: Dsv4VerifyMetadata) -> None:
        """Point tier `tier`'s captured graph at the step `meta` (the subclass's `_refresh_captured` says how
        and on which stream)."""
        entry = self._tiers.get(tier)
        if entry is None:
            raise self.error(f"tier {tier} was not captured (captured: {sorted(self._tiers)})")
        self._check(meta)
        new = self._step_arrays(meta)
        pairs = {name: (static, new[name]) for name, static in entry.arrays.items()}
        self._refresh_captured(tier, meta, pairs)


__all__ = ["Dsv4DeviceLayers", "Dsv4DeviceLayersError", "Dsv4RopeTables", "Dsv4Step", "flat", "pool_blocks",
           "rotate"]
