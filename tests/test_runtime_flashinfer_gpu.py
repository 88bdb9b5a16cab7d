"""FlashInfer's attention on CUDA, where `flashinfer-python` is installed: eagerly and replayed in a
captured graph it attends as the project's reference does, and a compact deployment compiled with
`backend.attention: flashinfer` replays its tier graphs as it runs eagerly and serves.

Skips cleanly without a GPU or without flashinfer.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

from dspark.runtime.attention.flashinfer_paged import FlashInferPagedAttention
from dspark.runtime.attention.metadata import FlashInferMetadata
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.kernels.paged_attention import paged_attention
from dspark.runtime.kv_cache import PagedKVCache
from dspark.runtime.layout import StepShape, VerifyLayout, plan_verify
from dspark.runtime.package import load_package
from dspark.runtime.runners.eager import EagerVerifyRunner

from .runtime_helpers import compile_variant

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None),
    reason="needs a CUDA GPU and flashinfer-python")

PAGE, NUM_KV, HEAD_DIM, GROUP = 16, 2, 64, 4
CUDA = torch.device("cuda")
SHAPE = StepShape(page_size=PAGE, num_draft_tokens=8, tiers=(16, 32), padding_request_rows=8,
                  slots_for_tier=lambda tier: min(8, tier) + -(-tier // 8))
TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 3e-2}


def _layout(prefix: list[int], lens: list[int], seed: int) -> VerifyLayout:
    pool = torch.randperm(60, generator=torch.Generator().manual_seed(seed)).add(1)
    table = torch.zeros(len(lens), 8, dtype=torch.int32)
    for i, (p, r) in enumerate(zip(prefix, lens, strict=True)):
        need = -(-(p + r) // PAGE)
        table[i, :need] = pool[i * 8:i * 8 + need].int()
    return plan_verify(lens, lens, prefix, table, SHAPE, CUDA)


def _meta(layout: VerifyLayout) -> FlashInferMetadata:
    return FlashInferMetadata.plan(layout.host_qo_indptr, layout.host_kv_lens, layout.page_table, PAGE,
                                   positions=layout.positions, out_cache_loc=layout.out_cache_loc)


def _reference(attn: FlashInferPagedAttention, layout: VerifyLayout, q: torch.Tensor) -> torch.Tensor:
    return paged_attention(q.float(), attn.cache.k[0].float(), attn.cache.v[0].float(), layout.qo_indptr,
                           layout.kv_lens, layout.positions, layout.page_table, page_size=PAGE,
                           scale=HEAD_DIM ** -0.5, max_rows_per_request=8, impl="torch")


def _backend(dtype: torch.dtype) -> FlashInferPagedAttention:
    cache = PagedKVCache(1, 64, PAGE, NUM_KV, HEAD_DIM, dtype, CUDA)
    cache.k.copy_(torch.randn_like(cache.k))
    cache.v.copy_(torch.randn_like(cache.v))
    return FlashInferPagedAttention(cache, PAGE, GROUP * NUM_KV, HEAD_DIM ** -0.5)


def _rows(layout: VerifyLayout, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = layout.positions.shape[0]
    return (torch.randn(t, GROUP * NUM_KV, HEAD_DIM, dtype=dtype, device=CUDA),
            torch.randn(t, NUM_KV, HEAD_DIM, dtype=dtype, device=CUDA),
            torch.randn(t, NUM_KV, HEAD_DIM, dtype=dtype, device=CUDA))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_eager_flashinfer_matches_reference(dtype: torch.dtype) -> None:
    attn = _backend(dtype)
    for seed, (prefix, lens) in enumerate([([9, 0, 37], [5, 2, 3]), ([130, 16, 15, 47], [8, 1, 8, 2])]):
        layout = _layout(prefix, lens, seed)
        q, k, v = _rows(layout, dtype)
        got = attn.attend(0, q, k, v, _meta(layout))
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got.float(), _reference(attn, layout, q), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_graph_wrapper_replays_a_later_plan(dtype: torch.dtype) -> None:
    attn = _backend(dtype)
    first = _layout([9, 0, 37], [5, 2, 3], seed=0)  # tier 16
    second = _layout([40, 3], [8, 6], seed=1)  # tier 16 too, other lengths and pages
    assert first.tier == second.tier
    attn.add_graph(first.tier, first.num_slots, 8)
    q, k, v = _rows(first, dtype)
    positions, loc = first.positions.clone(), first.out_cache_loc.clone()
    meta = FlashInferMetadata.plan(first.host_qo_indptr, first.host_kv_lens, first.page_table, PAGE,
                                   positions=positions, out_cache_loc=loc)
    attn.plan(meta, graph=first.tier)
    attn.attend(0, q, k, v, meta)  # warm up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.attend(0, q, k, v, meta)
    later = _rows(second, dtype)
    for buf, new in zip((q, k, v, positions, loc), (*later, second.positions, second.out_cache_loc),
                        strict=True):
        buf.copy_(new)
    attn.plan(_meta(second), graph=second.tier)
    graph.replay()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), _reference(attn, second, q), atol=tol, rtol=tol)


def test_compact_flashinfer_deployment_replays_what_it_runs_eagerly(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The generated graph runner (FlashInfer planned before every replay) against the same layout run
    eagerly through the generated builder, and the whole decode loop serving with it.

    Greedy equality with target-only decoding is not asserted here: FlashInfer's bf16 kernels choose
    their tiles from the whole step, so a row's rounding can depend on the other rows (the project's
    Triton kernel is the batch-invariant path, tests/test_runtime_cuda.py)."""
    overrides = {"backend": {"kind": "cuda", "device": "h200", "attention": "flashinfer"},
                 "model": {"dtype": "bfloat16"}, "serving": {"max_running_requests": 8},
                 "graph": {"enabled": True, "token_tiers": [8, 16, 24, 32, 48, 64]}}
    tmp = tmp_path_factory.mktemp("flashinfer")
    package = compile_variant(tmp, "llama_50m_cpu_compact.yaml", overrides, "l50m_flashinfer")
    rt = Runtime(load_package(package))
    lens = [8, 3, 5, 1, 1]
    slots = [rt.slots.admit() for _ in lens]
    for h in slots:
        rt.slots.reserve(h.slot, 64)
    page_table = rt.slots.page_table[[h.slot for h in slots]].cuda()
    layout = rt.verify_runner.plan(tuple(lens), tuple(lens), [5, 9, 17, 1, 30], page_table,
                                   list(range(len(lens))))
    assert layout.tier in rt.verify_runner.graphs
    ids = torch.randint(0, 8192, (layout.total_rows,), device="cuda")
    replayed = rt.verify_runner.run(layout, ids).clone()
    build_metadata = importlib.import_module(type(rt.verify_runner).__module__).build_verify_metadata
    eager = EagerVerifyRunner(rt.target, rt.attn, rt.verify_runner.shape, build_metadata)
    torch.testing.assert_close(replayed.float(), eager.run(layout, ids).float(), atol=3e-2, rtol=3e-2)
    for h in slots:
        rt.slots.release(h.slot)
    out, stats = rt.generate([[1, 2, 3, 4], [5, 6]], 24)
    assert [len(o) for o in out] == [24, 24] and len(stats.drafts_accepted) > 0
