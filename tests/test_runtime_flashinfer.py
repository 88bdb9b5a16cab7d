"""The FlashInfer attention backend's metadata, checked on the CPU.

FlashInfer itself needs CUDA (`tests/test_runtime_flashinfer_gpu.py` runs it where it is installed).
Here the committed `llama31_8b_h200_flashinfer` package's generated builders lay out steps
planned by the runtime, and a model of the wrapper's documented semantics
(`reference_batch_prefill_paged`) attends through those CSR page arrays: it must give what the
project's own attention gives for the same step through the Triton package's metadata.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import pytest
import torch

from dspark.runtime.attention.flashinfer_paged import FlashInferPagedAttention, reference_batch_prefill_paged
from dspark.runtime.attention.metadata import FlashInferMetadata
from dspark.runtime.kernels.paged_attention import paged_attention
from dspark.runtime.kv_cache import PagedKVCache
from dspark.runtime.layout import ExtendLayout, StepShape, VerifyLayout, plan_extend, plan_verify

CPU = torch.device("cpu")
PAGE = 16  # the committed packages' page size


def package_module(name: str, module: str) -> ModuleType:
    return importlib.import_module(f"generated.{name}.{module}")


FLASHINFER = package_module("llama31_8b_h200_flashinfer", "attn_metadata")
TRITON = package_module("llama31_8b_h200_compact", "attn_metadata")
FLASHINFER_RUNNER = package_module("llama31_8b_h200_flashinfer", "graph_runner")
assert FLASHINFER.PAGE_SIZE == PAGE


def test_plan_builds_csr_page_arrays() -> None:
    table = torch.tensor([[5, 9, 2, 0], [7, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.int32)
    meta = FlashInferMetadata.plan((0, 3, 4, 4), (35, 16, 1), table, PAGE,
                                   positions=torch.zeros(4, dtype=torch.long),
                                   out_cache_loc=torch.zeros(4, dtype=torch.long))
    assert meta.qo_indptr.tolist() == [0, 3, 4, 4]
    assert meta.paged_kv_indptr.tolist() == [0, 3, 4, 5]  # 35 keys: 3 pages, 16: one full page, 1: one
    assert meta.paged_kv_indices.tolist() == [5, 9, 2, 7, 0]
    assert meta.paged_kv_last_page_len.tolist() == [3, 16, 1]
    assert meta.num_requests == 3 and meta.total_rows == 4


@pytest.mark.parametrize(("kv_lens", "match"), [((0, 4), "at least one KV entry"),
                                                ((65, 1), "needs 5 pages, more than the page table's 4")])
def test_plan_refuses_lengths_it_cannot_page(kv_lens: tuple[int, int], match: str) -> None:
    table = torch.ones(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        FlashInferMetadata.plan((0, 1, 2), kv_lens, table, PAGE, positions=torch.zeros(2, dtype=torch.long),
                                out_cache_loc=torch.zeros(2, dtype=torch.long))


def test_metadata_keeps_the_plan_arrays_on_the_host() -> None:
    meta = FlashInferMetadata.plan((0, 1), (3,), torch.ones(1, 2, dtype=torch.int32), PAGE,
                                   positions=torch.zeros(1, dtype=torch.long),
                                   out_cache_loc=torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="plans on the host"):
        FlashInferMetadata(qo_indptr=meta.qo_indptr.to("meta"), paged_kv_indptr=meta.paged_kv_indptr,
                           paged_kv_indices=meta.paged_kv_indices,
                           paged_kv_last_page_len=meta.paged_kv_last_page_len, page_size=PAGE,
                           positions=meta.positions, out_cache_loc=meta.out_cache_loc)
    with pytest.raises(ValueError, match="paged_kv_indices has 2 pages"):
        FlashInferMetadata(qo_indptr=meta.qo_indptr, paged_kv_indptr=meta.paged_kv_indptr,
                           paged_kv_indices=torch.ones(2, dtype=torch.int32),
                           paged_kv_last_page_len=meta.paged_kv_last_page_len, page_size=PAGE,
                           positions=meta.positions, out_cache_loc=meta.out_cache_loc)


def test_backend_without_flashinfer_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # importing it raises ImportError
    cache = PagedKVCache(1, 4, PAGE, 2, 16, torch.float32)
    with pytest.raises(RuntimeError, match=r"needs flashinfer-python .*backend.attention: triton"):
        FlashInferPagedAttention(cache, PAGE, 4, 0.25)


# -- the generated FlashInfer metadata against the project's attention, step by step ----------------

def _table(prefix: list[int], rows: list[int], pages: int, seed: int) -> tuple[torch.Tensor, int]:
    """(page table, pages in the pool): each request's pages, shuffled, from a shared pool whose
    page 0 stays null."""
    need = [-(-(p + r) // PAGE) for p, r in zip(prefix, rows, strict=True)]
    pool = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed)).add(1).tolist()
    table = torch.zeros(len(rows), pages, dtype=torch.int32)
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
    return table, 1 + sum(need)


def _both(layout: VerifyLayout | ExtendLayout, num_pages: int, group: int, seed: int,
          max_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the wrapper's semantics through the FlashInfer builder's metadata, the project's reference
    attention through the Triton builder's) for one layer of `layout`, over one random cache."""
    num_kv, head_dim = 2, 32
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, num_pages, PAGE, num_kv, head_dim, torch.float32)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    q = torch.randn(layout.positions.shape[0], group * num_kv, head_dim, generator=gen)
    scale = head_dim ** -0.5
    verify = isinstance(layout, VerifyLayout)
    fi = FLASHINFER.build_verify_metadata(layout) if verify else FLASHINFER.build_extend_metadata(layout)
    pages = (-1, PAGE, num_kv, head_dim)
    theirs = reference_batch_prefill_paged(
        q, cache.k[0].view(pages), cache.v[0].view(pages), qo_indptr=fi.qo_indptr,
        paged_kv_indptr=fi.paged_kv_indptr, paged_kv_indices=fi.paged_kv_indices,
        paged_kv_last_page_len=fi.paged_kv_last_page_len, sm_scale=scale)
    tr = TRITON.build_verify_metadata(layout) if verify else TRITON.build_extend_metadata(layout)
    ours = paged_attention(q, cache.k[0], cache.v[0], tr.qo_indptr, tr.kv_lens, tr.positions, tr.page_table,
                           page_size=PAGE, scale=scale, max_rows_per_request=max_rows, impl="torch")
    return theirs, ours


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize(("prefix", "lens"), [([9, 0, 37], [5, 2, 3]), ([130, 16, 15, 47], [8, 1, 8, 2]),
                                             ([3], [1])])
