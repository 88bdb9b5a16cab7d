"""DeepSeek-V4 (DSV4) layers on a CUDA GPU: the `Dsv4LayerBackend` around the Triton DSV4 attention.

`Dsv4CudaLayers` is a `dspark.runtime.families.dsv4.device_layers.Dsv4DeviceLayers`: the projections, RoPE,
ring and compressor writes and the pooling of every boundary entry are that module's tensor ops (its docstring
says what runs where, why nothing reads a device value back, and how padding entries land in the null
page). What is CUDA's is the attention of a layer, on the current stream:

* C4 layers: the lightning indexer in torch (`indexer_topk`). Row t scores every entry of its slot's
  compressed table, sum_h w_h * relu(q_h . k_e), masks the entries it cannot see (e >= `cmp_visible[t]`),
  and keeps the `index_topk` best, equal scores going to the lower id exactly as `Indexer.select` orders
  them (a stable descending sort); the ids are written ascending, then -1, as the kernel reads them. Rows
  are vectorised with fixed shapes: every row scores the table's whole capacity (`cmp_block_table` columns
  x page size), so the shapes follow from the tier and the table width, never from a row's own count.
* then `dspark.runtime.families.dsv4.triton_attention.dsv4_attention` over the window ring and the compressed
cache,   with the step's device arrays (`positions`, `row_slot`, `ori_block_table`, `window_lens =
  swa_window_lens`, per ratio `cmp_block_table`, `cmp_visible`): `swa_window_lens` and `cmp_visible` are 0
  on padding rows, so those see no key and the sink makes their output 0, as `paged.layer_forward` does.
  `impl` picks the Triton kernel (`auto` on CUDA tensors, `triton` under the interpreter in tests) or the
  torch oracle (`torch`).
Queries go to the kernel in the caches' dtype and the sinks in float32, as it requires.

CUDA graphs per token tier
--------------------------
`capturing(tier, meta)` gives the tier static copies of every metadata array the layers read (those of
`Dsv4DeviceLayers` plus `swa_window_lens`, `cmp_block_table` and `cmp_visible` per ratio).
`update_captured(tier, meta)` copies the step's arrays into them on the current stream, and the caller then
replays the tier's graph on that same stream: CUDA orders a replay after the work queued before it on its
stream (and the copies after the previous replay queued there, so a replay still running is never patched),
so no update stream or event is needed. The step's arrays may be dropped once `update_captured` returns: the
caching allocator hands their memory out again only in that stream's order, after the copies have read it.
Enter `capturing` before the graph capture starts (`with layers.capturing(T, meta), torch.cuda.graph(g):`);
a warm-up pass may run inside `capturing` too. Steps replayed on a tier must be planned with its slot count
and page-table widths (`plan_dsv4_verify(..., num_slots=B, max_kv_len=L)`).

Cost, as written
----------------
The indexer materialises each row's keys [T, E, ID] and head scores [T, IH, E] (E: the table's entry
capacity) and sorts [T, E]; at DeepSeek-V4-Flash's sizes and long contexts that is gigabytes per C4 layer,
so a fused top-k indexer kernel is the next step. The layers' linears are the reference's row-invariant
multiply-and-sum (exact, memory-hungry at the published sizes). With a bf16 model the fp32 RoPE tables
promote the activations after the first rotation to fp32 (weights and caches stay bf16).

Checked in tests/test_dsv4_cuda_layers.py on the CPU (the torch oracle and, under the Triton interpreter,
the kernel) against `paged.layer_forward`, and in tests/test_dsv4_cuda_layers_gpu.py on a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, get_args

import torch
from torch import Tensor

from dspark.runtime.families.dsv4.cpu_paged import Dsv4LayerCache, Dsv4PagedCaches
from dspark.runtime.families.dsv4.device_layers import Dsv4DeviceLayers, Dsv4Step, flat
from dspark.runtime.families.dsv4.model import DSV4Layer
from dspark.runtime.families.dsv4.ops import quantize_int8
from dspark.runtime.families.dsv4.triton_attention import dsv4_attention
from dspark.runtime.families.dsv4.verify_metadata import Dsv4StepConfig, Dsv4VerifyMetadata
from dspark.runtime.kernels.dispatch import Impl

if TYPE_CHECKING:
    from dspark.formats.dsv4_config import Dsv4CacheLayout
    from dspark.runtime.families.dsv4.target import Dsv4ForCausalLM


def indexer_topk(index_query: Tensor, weights: Tensor, index_kv: Tensor, *, row_slot: Tensor,
                 cmp_block_table: Tensor, cmp_visible: Tensor, topk: int, int8: bool = False) -> Tensor:
    """The lightning indexer's choice: int32 [T, topk], row t's min(topk, cmp_visible[t]) best entries in
    ascending id order, then -1.

    index_query [T, IH, ID] and weights [T, IH] (the indexer's rotated query and scaled head weights);
    index_kv [pages, Cp, ID], the index keys, entry e of slot b at
    `cmp_block_table[b, e // Cp] * Cp + e % Cp`; row_slot, cmp_visible int32 [T]; cmp_block_table int32
    [B, cols]. Scores are fp32 sum_h w_h * relu(q_h . k_e) in `Indexer.select`'s order of operations, with
    its tie rule (the lower id first); the dot products are one batched matmul, which may round them an ulp
    away from select's multiply-and-sum. `int8` (the model's `index_quant`): queries and keys quantised as
    `Indexer.scores` quantises them, whose integer dot products are exact.
    """
    total, page = index_query.shape[0], index_kv.shape[1]
    capacity = cmp_block_table.shape[1] * page  # E: every entry a row's table can name
    device = index_query.device
    e = torch.arange(capacity, device=device)
    pages = cmp_block_table.long()[row_slot.long()][:, e // page]  # [T, E]
    keys = flat(index_kv)[pages * page + e % page].float()  # [T, E, ID]
    if int8:
        (q_codes, q_scale), (k_codes, k_scale) = quantize_int8(index_query.float()), quantize_int8(keys)
        dots = torch.einsum("thd,ted->the", q_codes.float(), k_codes.float())  # [T, IH, E], exact
        dots = dots * q_scale.float()[:, :, None] * k_scale.float()[:, None, :]
    else:
        dots = torch.einsum("thd,ted->the", index_query.float(), keys)  # [T, IH, E]
    scores = (dots.relu() * weights.float()[:, :, None]).sum(1)  # [T, E]
    visible = cmp_visible.long()[:, None]  # [T, 1]
    scores = scores.masked_fill(e[None, :] >= visible, float("-inf"))
    k = min(topk, capacity)
    # Stable: equal scores keep id order, as Indexer.select's sort does; unseen entries (-inf) sort last.
    best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]  # [T, k]
    kept = torch.arange(k, device=device)[None, :] < visible  # the first min(k, visible) are real entries
    ids = torch.where(kept, best, capacity).sort(dim=1).values  # ascending, dropped ones (E) last
    ids = torch.where(ids == capacity, -1, ids).to(torch.int32)
    if k < topk:  # a table narrower than top-k: the columns past it are padding
        ids = torch.cat([ids, torch.full((total, topk - k), -1, dtype=torch.int32, device=device)], dim=1)
    return ids


class Dsv4CudaLayers(Dsv4DeviceLayers):
    """DSV4 layers over paged caches on a CUDA GPU (`Dsv4LayerBackend`): the indexer in torch, attention by
    the Triton kernel (or its torch oracle, `impl`).

    `max_context_len` bounds the positions a step may hold (P + L), which sizes the device RoPE tables.
    """

    def __init__(self, caches: Dsv4PagedCaches, max_extend_rows: int, max_context_len: int, *,
                 impl: Impl = "auto") -> None:
        if impl not in get_args(Impl):
            raise self.error(f"impl must be one of {get_args(Impl)}, got {impl!r}")
        super().__init__(caches, max_extend_rows, max_context_len)
        self.impl: Impl = impl

    @classmethod
    def allocate(cls, target: Dsv4ForCausalLM, layout: Dsv4CacheLayout, config: Dsv4StepConfig,
                 max_requests: int, max_context_len: int, *, device: torch.device | str,
                 dtype: torch.dtype | None = None, impl: Impl = "auto") -> Dsv4CudaLayers:
        """Zeroed caches on `device` for `max_requests` slots, each slot's pages in order (`slot_page_tables`,
        as `Dsv4PagedCaches.allocate(seed=None)` assigns them), in `dtype` (default: the target's)."""
        caches = cls.allocate_caches(target, config, max_requests, max_context_len, device, dtype)
        return cls(caches, layout.max_rows_per_request, max_context_len, impl=impl)

    def _step_arrays(self, meta: Dsv4VerifyMetadata) -> dict[str, Tensor]:
        arrays = super()._step_arrays(meta)
        arrays["swa_window_lens"] = meta.device.swa_window_lens
        for ratio, plan in meta.compressed.items():
            arrays[f"cmp_block_table.{ratio}"] = plan.device.cmp_block_table
            arrays[f"cmp_visible.{ratio}"] = plan.device.cmp_visible
        return arrays

    def attention_args(self, step: Dsv4Step, ratio: int) -> dict[str, Any]:
        """`dsv4_attention`'s keyword arguments for a layer of compress ratio `ratio` (0: window only) from
        the step's arrays, as `dsv4_attention_args` takes them from the metadata (the caller adds `topk` on C4
        layers, and `scale`)."""
        a, cfg = step.arrays, self.caches.step_config
        args: dict[str, Any] = dict(positions=a["positions"], row_slot=a["row_slot"],
                                    ori_block_table=a["ori_block_table"], swa_ring_size=cfg.swa_ring_size,
                                    window=cfg.window, window_lens=a["swa_window_lens"])
        if ratio:
            args.update(cmp_block_table=a[f"cmp_block_table.{ratio}"], cmp_visible=a[f"cmp_visible.{ratio}"])
        return args

    def _attend(self, layer_id: int, layer: DSV4Layer, lc: Dsv4LayerCache, step: Dsv4Step, q: Tensor,
                index: tuple[Tensor, Tensor] | None) -> Tensor:
        args = self.attention_args(step, layer.ratio)
        if index is not None:
            assert lc.index_kv is not None
            args["topk"] = indexer_topk(*index, lc.index_kv, row_slot=args["row_slot"],
                                        cmp_block_table=args["cmp_block_table"],
                                        cmp_visible=args["cmp_visible"],
                                        topk=self.caches.step_config.index_topk,
                                        int8=layer.cfg.index_quant)
        return dsv4_attention(q.to(lc.swa_kv.dtype), lc.swa_kv, lc.cmp_kv, layer.attn_sink.float(),
                              scale=layer.cfg.head_dim**-0.5, impl=self.impl, **args)

    def _refresh_captured(self, tier: int, meta: Dsv4VerifyMetadata,
                          pairs: Mapping[str, tuple[Tensor, Tensor]]) -> None:
        """Copy the step's arrays into the tier's static ones on the current stream (module docstring: the
        replay that follows on this stream reads them). Every shape is checked before anything is copied."""
        slots = pairs["ori_block_table"][0].shape[0]
        for name, (static, new) in pairs.items():  # shapes are host-side facts: no device value is read
            if static.shape != new.shape:
                raise self.error(f"tier {tier} was captured with {slots} slots and {name} of shape "
                                 f"{list(static.shape)}, the step has {list(new.shape)}: plan graph steps "
                                 f"with num_slots={slots} and the tier's max_kv_len")
        for static, new in pairs.values():
            static.copy_(new, non_blocking=True)


__all__ = ["Dsv4CudaLayers", "indexer_topk"]
