"""Paged attention on CUDA through the project's Triton kernel (`kernels/paged_attention.py`).

A step costs what its rows and their actual KV lengths cost: each request's keys are read only up
to its rows' positions, and a padding request or an empty slot of a captured graph does no work.
The kernel reads every length from the device and sizes its grid from host ints, so it runs inside
a captured CUDA graph unchanged.
"""

from __future__ import annotations

import torch

from dspark.runtime.attention.metadata import PagedAttnMetadata
from dspark.runtime.kernels.dispatch import Impl
from dspark.runtime.kernels.paged_attention import paged_attention
from dspark.runtime.kv_cache import PagedKVCache


class TritonPagedAttention:
    def __init__(self, cache: PagedKVCache, page_size: int, num_heads: int, scale: float,
                 impl: Impl = "auto") -> None:
        self.cache = cache
        self.page_size = page_size
        self.num_heads = num_heads
        self.scale = scale
        self.impl = impl  # "triton" runs the kernel on CPU tensors under the Triton interpreter (tests)

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: PagedAttnMetadata) -> torch.Tensor:
        self.cache.write(layer_id, meta.out_cache_loc, k, v)
        k_cache, v_cache = self.cache.k[layer_id], self.cache.v[layer_id]
        return paged_attention(q, k_cache, v_cache, meta.qo_indptr, meta.kv_lens, meta.positions,
                               meta.page_table, page_size=self.page_size, scale=self.scale,
                               max_rows_per_request=meta.max_seqlen_q, impl=self.impl)
