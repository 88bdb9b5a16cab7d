"""The DSV4 attention backend of a CPU deployment, and the step metadata its generated builders plan.

`Dsv4PagedAttention` owns the runtime's DSV4 caches
(`dspark.runtime.families.dsv4.cpu_paged.Dsv4PagedCaches`: per request slot a raw-KV ring and
compressed-entry pages for `max_context_len` positions, allocated once, so a slot's pages never move and
follow from the slot number) and runs each layer of a step through the paged reference. `plan_step_metadata`
turns the engine's step layout (`dspark.runtime.layout`: rows per slot, prefixes, tier, slot count) into the
DSV4 metadata of `plan_dsv4_verify`, with the slots' own page tables; the generated `attn_metadata.py` of a
dsv4 deployment calls it for verify steps and for extend steps (prefill chunks, target-only decoding).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from dspark.formats.dsv4_config import Dsv4CacheLayout
from dspark.runtime.families.dsv4.cpu_paged import Dsv4PagedCaches, layer_forward, slot_page_tables
from dspark.runtime.families.dsv4.model import DSV4Layer
from dspark.runtime.families.dsv4.target import Dsv4ForCausalLM
from dspark.runtime.families.dsv4.verify_metadata import Dsv4StepConfig, Dsv4VerifyMetadata, plan_dsv4_verify
from dspark.runtime.layout import ExtendLayout, VerifyLayout


def step_config(layout: Dsv4CacheLayout, num_draft_tokens: int, padding_request_rows: int) -> Dsv4StepConfig:
    """The verify steps' configuration: N rows per request at most, padding requests of
    `padding_request_rows` rows (the layout's, so both lay a tier out the same way)."""
    return Dsv4StepConfig(
        num_draft_tokens=num_draft_tokens, window=layout.window, compress_ratios=layout.compress_ratios,
        swa_page_size=layout.swa_page_size, swa_ring_size=layout.swa_ring_size,
        cmp_page_sizes={r: layout.cmp_page_size for r in layout.compress_ratios},
        index_topk=layout.index_topk, padding_request_rows=padding_request_rows)


def extend_config(layout: Dsv4CacheLayout, verify: Dsv4StepConfig) -> Dsv4StepConfig:
    """An extend step's configuration: as many rows per request as the ring allows."""
    return dataclasses.replace(verify, num_draft_tokens=layout.max_rows_per_request, padding_request_rows=0)


class Dsv4PagedAttention:
    """DSV4 layers over paged caches on the CPU (`Dsv4LayerBackend`), one cache set per request slot."""

    def __init__(self, caches: Dsv4PagedCaches, max_extend_rows: int) -> None:
        self.caches = caches
        self.max_extend_rows = max_extend_rows

    @classmethod
    def allocate(cls, target: Dsv4ForCausalLM, layout: Dsv4CacheLayout, config: Dsv4StepConfig,
                 max_requests: int, max_context_len: int, *,
                 device: torch.device | str = "cpu") -> Dsv4PagedAttention:
        """Zeroed caches for `max_requests` slots, each slot's pages in order (`slot_page_tables`); the
        paged reference runs on the host only."""
        if torch.device(device).type != "cpu":
            raise ValueError(f"the paged DSV4 reference runs on the CPU, not {device}")
        caches = Dsv4PagedCaches.allocate(target.model.cfg, config, max_requests, max_context_len)
        return cls(caches, layout.max_rows_per_request)

    def forward_layer(self, layer_id: int, layer: DSV4Layer, h: Tensor, tokens: Tensor,
                      meta: Dsv4VerifyMetadata) -> Tensor:
        return layer_forward(layer, self.caches.layers[layer_id], h, tokens, meta, None)


def plan_step_metadata(layout: VerifyLayout | ExtendLayout, config: Dsv4StepConfig, max_context_len: int,
                       device: torch.device, max_kv_len: int | None = None) -> Dsv4VerifyMetadata:
    """The DSV4 metadata of a planned step: its real requests' rows and prefixes, at the layout's tier and
    slot count, over the page tables of the requests' slots (`max_kv_len` fixes the tables' width, as a
    captured graph needs)."""
    if isinstance(layout, VerifyLayout):
        num_reqs, tier, num_slots = layout.num_requests, layout.tier, layout.num_slots
    else:
        # An extend step's padding request (DP attention: a DP rank with fewer rows than another's, or
        # none) is not one of the requests: it has no slot (`host_slots` lists the real requests only)
        # and so no caches of its own. It is planned as a verify step's padding requests are: slots
        # after the real ones, prefix 0, all-null page tables, so its raw K=V and compressor rows land
        # in the null page (page 0) that no real row reads, it closes no compressed entry and attends to
        # nothing. Its rows are split into padding requests of at most the step's rows per request, so
        # they never widen the query blocks (`extend_config` passes padding_request_rows 0, which the step
        # config takes as its rows per request). A real slot's caches are never touched by them.
        num_reqs = len(layout.host_slots)
        tier, num_slots = layout.num_rows, None
    ends = layout.host_qo_indptr
    rows = [ends[i + 1] - ends[i] for i in range(num_reqs)]
    prefix = [kv - n for kv, n in zip(layout.host_kv_lens[:num_reqs], rows, strict=True)]
    tables = slot_page_tables(config, max_context_len, layout.host_slots)
    return plan_dsv4_verify(rows, prefix, config, tables, tier=tier, num_slots=num_slots,
                            max_kv_len=max_kv_len, device=device)
