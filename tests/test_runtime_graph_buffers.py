"""The static buffers a captured graph reads its step from, exercised on the CPU.

A CUDA or NPU graph is captured once per tier, reading a view of `StepBuffers` laid out for a tier of
padding requests only; each replay copies the step's layout into the same buffers first. Running the
captured computation eagerly from that view (what a replay re-executes) must give, for the real rows,
exactly what the eager runner gives for the same layout.

A replay cannot read the step's host values (the view's are the capture's), so the replayed attention
here is the torch attention laid out from device tensors alone: every request in one query block of
the widest request's width, reading keys up to the page table's capacity. The eager runner's CPU
metadata plans blocks by row count and reads keys to the actual lengths; the two agree bit for bit
because a row's result depends on neither.
"""

from __future__ import annotations

import math

import pytest
import torch

from dspark.runtime.attention.metadata import KV_CHUNK, QueryBlock, QueryBlocks, TorchPagedMetadata
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.layout import StepShape, VerifyLayout, plan_verify
from dspark.runtime.package import load_package
from dspark.runtime.runners.eager import EagerVerifyRunner
from dspark.runtime.runners.graph_buffers import StepBuffers

from .runtime_helpers import compile_variant, import_package_module

TIERS = (8, 16, 24, 32)
MAX_REQUESTS = 4


def one_block_metadata(layout: VerifyLayout, width: int, page_size: int) -> TorchPagedMetadata:
    """Torch-attention metadata from the layout's device tensors only (no host value is read)."""
    qo, positions, table = layout.qo_indptr.long(), layout.positions.long(), layout.page_table
    num_reqs, total = table.shape[0], positions.shape[0]
    starts, lens = qo[:-1], qo[1:] - qo[:-1]
    col = torch.arange(width)
    gather = torch.where(col < lens[:, None], starts[:, None] + col, torch.full_like(starts[:, None], total))
    req = torch.repeat_interleave(torch.arange(num_reqs), lens, output_size=total)
    scatter = req * width + torch.arange(total) - starts[req]
    padded_pos = torch.cat((positions, positions.new_full((1,), -1)))[gather]
    bound = -(-table.shape[1] * page_size // KV_CHUNK) * KV_CHUNK
    columns = torch.arange(-(-bound // page_size)).clamp_max(table.shape[1] - 1)
    hidden = torch.arange(bound)[None, :, None] > padded_pos[:, None, :]
    block = QueryBlock(gather=gather, pages=table[:, columns].long().flatten(), hidden=hidden[:, :, None],
                       kv_bound=bound)
    return TorchPagedMetadata(qo_indptr=layout.qo_indptr, kv_lens=layout.kv_lens, page_table=table,
                              positions=layout.positions, out_cache_loc=layout.out_cache_loc,
                              max_seqlen_q=width, blocks=QueryBlocks((block,), scatter))


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Runtime:
    overrides = {"verify": {"mode": "compact", "allow_no_cost_model": True},
                 "graph": {"enabled": True, "token_tiers": list(TIERS)},
                 "serving": {"max_running_requests": MAX_REQUESTS}}
    return Runtime(load_package(compile_variant(tmp_path_factory.mktemp("buffers"), "tiny_cpu_static.yaml",
                                                overrides, "graph_buffers")))


def test_a_replay_from_static_buffers_equals_the_eager_forward(runtime: Runtime) -> None:
    n = runtime.plan.num_draft_tokens
    metadata = import_package_module(runtime.package.directory, "attn_metadata")
    pages = runtime.deployment.serving.pages_per_request

    def slots_for_tier(tier: int) -> int:  # what the generated CUDA compact runner holds
        return min(MAX_REQUESTS, tier) + math.ceil(tier / n)

    shape = StepShape(page_size=runtime.page_size, num_draft_tokens=n, tiers=TIERS, padding_request_rows=n,
                      slots_for_tier=slots_for_tier)
    device = torch.device("cpu")
    buffers = StepBuffers(slots_for_tier(TIERS[-1]), TIERS[-1], pages, n, device)
    empty = torch.zeros(0, pages, dtype=torch.int32)
    captured = {}
    for tier in TIERS:  # "capture": each tier's view, laid out on padding only
        padding_only = plan_verify((), (), [], empty, shape, device, tier=tier)
        buffers.load(padding_only, buffers.input_ids[:0])
        captured[tier] = buffers.view(padding_only)

    def replay(layout, ids):
        buffers.load(layout, ids)
        view = captured[layout.tier]
        out = runtime.target.forward_paged(buffers.input_ids[: view.tier], view.positions, runtime.attn,
                                           one_block_metadata(view, n, runtime.page_size))
        return out[: layout.total_rows]

    eager = EagerVerifyRunner(runtime.target, runtime.attn, shape, metadata.build_verify_metadata)
    handles = [runtime.slots.admit() for _ in range(MAX_REQUESTS)]
    for h in handles:
        runtime.slots.reserve(h.slot, 64)
    try:
        torch.manual_seed(0)
        for lens, prefix in [((2, 1, 4), [5, 9, 17]), ((8, 8, 8, 8), [1, 2, 3, 4]), ((1,), [30]),
                             ((3, 7), [0, 12])]:
            table = runtime.slots.page_table[[h.slot for h in handles[: len(lens)]]]
            layout = plan_verify(lens, lens, prefix, table, shape, device)
            assert layout.num_slots == slots_for_tier(layout.tier)
            ids = torch.randint(0, 256, (layout.total_rows,))
            torch.testing.assert_close(replay(layout, ids), eager.run(layout, ids), rtol=0, atol=0)
    finally:
        for h in handles:
            runtime.slots.release(h.slot)
