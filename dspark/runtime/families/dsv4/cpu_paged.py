"""The paged, multi-request DSV4 forward of a verify step on the CPU, driven by `Dsv4VerifyMetadata`.

This is what the `dsv4` family's runtime runs, written as plain torch with a loop per row and per
compressed write: its math is the reference's (`dspark.runtime.families.dsv4.model`, parameters shared with a
`DSV4Model`), its indexing is the metadata's (`dspark.runtime.families.dsv4.verify_metadata`), and its caches
are paged over many requests, so a real row of any step gives the logits `DSV4Model.step` gives for that
request. Every linear layer is the reference's row-invariant one, so a row's result does not depend on the
rows packed with it (static B x N, compact ragged, padding requests or not).

Caches (`Dsv4PagedCaches`, one `Dsv4LayerCache` per layer; Ps = swa_page_size, Cp = cmp_page_sizes[r],
D = head_dim, ID = index_head_dim, coff = 2 for C4 (overlap), 1 for C128)
------------------------------------------------------------------------------------------------------
* `swa_kv` [swa_pages, Ps, D]: raw K=V of position p of a request at its SWA ring slot p % C
  (`swa_slot_mapping`); page 0 is the null page that padding rows write.
* `state_kv`, `state_score` [swa_pages, Ps, coff*D] (ratio > 0): the compressor's per-position projected
  values and gates (ape added), keyed by position in the *same ring slots* as the raw KV (SGLang keeps them
  beside the window the same way). The open block's state is the rows of positions
  [floor(P / r) * r, P) and, for C4, the previous block's rows give the overlap half: nothing else is kept.
* `cmp_kv` [cmp_pages[r], Cp, D] (ratio > 0): the closed entries, entry e of a request at
  `cmp_block_table[b, e // Cp] * Cp + e % Cp`, written at `cmp_slot_mapping` by the step's boundary rows.
* C4 only: `index_state_kv`, `index_state_score` [swa_pages, Ps, 2*ID] (the indexer compressor's rows, same
  ring slots) and `index_kv` [cmp_pages[4], Cp, ID] (its entries, the index keys, at the C4 entry slots).

A boundary row at position p (closing block j = (p + 1) // r - 1) pools the rows of positions
[p - coff*r + 1, p], read through `ori_block_table` (absolute page q // Ps -> its ring page), so the ring
must keep them: C >= coff*r + N - 1 besides the planner's C >= W + N - 1 (`required_ring_size`). With the
published sizes (W = 128 = hca_ratio, csa_ratio 4) that is the planner's own bound.

Rollback is forgetting
----------------------
A step writes all its rows (raw KV, compressor rows, entries closed by its boundary rows) before any row
reads, and nothing is undone when a suffix of the rows is rejected; the request's prefix P just advances
by the commit length. This is exact because:
* the next step starts at P' <= the first rejected position and writes every position it runs, from P' on,
  before reading; a row at position q reads raw KV / compressor rows of positions <= q only, so every stale
  row it could read (positions >= P') has been rewritten by then, and a stale write at position q clobbers
  position q - C < P' - max(W, coff*r) + 1, older than anything still read (C >= max(W, coff*r) + N - 1);
* an entry e written by a rejected row closing its block is only visible to rows at positions
  >= (e + 1) * r - 1 (visibility floor((p + 1) / r)); the first such row of a later step is the one that
  really closes block e, and it rewrites the entry (compressors run before attention) before any row of
  that step reads it. A row that never reaches the block never reads the entry.
No case here needs explicit restoration. The state of committed positions is therefore bitwise the
target-only state (the tests compare it against `DSV4Model.commit`).

Prefill runs through the same forward: a prefill chunk is a step whose request has L rows. The planner takes
L <= num_draft_tokens, so `prefill` plans with a copy of the step config whose num_draft_tokens is the most
rows the ring allows (`max_rows_per_request`: C + 1 - max(W, coff*r)), N for a ring of exactly the bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dspark.formats.dsv4_config import Dsv4Geometry, compressed_ratios, ring_reach
from dspark.runtime.families.dsv4.model import Compressor, DSV4Layer, DSV4Model
from dspark.runtime.families.dsv4.verify_metadata import (
    INDEXER_RATIO,
    NULL_PAGE,
    Dsv4PageTables,
    Dsv4StepConfig,
    Dsv4VerifyMetadata,
    plan_dsv4_verify,
)


class Dsv4PagedError(ValueError):
    """A model, step config, cache or step that do not fit together; the message says which part."""


def _ratios(cfg: Dsv4Geometry) -> tuple[int, ...]:
    return compressed_ratios(cfg.compress_ratios)


def _reach(cfg: Dsv4Geometry) -> int:
    """Positions before and including its own that one row reads back from the ring (window or compressor)."""
    return ring_reach(cfg.window, cfg.compress_ratios, cfg.csa_ratio)


def required_ring_size(cfg: Dsv4Geometry, rows: int) -> int:
    """The least SWA ring size C for steps of up to `rows` rows per request (before page rounding)."""
    return _reach(cfg) + rows - 1


def max_rows_per_request(cfg: Dsv4Geometry, ring_size: int) -> int:
    """The most rows one request may run in a step (a prefill chunk) with a ring of `ring_size` slots."""
    return ring_size + 1 - _reach(cfg)


def check_compatible(cfg: Dsv4Geometry, config: Dsv4StepConfig) -> None:
    """Raise Dsv4PagedError unless steps planned with `config` can run `cfg`'s layers."""
    if config.window != cfg.window:
        raise Dsv4PagedError(f"step config window {config.window} != model window {cfg.window}")
    if tuple(config.compress_ratios) != _ratios(cfg):
        raise Dsv4PagedError(f"step config compress_ratios {config.compress_ratios} != the model's "
                             f"compressed ratios {_ratios(cfg)}")
    if cfg.csa_ratio in _ratios(cfg):
        if cfg.csa_ratio != INDEXER_RATIO:
            raise Dsv4PagedError(f"the metadata plans the indexer on ratio {INDEXER_RATIO}; model "
                                 f"csa_ratio is {cfg.csa_ratio}")
        if config.index_topk != cfg.index_topk:
            raise Dsv4PagedError(f"step config index_topk {config.index_topk} != model {cfg.index_topk}")
    need = required_ring_size(cfg, config.num_draft_tokens)
    if config.swa_ring_size < need:
        raise Dsv4PagedError(f"swa_ring_size {config.swa_ring_size} < {need}: the compressor's rows share "
                             f"the ring, and a boundary row reads back max(W, coff*r) = {_reach(cfg)}")