def test_flashinfer_metadata_attends_as_the_project_attention_on_compact_tiers(
        group: int, prefix: list[int], lens: list[int]) -> None:
    """The generated compact graph runner's own shape: padding requests up to the tier and empty slots."""
    shape: StepShape = FLASHINFER_RUNNER.SHAPE
    table, num_pages = _table(prefix, lens, 12, seed=len(lens))
    layout = plan_verify(lens, lens, prefix, table, shape, CPU)
    assert layout.num_slots == FLASHINFER_RUNNER.SLOTS_FOR_TIER(layout.tier) > len(lens)
    theirs, ours = _both(layout, num_pages, group, seed=sum(prefix), max_rows=8)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 4])
def test_flashinfer_metadata_attends_as_the_project_attention_on_an_extend_step(group: int) -> None:
    prefix, extend = [0, 21, 3, 50], [19, 1, 6, 2]  # a prefill chunk, decodes, a chunk after a prefix
    table, num_pages = _table(prefix, extend, 6, seed=3)
    layout = plan_extend(prefix, extend, table, PAGE, CPU)
    theirs, ours = _both(layout, num_pages, group, seed=11, max_rows=layout.max_rows)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_reference_sees_only_keys_up_to_each_row() -> None:
    """Causal bottom-right: changing a key after a row's position leaves that row's output alone."""
    table, num_pages = _table([20], [4], 4, seed=5)
    layout = plan_extend([20], [4], table, PAGE, CPU)
    meta = FLASHINFER.build_extend_metadata(layout)
    gen = torch.Generator().manual_seed(2)
    k, v = (torch.randn(num_pages, PAGE, 1, 8, generator=gen) for _ in range(2))
    q = torch.randn(4, 1, 8, generator=gen)
    args = {"qo_indptr": meta.qo_indptr, "paged_kv_indptr": meta.paged_kv_indptr,
            "paged_kv_indices": meta.paged_kv_indices, "paged_kv_last_page_len": meta.paged_kv_last_page_len,
            "sm_scale": 1.0}
    before = reference_batch_prefill_paged(q, k, v, **args)
    last = int(table[0, 23 // PAGE])
    k[last, 23 % PAGE] += 5.0  # the last row's own key: rows 0..2 (positions 20..22) do not see it
    after = reference_batch_prefill_paged(q, k, v, **args)
    assert torch.equal(before[:3], after[:3]) and not torch.equal(before[3], after[3])
