"""Paged attention on CUDA through FlashInfer's batch prefill wrapper (`backend.attention: flashinfer`).

A second anchor for the project's Triton kernel: the same ragged rows (`qo_indptr` from the step's
`verify_lens`), the pages in FlashInfer's CSR form (`FlashInferMetadata`). FlashInfer splits a step
into `plan()`, host work done once per step, and `run()`, one kernel per layer. Eagerly the first
layer plans; with graph capture the runner plans each tier's wrapper outside the graph before every
replay (`plan(meta, graph=tier)`) and the graph holds only the `run()` kernels, which read the
wrapper's fixed buffers.

`flashinfer` is imported only when this backend is constructed: it needs CUDA, and nothing here is
needed to build or test the metadata.

`reference_batch_prefill_paged` implements the wrapper's documented semantics on plain torch so the
generated FlashInfer metadata can be checked on any CPU:

* `q` is `[T, H, D]`, request b owning rows `qo_indptr[b]:qo_indptr[b+1]`;
* the caches are `[num_pages, page_size, Hkv, D]` ("NHD"); request b's KV is the concatenation of
  pages `paged_kv_indices[paged_kv_indptr[b]:paged_kv_indptr[b+1]]`, all of them full but the last,
  which holds `paged_kv_last_page_len[b]` entries;
* `causal=True` aligns the mask bottom-right: row i of a request with `q_b` rows and `kv_b` keys sees
  keys `j <= kv_b - q_b + i`;
* grouped-query attention maps query head h to KV head `h // (H // Hkv)`.
"""

from __future__ import annotations

from typing import Any

import torch

from dspark.runtime.attention.metadata import FlashInferMetadata
from dspark.runtime.kv_cache import PagedKVCache

# FlashInfer's recommended float workspace for split-KV partial results, shared by every wrapper
# (one step runs at a time on one stream).
WORKSPACE_BYTES = 128 * 1024 * 1024


def reference_batch_prefill_paged(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, *, qo_indptr: torch.Tensor,
    paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor, paged_kv_last_page_len: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """CPU model of `BatchPrefillWithPagedKVCacheWrapper` planned with `causal=True`, NHD caches."""
    page_size, num_kv, head_dim = k_pages.shape[1:]
    group = q.shape[1] // num_kv
    out = torch.zeros_like(q)
    indptr, kv_indptr = qo_indptr.tolist(), paged_kv_indptr.tolist()
    for b in range(len(indptr) - 1):
        start, end = indptr[b], indptr[b + 1]
        if end == start:
            continue
        pages = paged_kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long().cpu()
        kv_len = (len(pages) - 1) * page_size + int(paged_kv_last_page_len[b])
        k = k_pages[pages].reshape(-1, num_kv, head_dim)[:kv_len].repeat_interleave(group, dim=1)
        v = v_pages[pages].reshape(-1, num_kv, head_dim)[:kv_len].repeat_interleave(group, dim=1)
        rows = end - start
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k.float()) * sm_scale
        limit = kv_len - rows + torch.arange(rows)
        scores = scores.masked_fill(torch.arange(kv_len)[None, None, :] > limit[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)
    return out


class FlashInferPagedAttention:
    """Paged attention through FlashInfer: one eager wrapper, and one CUDA-graph wrapper per captured
    tier (`add_graph`), each with fixed buffers sized for that tier's request slots."""

    def __init__(self, cache: PagedKVCache, page_size: int, num_heads: int, scale: float) -> None:
        try:
            import flashinfer
        except (ImportError, RuntimeError, OSError) as err:
            raise RuntimeError(
                "backend.attention: flashinfer needs flashinfer-python where the deployment runs "
                "(pip install flashinfer-python, matching this torch and CUDA); or compile the spec "
                "with backend.attention: triton, the project's own kernel") from err
        self._flashinfer = flashinfer
        self.cache = cache
        self.page_size = page_size
        self.num_heads = num_heads
        self.scale = scale
        _, self.num_kv_heads, self.head_dim = cache.k.shape[1:]
        device = cache.k.device
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._eager = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._graphs: dict[int, Any] = {}
        self._active: Any = None
        self._planned: FlashInferMetadata | None = None

    def add_graph(self, key: int, num_slots: int, pages_per_request: int) -> None:
        """A wrapper for graph `key` whose plan arrays live in fixed buffers a captured graph reads."""
        def buffer(size: int) -> torch.Tensor:
            return torch.empty(size, dtype=torch.int32, device=self.cache.k.device)
        self._graphs[key] = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=buffer(num_slots + 1),
            paged_kv_indptr_buf=buffer(num_slots + 1),
            paged_kv_indices_buf=buffer(num_slots * pages_per_request),
            paged_kv_last_page_len_buf=buffer(num_slots))

    def plan(self, meta: FlashInferMetadata, graph: int | None = None) -> None:
        """Plan a step (host work, outside any captured graph) on the eager wrapper or graph `graph`'s."""
        wrapper = self._eager if graph is None else self._graphs[graph]
        wrapper.plan(meta.qo_indptr, meta.paged_kv_indptr, meta.paged_kv_indices, meta.paged_kv_last_page_len,
                     self.num_heads, self.num_kv_heads, self.head_dim, self.page_size, causal=True,
                     sm_scale=self.scale, q_data_type=self.cache.k.dtype, kv_data_type=self.cache.k.dtype)
        self._active, self._planned = wrapper, meta

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: FlashInferMetadata) -> torch.Tensor:
        self.cache.write(layer_id, meta.out_cache_loc, k, v)
        if meta is not self._planned:  # a new eager step: its first layer plans it
            self.plan(meta)
        shape = (-1, self.page_size, self.num_kv_heads, self.head_dim)
        pages = (self.cache.k[layer_id].view(shape), self.cache.v[layer_id].view(shape))
        return self._active.run(q, pages)
