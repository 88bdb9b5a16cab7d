"""Ascend attention for DeepSeek-V4 (DSV4) layers: the lightning indexer, then sparse shared-KV attention.

What a generated DSV4 Ascend runner calls per layer, in the peers' order: for C4 layers the (quantised)
lightning indexer fills the tier's top-k buffer, then `npu_sparse_attn_sharedkv` reads the window cache, the
compressed cache and, for C4, that top-k. `torch_npu` is imported only when the backend is constructed
(installed elsewhere it breaks `import torch`); the CPU models in
`dspark.runtime.families.dsv4.ascend_op_models` stand in for the operators in tests.

Operators and arguments (checked against the peers' call sites and the operators' registered schemas)
--------------------------------------------------------------------------------------------------------
* SAS: `npu_sparse_attn_sharedkv(q, *, ori_kv, cmp_kv, ori_sparse_indices, cmp_sparse_indices,
  ori_block_table, cmp_block_table, cu_seqlens_q, seqused_kv, sinks, metadata, softmax_scale, cmp_ratio,
  ori_mask_mode=4, cmp_mask_mode=3, ori_win_left, ori_win_right, layout_q="TND", layout_kv="PA_ND") -> (out,
  lse)`: vllm-project/vllm-ascend `vllm_ascend/attention/dsa_v1.py` `_forward_attention`
  (`torch.ops._C_ascend`, schema in `csrc/torch_binding.cpp`), sgl-project/sglang
  `python/sglang/srt/hardware_backend/npu/attention/ascend_dsv4_backend.py` `_forward_dense` /
  `_forward_compressed` (`torch.ops.custom`, from sgl-kernel-npu), and the operator page documenting
  `torch_npu.npu_sparse_attn_sharedkv`. `cmp_ratio` is max(ratio, 1) as vllm-ascend passes it.
* Its tiling plan: `npu_sparse_attn_sharedkv_metadata(num_heads_q, num_heads_kv, head_dim, *, cu_seqlens_q,
  seqused_kv, batch_size, max_seqlen_q, max_seqlen_kv, cmp_topk, cmp_ratio, ori_mask_mode, cmp_mask_mode,
  ori_win_left, ori_win_right, layout_q, layout_kv, has_ori_kv, has_cmp_kv, device) -> int32 [1024]`, an
  AI-CPU operator both peers run once per step and kind (window / C4 / C128), not once per layer (vllm-ascend
  `_build_sas_metadata`, SGLang `_kernel_metadata_from_parts`).
* Indexer: the DSV4 peers call the quantised lightning indexer, which alone takes `cmp_ratio` (the bf16
  `npu_lightning_indexer` schemas in torch_npu / vllm-ascend / sgl-kernel-npu have none): SGLang
  `torch.ops.custom.npu_quant_lightning_indexer` (`_forward_npu_fused`), vllm-ascend
  `torch.ops._C_ascend.npu_vllm_quant_lightning_indexer` (`models/deepseek_v4/indexer.py` `select_topk`),
  same arguments: query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode=0,
  key_quant_mode=0, actual_seq_lengths_query (cumulative ends), actual_seq_lengths_key (raw KV lengths),
  block_table (C4 table), metadata, layout_query="TND", layout_key="PA_BSND", sparse_count=index_topk,
  sparse_mode=3, cmp_ratio=4. Its tiling plan comes from `npu_[vllm_]quant_lightning_indexer_metadata`, once
  per step.
`Dsv4AscendOps` names where to find them: `torch_npu` (the default; the operator page's prototype),
`SGLANG_OPS` (torch.ops.custom) or `VLLM_ASCEND_OPS` (torch.ops._C_ascend).

Lengths are device tensors, read by the kernels, never by the host
-----------------------------------------------------------------
Unlike `npu_fused_infer_attention_score` (whose `actual_seq_lengths*` are host int lists baked into each
launched task, hence `AscendFusedAttention`'s task-group updates), every length argument of these operators
is `Tensor?` in their schemas: the kernels and the AI-CPU tiling operators read `cu_seqlens_q`, `seqused_kv`
and the tables from device memory. So the backend passes the metadata's *device* arrays
(`meta.device.cu_seqlens_q`, `kv_lens` (>= 1, padding slots included, as the planner gives them),
`ori_block_table`, `cmp_block_table`) and takes from the host side only the integers the tiling operators
want (`batch_size` = slots, `max_seqlen_q` = N, `max_seqlen_kv`). It never reads a device tensor back. All of
it is built once per step (at the step's first layer) and shared, object for object, by every layer.

NPU graphs per token tier
-------------------------
Because the kernels read their lengths from memory, a captured graph is refreshed by rewriting the memory it
reads, not by re-issuing tasks: `capturing(tier, meta)` gives the tier its own static copies of the step
arrays, its own tiling-plan buffers (one per layer kind) and its own top-k buffer `[T, index_topk]`, which
every captured layer of the tier shares; `update_captured(tier, meta)` copies the next step's device arrays
into them and recomputes the tiling plans into them, on an update stream that first waits for the compute
stream (so a replay of the tier still running is never patched), then records the tier's event, which the
graph waits on before its first operator (as `AscendFusedAttention` does). Layer code whose own captured ops
read step arrays too (`dspark.runtime.families.dsv4.ascend_layers`) hands its static copies to
`update_captured(..., extra=)` and calls `await_update()` before its first op, so the one event covers them.
None of these operators has a workspace query or an `.out` variant in its schema, so there is no per-tier
workspace: the per-tier resources are the buffers above. Enter `capturing` *before* the graph capture begins
(its buffer set-up must not be recorded), e.g. `with attn.capturing(T, meta), torch.npu.graph(g): model(...)`.
Steps replayed on a tier must be planned with its slot count and page-table widths
(`plan_dsv4_verify(..., num_slots=B, max_kv_len=L)`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dspark.runtime.attention.ascend import import_torch_npu
from dspark.runtime.families.dsv4.verify_metadata import INDEXER_RATIO, Dsv4VerifyMetadata

if TYPE_CHECKING:
    from dspark.runtime.families.dsv4.cpu_paged import Dsv4LayerCache

BAND = 4  # ori_mask_mode: the sliding window
RIGHT_DOWN_CAUSAL = 3  # cmp_mask_mode / sparse_mode
INDEXER = "indexer"  # key of the indexer's tiling plan beside the per-ratio SAS plans


class Dsv4AscendBackendError(ValueError):
    """A layer, cache or step that does not fit the backend (or a captured tier); the message says which."""


@dataclass(frozen=True)
class Dsv4AscendOps:
    """Where the operators live: `namespace` "torch_npu" (the module) or a `torch.ops` namespace name."""

    namespace: str = "torch_npu"
    sparse_attn: str = "npu_sparse_attn_sharedkv"
    sparse_attn_metadata: str = "npu_sparse_attn_sharedkv_metadata"
    indexer: str = "npu_quant_lightning_indexer"
    indexer_metadata: str = "npu_quant_lightning_indexer_metadata"


TORCH_NPU_OPS = Dsv4AscendOps()
SGLANG_OPS = Dsv4AscendOps(namespace="custom")  # sgl-kernel-npu / ops-transformer custom_ops
VLLM_ASCEND_OPS = Dsv4AscendOps(namespace="_C_ascend", indexer="npu_vllm_quant_lightning_indexer",
                                indexer_metadata="npu_vllm_quant_lightning_indexer_metadata")


@dataclass
class _StepArgs:
    """The operators' per-step arguments, shared by every layer of the step (or of a captured tier)."""

    meta: Dsv4VerifyMetadata  # the step they were built for (kept alive while its arrays may be read)
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    actual_seq_lengths_q: torch.Tensor  # int32 [B]: cu_seqlens_q[1:], one view for all layers
    seqused_kv: torch.Tensor  # int32 [B], >= 1
    ori_block_table: torch.Tensor  # int32 [B, pages]
    swa_indices: torch.Tensor | None  # int32 [T, 1, W] (window-only layers through explicit slots)
    cmp_block_table: dict[int, torch.Tensor]  # ratio -> int32 [B, pages]
    tiling: dict[int | str, torch.Tensor] = field(default_factory=dict)  # layer ratio / INDEXER -> [1024]
    topk: torch.Tensor | None = None  # int32 [T, index_topk]
    topk_view: torch.Tensor | None = None  # [T, 1, index_topk]: what SAS reads
    sas_base: dict[int, dict[str, Any]] = field(default_factory=dict)  # layer ratio -> SAS kwargs
    indexer_base: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Tier:
    """A captured tier: its static argument buffers, its event, and whether the graph already waits on it."""

    args: _StepArgs
    event: Any
    waits: bool = False