# --------------------------------------------------------------------------------------------------------
# Caches


@dataclass
class Dsv4LayerCache:
    """One layer's paged caches (see the module docstring for what each holds)."""

    ratio: int
    swa_kv: Tensor  # [swa_pages, Ps, D]
    state_kv: Tensor | None = None  # [swa_pages, Ps, coff*D] (ratio > 0)
    state_score: Tensor | None = None  # [swa_pages, Ps, coff*D]
    cmp_kv: Tensor | None = None  # [cmp_pages[r], Cp, D] (ratio > 0)
    index_state_kv: Tensor | None = None  # [swa_pages, Ps, 2*ID] (C4)
    index_state_score: Tensor | None = None  # [swa_pages, Ps, 2*ID]
    index_kv: Tensor | None = None  # [cmp_pages[4], Cp, ID] (C4)

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), Tensor)}


def cmp_pages_per_request(config: Dsv4StepConfig, ratio: int, max_len: int) -> int:
    """Pages of ratio `ratio`'s compressed entries one request of up to `max_len` positions needs."""
    return max(1, -(-(max_len // ratio) // config.cmp_page_sizes[ratio]))


def slot_page_tables(config: Dsv4StepConfig, max_len: int, slots: Sequence[int]) -> Dsv4PageTables:
    """The page tables of request slots `slots` in caches allocated in order (`allocate(seed=None)`): slot
    b owns pages 1 + b * cols ... (b + 1) * cols of each pool, so a step's tables follow from its slots."""
    idx = np.asarray(list(slots), dtype=np.int32)[:, None]

    def pages(cols: int) -> np.ndarray:
        return (1 + idx * cols + np.arange(cols, dtype=np.int32)[None, :]).astype(np.int32)

    return Dsv4PageTables(swa=pages(config.swa_ring_pages),
                          compressed={r: pages(cmp_pages_per_request(config, r, max_len))
                                      for r in config.compress_ratios})


@dataclass
class Dsv4PagedCaches:
    """Every layer's caches for up to `max_requests` requests of up to `max_len` positions (P + L), and
    a fixed page assignment per request id (`page_tables` hands it to the planner)."""

    model_config: Dsv4Geometry
    step_config: Dsv4StepConfig
    layers: list[Dsv4LayerCache]
    swa_pages: np.ndarray  # int32 [max_requests, ring_pages]: each request's ring pages (ids >= 1)
    cmp_pages: dict[int, np.ndarray]  # ratio -> int32 [max_requests, pages]

    @classmethod
    def allocate(cls, model_config: Dsv4Geometry, step_config: Dsv4StepConfig, max_requests: int,
                 max_len: int, *, seed: int | None = None) -> Dsv4PagedCaches:
        """Zeroed caches; page ids are shuffled by `seed` (None: in order) so tests see non-contiguous pages.
        Page 0 of every pool is the null page."""
        check_compatible(model_config, step_config)
        cfg = model_config
        gen = None if seed is None else np.random.default_rng(seed)

        def assign(rows: int, cols: int) -> np.ndarray:
            ids = np.arange(1, 1 + rows * cols, dtype=np.int32)
            if gen is not None:
                ids = gen.permutation(ids).astype(np.int32)
            return ids.reshape(rows, cols)

        ps, d = step_config.swa_page_size, cfg.head_dim
        swa_pages = assign(max_requests, step_config.swa_ring_pages)
        n_swa = 1 + swa_pages.size
        cmp_pages = {ratio: assign(max_requests, cmp_pages_per_request(step_config, ratio, max_len))
                     for ratio in step_config.compress_ratios}
        layers = []
        for ratio in cfg.compress_ratios:
            lc = Dsv4LayerCache(ratio, torch.zeros(n_swa, ps, d))
            if ratio:
                cps, width = step_config.cmp_page_sizes[ratio], (2 if ratio == cfg.csa_ratio else 1) * d
                lc.state_kv, lc.state_score = torch.zeros(n_swa, ps, width), torch.zeros(n_swa, ps, width)
                lc.cmp_kv = torch.zeros(1 + cmp_pages[ratio].size, cps, d)
            if ratio == cfg.csa_ratio:
                iwidth = 2 * cfg.index_head_dim
                lc.index_state_kv = torch.zeros(n_swa, ps, iwidth)
                lc.index_state_score = torch.zeros(n_swa, ps, iwidth)
                lc.index_kv = torch.zeros(1 + cmp_pages[ratio].size, cps, cfg.index_head_dim)
            layers.append(lc)
        return cls(cfg, step_config, layers, swa_pages, cmp_pages)

    def page_tables(self, requests: Sequence[int]) -> Dsv4PageTables:
        """The planner's page tables for the real requests of a step, in slot order."""
        idx = np.asarray(list(requests), dtype=np.int64)
        return Dsv4PageTables(swa=self.swa_pages[idx],
                              compressed={r: pages[idx] for r, pages in self.cmp_pages.items()})

    def tensors(self) -> dict[str, Tensor]:
        return {f"layers.{i}.{name}": t for i, lc in enumerate(self.layers)
                for name, t in lc.tensors().items()}

    def clone(self) -> Dsv4PagedCaches:
        layers = [Dsv4LayerCache(lc.ratio, **{k: t.clone() for k, t in lc.tensors().items()})
                  for lc in self.layers]
        return dataclasses.replace(self, layers=layers)


# --------------------------------------------------------------------------------------------------------
# Forward


@dataclass(frozen=True)
class Dsv4LayerTrace:
    """What one layer's attention saw and produced in a step (for checks against the Ascend operators)."""

    ratio: int
    q: Tensor  # [T, H, D] RoPE'd queries
    attn_out: Tensor  # [T, H, D] before the inverse RoPE; 0 for padding rows
    index_query: Tensor | None  # [T, IH, ID] (C4)
    index_weights: Tensor | None  # [T, IH] (C4)
    topk: Tensor | None  # int32 [T, index_topk]: the entries row t read, ascending, then -1 (C4)


def _flat(cache: Tensor) -> Tensor:
    return cache.view(-1, cache.shape[-1])  # [pages * page_size, width]: slot-indexed


def _write_rows(cache: Tensor | None, slots: Tensor, rows: Tensor) -> None:
    assert cache is not None
    _flat(cache)[slots] = rows


def _close_blocks(comp: Compressor, meta: Dsv4VerifyMetadata, state_kv: Tensor | None,
                  state_score: Tensor | None, entries: Tensor | None) -> None:
    """Pool every block the step's boundary rows close from the compressor rows in the ring, and write the
    entries at `cmp_slot_mapping` (padding writes, -1, are skipped)."""
    assert state_kv is not None and state_score is not None and entries is not None
    r, host, plan = comp.ratio, meta.host, meta.compressed[comp.ratio].host
    ps = meta.config.swa_page_size
    kv_flat, score_flat, out = _flat(state_kv), _flat(state_score), _flat(entries)

    def ring_slots(b: int, first: int) -> Tensor:
        # positions first .. first + r - 1 of slot b, through its absolute-page table of ring pages
        pos = np.arange(first, first + r)
        return torch.from_numpy(host.ori_block_table[b, pos // ps].astype(np.int64) * ps + pos % ps)

    for m in range(plan.boundary_rows.shape[0]):
        row = int(plan.boundary_rows[m])
        if row < 0:
            break  # boundary rows come first, then padding
        b, p = int(host.row_slot[row]), int(host.positions[row])
        block, first = (p + 1) // r - 1, p - r + 1
        if int(plan.cmp_positions[m]) != first:
            raise Dsv4PagedError(f"cmp_positions[{m}] = {int(plan.cmp_positions[m])}, row {row} closes the "
                                 f"block at {first}")
        cur = ring_slots(b, first)
        prev = ring_slots(b, first - r) if comp.overlap and block > 0 else None
        entry = comp.close_block(block, kv_flat[cur], score_flat[cur],
                                 None if prev is None else kv_flat[prev],
                                 None if prev is None else score_flat[prev])
        out[int(plan.cmp_slot_mapping[m])] = entry


def layer_forward(layer: DSV4Layer, lc: Dsv4LayerCache, h: Tensor, tokens: Tensor, meta: Dsv4VerifyMetadata,
                  trace: list[Dsv4LayerTrace] | None) -> Tensor:
    """The residual h ([T, dim], or [T, hc_mult, dim] streams) of the rows' tokens [T] -> the layer's: write
    the step's rows into the caches, attend row by row, then the output projection and the FFN."""
    cfg, host, dev = layer.cfg, meta.host, meta.device
    pos = dev.positions
    x, q, qr, kv, mixes = layer.attn_inputs(h, pos)
    swa_slots = dev.swa_slot_mapping
    _write_rows(lc.swa_kv, swa_slots, kv)
    iq = weights = None
    if layer.compressor is not None:
        ckv, cscore = layer.compressor.project(x, pos)  # [T, coff*D] each
        _write_rows(lc.state_kv, swa_slots, ckv)
        _write_rows(lc.state_score, swa_slots, cscore)
        _close_blocks(layer.compressor, meta, lc.state_kv, lc.state_score, lc.cmp_kv)
    if layer.indexer is not None:
        ikv, iscore = layer.indexer.compressor.project(x, pos)
        _write_rows(lc.index_state_kv, swa_slots, ikv)
        _write_rows(lc.index_state_score, swa_slots, iscore)
        _close_blocks(layer.indexer.compressor, meta, lc.index_state_kv, lc.index_state_score, lc.index_kv)
        iq, weights = layer.indexer.query(x, qr, pos)

    n_rows = tokens.shape[0]
    o = torch.zeros(n_rows, layer.local_heads, cfg.head_dim)  # this rank's query heads (all, unsharded)
    topk = None if layer.indexer is None else torch.full((n_rows, cfg.index_topk), -1, dtype=torch.int32)
    swa_flat = _flat(lc.swa_kv)
    plan = None if not layer.ratio else meta.compressed[layer.ratio]
    for t in range(n_rows):
        if host.row_slot[t] >= meta.num_requests:
            continue  # padding: no window, no entries, so the sink takes all and the output is 0
        keys = swa_flat[dev.swa_indices[t, : host.swa_window_lens[t]].long()]  # window, position order
        if plan is not None and lc.cmp_kv is not None:
            visible = int(plan.host.cmp_visible[t])
            e = np.arange(visible)
            table = plan.host.cmp_block_table[host.row_slot[t]]
            slots = torch.from_numpy(table[e // plan.page_size].astype(np.int64) * plan.page_size
                                     + e % plan.page_size)
            entries = _flat(lc.cmp_kv)[slots]  # [visible, D]
            if layer.indexer is not None and visible:
                assert iq is not None and weights is not None and lc.index_kv is not None and topk is not None
                chosen = layer.indexer.select(iq[t], weights[t], _flat(lc.index_kv)[slots])
                topk[t, : chosen.numel()] = chosen.to(torch.int32)
                entries = entries[chosen]
            keys = torch.cat([keys, entries])
        o[t] = layer.attend_row(q[t], keys)
    if trace is not None:
        trace.append(Dsv4LayerTrace(layer.ratio, q, o, iq, weights, topk))
    return layer.finish_rows(h, o, pos, tokens, mixes)


@torch.no_grad()
def forward_verify(model: DSV4Model, tokens: Tensor | Sequence[int], meta: Dsv4VerifyMetadata,
                   caches: Dsv4PagedCaches, *, trace: list[Dsv4LayerTrace] | None = None) -> Tensor:
    """Run a planned step: tokens [T] (one per packed row; any value on padding rows) -> logits [T, vocab],
    row t predicting position positions[t] + 1 of its request (padding rows' logits mean nothing). Writes the
    caches (padding rows only into the null pages); `trace`, when a list, receives one Dsv4LayerTrace per
    layer. CPU only: the caches and `meta.device` arrays must be CPU tensors."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.shape != (meta.tier,):
        raise Dsv4PagedError(f"tokens must be [T={meta.tier}], got {list(tokens.shape)}")
    if meta.config != caches.step_config:
        # page size, ring and ratios must be the caches' own; only the row count may differ (prefill)
        if dataclasses.replace(meta.config, num_draft_tokens=caches.step_config.num_draft_tokens,
                               padding_request_rows=caches.step_config.padding_request_rows
                               ) != caches.step_config:
            raise Dsv4PagedError("the step was planned with another cache layout than the caches'")
    check_compatible(model.cfg, meta.config)
    h = model.embed_tokens(tokens)
    for layer, lc in zip(model.layers, caches.layers, strict=True):
        h = layer_forward(layer, lc, h, tokens, meta, trace)
    return model.lm_head(h)


def run_step(model: DSV4Model, caches: Dsv4PagedCaches, requests: Sequence[int], prefix_lens: Sequence[int],
             rows: Sequence[Sequence[int]], *, config: Dsv4StepConfig | None = None, tier: int | None = None,
             num_slots: int | None = None, trace: list[Dsv4LayerTrace] | None = None,
             ) -> tuple[Dsv4VerifyMetadata, list[Tensor]]:
    """Plan and run one step: request `requests[i]` (a cache id) runs the tokens `rows[i]` at positions
    prefix_lens[i] ... Returns the metadata and each request's logits [len(rows[i]), vocab]."""
    config = caches.step_config if config is None else config
    lens = [len(r) for r in rows]
    meta = plan_dsv4_verify(lens, prefix_lens, config, caches.page_tables(requests), tier=tier,
                            num_slots=num_slots)
    tokens = torch.zeros(meta.tier, dtype=torch.long)
    if lens:
        tokens[: meta.total_rows] = torch.tensor([tok for r in rows for tok in r], dtype=torch.long)
    logits = forward_verify(model, tokens, meta, caches, trace=trace)
    cu = meta.host.cu_seqlens_q
    return meta, [logits[cu[i] : cu[i + 1]] for i in range(len(rows))]


def prefill_config(cfg: Dsv4Geometry, config: Dsv4StepConfig) -> Dsv4StepConfig:
    """`config` with num_draft_tokens raised to the most rows a request may run with its ring."""
    rows = max_rows_per_request(cfg, config.swa_ring_size)
    return dataclasses.replace(config, num_draft_tokens=rows, padding_request_rows=0)


def prefill(model: DSV4Model, caches: Dsv4PagedCaches, requests: Sequence[int],
            prompts: Sequence[Sequence[int]], *, chunk: int | None = None) -> list[Tensor]:
    """Prefill several requests (from position 0) in chunks of up to `chunk` rows (default and at most
    `max_rows_per_request`), all requests packed into each step. -> each prompt's logits [len, vocab]."""
    config = prefill_config(model.cfg, caches.step_config)
    chunk = config.num_draft_tokens if chunk is None else chunk
    if not 1 <= chunk <= config.num_draft_tokens:
        raise Dsv4PagedError(f"chunk must be in 1..{config.num_draft_tokens} for this ring, got {chunk}")
    done = [0] * len(prompts)
    out: list[list[Tensor]] = [[] for _ in prompts]
    while True:
        live = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        if not live:
            break
        rows = [list(prompts[i][done[i] : done[i] + chunk]) for i in live]
        _, logits = run_step(model, caches, [requests[i] for i in live], [done[i] for i in live], rows,
                             config=config)
        for i, part in zip(live, logits, strict=True):
            out[i].append(part)
            done[i] += part.shape[0]
    return [torch.cat(parts) if parts else torch.zeros(0, model.cfg.vocab_size) for parts in out]


__all__ = [
    "NULL_PAGE",
    "Dsv4LayerCache",
    "Dsv4LayerTrace",
    "Dsv4PagedCaches",
    "Dsv4PagedError",
    "check_compatible",
    "cmp_pages_per_request",
    "forward_verify",
    "max_rows_per_request",
    "prefill",
    "prefill_config",
    "required_ring_size",
    "run_step",
    "slot_page_tables",
]
