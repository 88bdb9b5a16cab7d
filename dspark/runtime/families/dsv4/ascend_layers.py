"""DeepSeek-V4 (DSV4) layers on an Ascend NPU: the `Dsv4LayerBackend` around `Dsv4AscendAttention`.

`Dsv4AscendLayers` is a `dspark.runtime.families.dsv4.device_layers.Dsv4DeviceLayers`: the projections, RoPE,
ring and compressor writes and the pooling of every boundary entry are that module's device tensor ops (its
docstring says what runs where, why nothing reads a device value back, and how padding entries land in the
null page). What is Ascend's is the attention: `Dsv4AscendAttention.attend` (the lightning indexer and sparse
shared-KV attention operators) on the compute stream, and how a captured NPU graph's static arrays are
refreshed.

The indexer's quantisation mode
-------------------------------
The operator is the quantised lightning indexer with query_quant_mode = key_quant_mode = 0 (per token and
head: an int8 query [T, IH, ID] and keys with float16 dequant scales [T, IH] and [blocks, block_size, 1], the
score being sum_h w_h * relu(q_h . k * scale_q * scale_k)). The index query is quantised per row and head at
each step, and every index key as it is written: `lc.index_kv` keeps the pooled key (the CPU path and the
graphs' shapes read it), and an int8 copy with its scale per entry beside it is what the operator reads
(`ops.quantize_int8`, symmetric, the scale max|k| / 127 in float16). A model whose `index_quant` is set
(the runtime sets it on Ascend, `Dsv4Geometry.for_backend`) computes the same scores on the CPU.

NPU graphs per token tier
-------------------------
`capturing(tier, meta)` extends `Dsv4AscendAttention.capturing`: besides the attention's buffers the tier gets
the static copies of `Dsv4DeviceLayers` (`positions`, `row_slot`, `swa_slot_mapping`, `ori_block_table`, and
per ratio `boundary_rows`, `cmp_positions`, `cmp_loc`). `update_captured(tier, meta)` hands the copies to
`Dsv4AscendAttention.update_captured(..., extra=)`: they are written on its update stream after it waits for
the compute stream (a replay still running is never patched) and before the event it records; the graph's
first operation waits for that event (`await_update`, called before a captured pass's first op). Enter
`capturing` before the graph capture starts.

Checked in tests/test_dsv4_ascend_layers.py against `paged.layer_forward` on a torch_npu stand-in whose
operators are the CPU models of `dspark.runtime.families.dsv4.ascend_op_models`, with device arrays that
refuse host reads and a fake graph that records and replays: static and compact steps with padding across C4
and small C128-kind boundaries, multi-step runs with rollback, and graph replays against eager steps. Never
run on an NPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dspark.runtime.attention.ascend import import_torch_npu
from dspark.runtime.families.dsv4.ascend_attention import (
    TORCH_NPU_OPS,
    Dsv4AscendAttention,
    Dsv4AscendBackendError,
    Dsv4AscendOps,
)
from dspark.runtime.families.dsv4.cpu_paged import Dsv4LayerCache, Dsv4PagedCaches
from dspark.runtime.families.dsv4.device_layers import Dsv4DeviceLayers, Dsv4Step, flat
from dspark.runtime.families.dsv4.model import DSV4Layer
from dspark.runtime.families.dsv4.ops import quantize_int8
from dspark.runtime.families.dsv4.verify_metadata import Dsv4StepConfig, Dsv4VerifyMetadata
from dspark.runtime.families.dsv4.w8a8 import bind_kernel, npu_kernel

if TYPE_CHECKING:
    from dspark.formats.dsv4_config import Dsv4CacheLayout
    from dspark.runtime.families.dsv4.target import Dsv4ForCausalLM


class Dsv4AscendLayers(Dsv4DeviceLayers):
    """DSV4 layers over paged caches on an Ascend NPU (`Dsv4LayerBackend`), attention by the operators.

    `max_context_len` bounds the positions a step may hold (P + L), which sizes the device RoPE tables.
    """

    error = Dsv4AscendBackendError

    def __init__(self, caches: Dsv4PagedCaches, attention: Dsv4AscendAttention, max_extend_rows: int,
                 max_context_len: int) -> None:
        ratios = tuple(lc.ratio for lc in caches.layers)
        if attention.layer_ratios != ratios:
            raise Dsv4AscendBackendError(f"the attention was built for layer ratios "
                                         f"{attention.layer_ratios}, the caches hold {ratios}")
        super().__init__(caches, max_extend_rows, max_context_len)
        self.attention = attention
        # Per C4 layer, the int8 index keys [blocks, block_size, ID] and their float16 scales
        # [blocks, block_size, 1] the operator reads, written beside `index_kv` (module docstring); from the
        # keys the caches already hold (zeros, or a prefill's).
        self._int8_keys: dict[int, tuple[Tensor, Tensor]] = {}
        for i, lc in enumerate(caches.layers):
            if lc.index_kv is not None:
                codes, scales = quantize_int8(lc.index_kv.float())
                self._int8_keys[i] = (codes, scales.unsqueeze(-1))

    @classmethod
    def allocate(cls, target: Dsv4ForCausalLM, layout: Dsv4CacheLayout, config: Dsv4StepConfig,
                 max_requests: int, max_context_len: int, *, device: torch.device | str,
                 dtype: torch.dtype | None = None, ops: Dsv4AscendOps = TORCH_NPU_OPS) -> Dsv4AscendLayers:
        """Zeroed caches on `device` for `max_requests` slots, each slot's pages in order (`slot_page_tables`,
        as `Dsv4PagedCaches.allocate(seed=None)` assigns them), in `dtype` (default: the target's), and the
        attention over them."""
        cfg = target.model.cfg
        caches = cls.allocate_caches(target, config, max_requests, max_context_len, device, dtype)
        # The query heads this rank holds (all of them without tensor parallelism); the one K=V head, the
        # compressors and the indexer are whole on every rank.
        attention = Dsv4AscendAttention(cfg.compress_ratios, num_heads=target.local_num_heads,
                                        head_dim=cfg.head_dim, softmax_scale=cfg.head_dim**-0.5,
                                        index_num_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
                                        ops=ops)
        # W8A8 weights kept quantised (a W8A8_DYNAMIC checkpoint) multiply through the NPU's operators
        bind_kernel(target, npu_kernel(import_torch_npu()))
        return cls(caches, attention, layout.max_rows_per_request, max_context_len)

    def _index_keys_written(self, layer_id: int, lc: Dsv4LayerCache, loc: Tensor) -> None:
        codes, scales = self._int8_keys[layer_id]
        keys = flat(lc.index_kv)[loc].float()  # as the cache holds them
        key_codes, key_scales = quantize_int8(keys)
        flat(codes).index_copy_(0, loc, key_codes)
        flat(scales).index_copy_(0, loc, key_scales[:, None])

    def _attend(self, layer_id: int, layer: DSV4Layer, lc: Dsv4LayerCache, step: Dsv4Step, q: Tensor,
                index: tuple[Tensor, Tensor] | None) -> Tensor:
        extra: dict[str, Tensor | None] = {}
        if index is not None:
            query_codes, query_scales = quantize_int8(index[0].float())  # per row and head
            key_codes, key_scales = self._int8_keys[layer_id]
            extra = dict(index_query=query_codes, index_weights=index[1], query_dequant_scale=query_scales,
                         index_key=key_codes, key_dequant_scale=key_scales)
        return self.attention.attend(layer_id, q, lc, step.meta, sinks=layer.attn_sink, **extra)

    # ------------------------------------------------------------------------------------------------------
    # graphs: the attention's buffers, update stream and event carry this module's static arrays too

    def _capture_context(self, tier: int, meta: Dsv4VerifyMetadata) -> AbstractContextManager[Any]:
        return self.attention.capturing(tier, meta)

    def _captured_pass_begins(self) -> None:
        self.attention.await_update()  # the graph waits for update_captured before reading the tier's arrays

    def _refresh_captured(self, tier: int, meta: Dsv4VerifyMetadata,
                          pairs: Mapping[str, tuple[Tensor, Tensor]]) -> None:
        """The attention's buffers and this module's static copies, all on the attention's update stream
        before the event the graph waits on."""
        self.attention.update_captured(tier, meta, extra=list(pairs.values()))


__all__ = ["Dsv4AscendLayers"]