def _paged(cache: torch.Tensor | None, name: str) -> torch.Tensor:
    """A paged cache as the operators take it, [blocks, block_size, KV_N = 1, D] (a view, never a copy)."""
    if cache is None:
        raise Dsv4AscendBackendError(f"the layer cache has no {name}")
    if cache.ndim == 3:
        return cache.unsqueeze(2)
    if cache.ndim != 4:
        raise Dsv4AscendBackendError(f"{name} must be [blocks, block_size, (1,) D], got {list(cache.shape)}")
    return cache


class Dsv4AscendAttention:
    """DSV4 attention on an Ascend NPU: per layer the indexer (C4), then sparse shared-KV attention.

    `layer_ratios` is the model's compress ratio per layer (0: window only, 4: C4 with the indexer, 128:
    C128), known up front so each step's tiling plans are built for every kind at once (never inside a
    captured graph).
    `window_via_indices` passes the window of window-only layers as explicit slots (`swa_indices` as
    `ori_sparse_indices`, vllm-ascend's DSpark path) besides the block table.
    """

    def __init__(self, layer_ratios: Sequence[int], *, num_heads: int, head_dim: int, softmax_scale: float,
                 index_num_heads: int = 0, index_head_dim: int = 0, ops: Dsv4AscendOps = TORCH_NPU_OPS,
                 window_via_indices: bool = False) -> None:
        self._torch_npu = import_torch_npu()
        self.layer_ratios = tuple(int(r) for r in layer_ratios)
        if any(r < 0 or r == 1 for r in self.layer_ratios):
            raise Dsv4AscendBackendError(f"layer_ratios must be 0 (window only) or a compress ratio >= 2, "
                                         f"got {self.layer_ratios}")
        self.kinds = tuple(sorted(set(self.layer_ratios)))
        if INDEXER_RATIO in self.kinds and (index_num_heads < 1 or index_head_dim < 1):
            raise Dsv4AscendBackendError("C4 layers need index_num_heads and index_head_dim for the indexer")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.softmax_scale = softmax_scale
        self.index_num_heads = index_num_heads
        self.index_head_dim = index_head_dim
        self.window_via_indices = window_via_indices
        self.ops = ops
        self._sas = self._resolve(ops.sparse_attn)
        self._sas_metadata = self._resolve(ops.sparse_attn_metadata)
        self._indexer = self._indexer_metadata = None
        if INDEXER_RATIO in self.kinds:
            self._indexer = self._resolve(ops.indexer)
            self._indexer_metadata = self._resolve(ops.indexer_metadata)
        self._eager: _StepArgs | None = None  # the current eager step's arguments
        self._topk: dict[int, torch.Tensor] = {}  # tier -> [T, index_topk], allocated once per tier
        self._tiers: dict[int, _Tier] = {}
        self._capture: int | None = None
        self._update_stream: Any = None

    def _resolve(self, name: str) -> Any:
        """The operator `name` in the configured namespace; a clear error if its package lacks it."""
        ns = self.ops.namespace
        where = self._torch_npu if ns == "torch_npu" else getattr(torch.ops, ns)
        try:
            return getattr(where, name)
        except (AttributeError, RuntimeError) as err:
            source = "torch_npu" if ns == "torch_npu" else f"torch.ops.{ns}"
            raise RuntimeError(f"{source} has no operator {name}: install the package that registers the "
                               f"DSV4 operators (sgl-kernel-npu for torch.ops.custom, vllm-ascend for "
                               f"torch.ops._C_ascend) or pick another Dsv4AscendOps") from err

    # ------------------------------------------------------------------------------------------------------
    # per-step arguments

    def _topk_buffer(self, meta: Dsv4VerifyMetadata) -> torch.Tensor | None:
        if INDEXER_RATIO not in self.kinds:
            return None
        buf = self._topk.get(meta.tier)
        if buf is None:
            buf = torch.full((meta.tier, meta.config.index_topk), -1, dtype=torch.int32,
                             device=meta.torch_device)
            self._topk[meta.tier] = buf
        return buf

    def _tiling(self, meta: Dsv4VerifyMetadata, args: _StepArgs) -> dict[int | str, torch.Tensor]:
        """Run the tiling operators for every layer kind: their lengths are `args`' device tensors, their
        integers come from the host side of `meta`."""
        device = str(meta.torch_device)
        common = dict(num_heads_q=self.num_heads, num_heads_kv=1, head_dim=self.head_dim,
                      cu_seqlens_q=args.cu_seqlens_q, seqused_kv=args.seqused_kv, batch_size=meta.num_slots,
                      max_seqlen_q=meta.max_seqlen_q, max_seqlen_kv=meta.max_seqlen_kv, ori_mask_mode=BAND,
                      cmp_mask_mode=RIGHT_DOWN_CAUSAL, ori_win_left=meta.ori_win_left,
                      ori_win_right=meta.ori_win_right, layout_q="TND", layout_kv="PA_ND", has_ori_kv=True,
                      device=device)
        plans: dict[int | str, torch.Tensor] = {}
        for ratio in self.kinds:
            topk = meta.config.index_topk if ratio == INDEXER_RATIO else 0
            plans[ratio] = self._sas_metadata(**common, cmp_topk=topk, cmp_ratio=max(ratio, 1),
                                              has_cmp_kv=ratio > 0)
        if self._indexer_metadata is not None:
            plans[INDEXER] = self._indexer_metadata(
                num_heads_q=self.index_num_heads, num_heads_k=1, head_dim=self.index_head_dim,
                query_quant_mode=0, key_quant_mode=0, actual_seq_lengths_query=args.actual_seq_lengths_q,
                actual_seq_lengths_key=args.seqused_kv, batch_size=meta.num_slots,
                max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_kv, layout_query="TND",
                layout_key="PA_BSND",
                sparse_count=meta.config.index_topk, sparse_mode=RIGHT_DOWN_CAUSAL, cmp_ratio=INDEXER_RATIO,
                device=device)
        return plans

    def _check_ratios(self, meta: Dsv4VerifyMetadata) -> None:
        missing = [r for r in self.kinds if r and r not in meta.compressed]
        if missing:
            raise Dsv4AscendBackendError(f"the step was planned without compress ratios {missing} that the "
                                         f"layers use; it has {tuple(meta.compressed)}")

    def _build(self, meta: Dsv4VerifyMetadata, *, static: bool) -> _StepArgs:
        """The step's arguments: the metadata's own device arrays (eager) or static copies (a tier)."""
        self._check_ratios(meta)
        dev = meta.device

        def own(t: torch.Tensor) -> torch.Tensor:
            return t.clone() if static else t

        cu = own(dev.cu_seqlens_q)
        swa = None
        if self.window_via_indices and 0 in self.kinds:
            swa = own(dev.swa_indices).unsqueeze(1)
        args = _StepArgs(meta=meta, cu_seqlens_q=cu, actual_seq_lengths_q=cu[1:], seqused_kv=own(dev.kv_lens),
                         ori_block_table=own(dev.ori_block_table), swa_indices=swa,
                         cmp_block_table={r: own(meta.compressed[r].device.cmp_block_table)
                                          for r in self.kinds if r})
        args.tiling = self._tiling(meta, args)
        if static:
            # A tier owns its top-k buffer outright; eager steps share the tier-sized one.
            args.topk = torch.full((meta.tier, meta.config.index_topk), -1, dtype=torch.int32,
                                   device=meta.torch_device) if INDEXER_RATIO in self.kinds else None
        else:
            args.topk = self._topk_buffer(meta)
        args.topk_view = None if args.topk is None else args.topk.unsqueeze(1)
        for ratio in self.kinds:
            base: dict[str, Any] = dict(
                ori_block_table=args.ori_block_table, cu_seqlens_q=args.cu_seqlens_q,
                seqused_kv=args.seqused_kv,
                metadata=args.tiling[ratio], softmax_scale=self.softmax_scale, cmp_ratio=max(ratio, 1),
                ori_mask_mode=BAND, ori_win_left=meta.ori_win_left, ori_win_right=meta.ori_win_right,
                layout_q="TND", layout_kv="PA_ND")
            if ratio == 0 and args.swa_indices is not None:
                base["ori_sparse_indices"] = args.swa_indices
            if ratio:
                base.update(cmp_block_table=args.cmp_block_table[ratio], cmp_mask_mode=RIGHT_DOWN_CAUSAL)
            if ratio == INDEXER_RATIO:
                base["cmp_sparse_indices"] = args.topk_view
            args.sas_base[ratio] = base
        if INDEXER_RATIO in self.kinds:
            args.indexer_base = dict(
                query_quant_mode=0, key_quant_mode=0, actual_seq_lengths_query=args.actual_seq_lengths_q,
                actual_seq_lengths_key=args.seqused_kv, block_table=args.cmp_block_table[INDEXER_RATIO],
                metadata=args.tiling[INDEXER], layout_query="TND", layout_key="PA_BSND",
                sparse_count=meta.config.index_topk, sparse_mode=RIGHT_DOWN_CAUSAL, cmp_ratio=INDEXER_RATIO)
        return args

    def _args_for(self, meta: Dsv4VerifyMetadata) -> _StepArgs:
        if self._capture is not None:
            if meta.tier != self._capture:
                raise Dsv4AscendBackendError(f"capturing tier {self._capture}, got a step of tier "
                                             f"{meta.tier}")
            return self._tiers[self._capture].args
        if self._eager is None or self._eager.meta is not meta:  # the step's first layer
            self._eager = self._build(meta, static=False)
        return self._eager

    # ------------------------------------------------------------------------------------------------------
    # graphs

    @contextmanager
    def capturing(self, tier: int, meta: Dsv4VerifyMetadata) -> Iterator[None]:
        """Capture tier `tier` with the step `meta`: layers called inside read the tier's static buffers.

        Enter it before the graph capture starts: the buffers are set up (their tiling plans computed) here.
        """
        if meta.tier != tier:
            raise Dsv4AscendBackendError(f"capturing tier {tier} with a step of tier {meta.tier}")
        self._tiers[tier] = _Tier(self._build(meta, static=True), torch.npu.ExternalEvent())
        self._capture = tier
        try:
            yield
        finally:
            self._capture = None

    def update_captured(self, tier: int, meta: Dsv4VerifyMetadata,
                        extra: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
        """Point tier `tier`'s captured graph at the step `meta`: its lengths, tables and tiling plans.

        The update is ordered after everything already queued on the compute stream (the tier's previous
        replay included), and the graph's first operator waits for the event recorded at its end. `extra`
        holds (static buffer, this step's array) pairs that the caller's own captured ops read (the layer
        code around `attend`): they are copied with the tier's buffers, on the same stream before the event,
        so one wait (`await_update`) covers them.
        """
        entry = self._tiers.get(tier)
        if entry is None:
            raise Dsv4AscendBackendError(f"tier {tier} was not captured (captured: {sorted(self._tiers)})")
        args = entry.args
        self._check_ratios(meta)
        pairs = [(args.cu_seqlens_q, meta.device.cu_seqlens_q), (args.seqused_kv, meta.device.kv_lens),
                 (args.ori_block_table, meta.device.ori_block_table)]
        if args.swa_indices is not None:
            pairs.append((args.swa_indices, meta.device.swa_indices.unsqueeze(1)))
        pairs += [(buf, meta.compressed[r].device.cmp_block_table) for r, buf in args.cmp_block_table.items()]
        pairs += extra
        for dst, src in pairs:  # shapes are host-side facts: checking them reads no device value
            if dst.shape != src.shape:
                raise Dsv4AscendBackendError(
                    f"tier {tier} was captured with {args.meta.num_slots} slots and arrays of shape "
                    f"{list(dst.shape)}, the step has {list(src.shape)}: plan graph steps with "
                    f"num_slots={args.meta.num_slots} and the tier's max_kv_len")
        npu = torch.npu
        if self._update_stream is None:
            self._update_stream = npu.Stream()
        # The buffers being rewritten are the ones a replay still in flight reads: wait for it first. This
        # also orders the copies after the planner's host-to-device copy of `meta`, queued on the compute
        # stream.
        self._update_stream.wait_stream(npu.current_stream())
        with npu.stream(self._update_stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            # The tiling plans depend on the lengths (and max_seqlen_kv): recompute them from the new buffers.
            for key, plan in self._tiling(meta, args).items():
                args.tiling[key].copy_(plan, non_blocking=True)
            entry.event.record(self._update_stream)
        # Keep the step's arrays referenced until the next update, so the allocator cannot hand them to other
        # work before the update stream has read them.
        args.meta = meta

    def await_update(self) -> None:
        """Inside `capturing`: make the graph's next operation wait for the tier's `update_captured` event.

        Once per capture, before the first operation that reads a buffer the update rewrites: `attend` calls
        it before its first operator, and a caller whose own captured ops read `extra` buffers calls it
        before the first of those. Outside a capture it does nothing.
        """
        if self._capture is None:
            return
        tier = self._tiers[self._capture]
        if not tier.waits:
            stream = torch.npu.current_stream()
            tier.event.wait(stream)
            tier.event.reset(stream)
            tier.waits = True

    # ------------------------------------------------------------------------------------------------------
    # the layer call

    def attend(self, layer_id: int, q: torch.Tensor, cache: Dsv4LayerCache, meta: Dsv4VerifyMetadata, *,
               sinks: torch.Tensor | None = None, index_query: torch.Tensor | None = None,
               index_weights: torch.Tensor | None = None, query_dequant_scale: torch.Tensor | None = None,
               index_key: torch.Tensor | None = None, key_dequant_scale: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Layer `layer_id`'s attention output [T, H, D] for queries q [T, H, D] over its caches.

        C4 layers also take the indexer's inputs: index_query int8 [T, IH, ID] (quant mode 0), index_weights
        [T, IH], query_dequant_scale float16 [T, IH], and the int8 index keys index_key [blocks, block_size,
        (1,) ID] with key_dequant_scale float16 [blocks, block_size(, 1)]. The caches must already hold this
        step's writes (the compressor and the window writes run before attention, as in both peers).
        """
        ratio = self.layer_ratios[layer_id]
        if cache.ratio != ratio:
            raise Dsv4AscendBackendError(f"layer {layer_id} has compress ratio {ratio}; its cache "
                                         f"{cache.ratio}")
        args = self._args_for(meta)
        self.await_update()
        kwargs = dict(args.sas_base[ratio], ori_kv=_paged(cache.swa_kv, "swa_kv"), sinks=sinks)
        if ratio:
            kwargs["cmp_kv"] = _paged(cache.cmp_kv, "cmp_kv")
        if ratio == INDEXER_RATIO:
            if index_query is None or index_weights is None or query_dequant_scale is None \
                    or index_key is None or key_dequant_scale is None:
                raise Dsv4AscendBackendError(f"C4 layer {layer_id} needs index_query, index_weights, "
                                             f"query_dequant_scale, index_key and key_dequant_scale")
            assert self._indexer is not None and args.topk is not None
            topk, _ = self._indexer(query=index_query, key=_paged(index_key, "index_key"),
                                    weights=index_weights, query_dequant_scale=query_dequant_scale,
                                    key_dequant_scale=key_dequant_scale, **args.indexer_base)
            args.topk.copy_(topk.view(args.topk.shape))
        out, _ = self._sas(q, **kwargs)
        return out


__all__ = [
    "SGLANG_OPS",
    "TORCH_NPU_OPS",
    "VLLM_ASCEND_OPS",
    "Dsv4AscendAttention",
    "Dsv4AscendBackendError",
    "Dsv4AscendOps",
]
