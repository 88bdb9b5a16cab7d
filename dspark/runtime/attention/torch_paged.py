"""Paged attention in plain torch over `PagedAttnMetadata` (the CPU reference; also runs on CUDA).

Each request's queries attend over its page table's whole capacity with a causal mask. Keys
past a query's position get probability exactly 0, so the result is the ordinary causal
attention; computing it with the same shapes for every step makes a row's output independent
of how many other rows share the step, which keeps greedy speculative decoding bit-exact with
target-only decoding.
"""

from __future__ import annotations

import torch

from dspark.runtime.attention.metadata import PagedAttnMetadata
from dspark.runtime.kv_cache import PagedKVCache
from dspark.runtime.layout import prefix_slots


class TorchPagedAttention:
    def __init__(self, cache: PagedKVCache, page_size: int, num_heads: int, scale: float) -> None:
        self.cache = cache
        self.page_size = page_size
        self.num_heads = num_heads
        self.scale = scale

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: PagedAttnMetadata) -> torch.Tensor:
        self.cache.write(layer_id, meta.out_cache_loc, k, v)
        pad = meta.padding
        num_reqs, width = pad.gather.shape
        total, _, head_dim = q.shape
        num_kv = k.shape[1]
        group = self.num_heads // num_kv

        # Keys: every slot of each request's page table, [B, C, Hkv, D].
        cap = meta.page_table.shape[1] * self.page_size
        slots = prefix_slots(meta.page_table, self.page_size, cap)
        keys = self.cache.k[layer_id][slots].permute(0, 2, 3, 1)  # B, Hkv, D, C
        vals = self.cache.v[layer_id][slots].transpose(1, 2)  # B, Hkv, C, D

        q_rows = torch.cat((q, q.new_zeros(1, *q.shape[1:])))[pad.gather]  # B, W, H, D
        q_rows = q_rows.view(num_reqs, width, num_kv, group, head_dim).permute(0, 2, 3, 1, 4)
        scores = torch.matmul(q_rows.reshape(num_reqs, num_kv, group * width, head_dim), keys)
        scores = scores.view(num_reqs, num_kv, group, width, cap) * self.scale
        offs = torch.arange(cap, device=q.device)
        hidden = offs[None, None, :] > pad.positions[:, :, None]  # B, W, C
        scores = scores.masked_fill(hidden[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # padding rows see no key at all
        out = torch.matmul(probs.view(num_reqs, num_kv, group * width, cap), vals)
        out = out.view(num_reqs, num_kv, group, width, head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(num_reqs * width, self.num_heads, head_dim)[pad.scatter]
