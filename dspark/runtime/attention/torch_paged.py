"""Paged attention in plain torch over `TorchPagedMetadata` (the CPU backend; it runs on any device).

Each request's padded block of query rows (`QueryPadding`) reads its keys through its page table in
chunks of `KV_CHUNK` positions, up to the step's `kv_bound` (its longest KV length, so the cost
follows the actual lengths, not the page table's capacity), and combines the chunks with an online
softmax in a fixed order. Greedy speculative decoding is bit-exact with target-only decoding only if
a row's output does not depend on which other rows share its step; here it does not:

- every product has one shape whatever the step (the query block's width is fixed, the chunk too);
- a chunk whose keys are all past a row's position changes nothing, bit for bit: its scores are
  -inf, the running maximum stays, the rescale factor is exp(0) = 1 and it adds exact zeros, so
  reading further because another request's keys go further leaves this row's result unchanged.
"""

from __future__ import annotations

import torch

from dspark.runtime.attention.metadata import KV_CHUNK, TorchPagedMetadata
from dspark.runtime.kv_cache import PagedKVCache


class TorchPagedAttention:
    def __init__(self, cache: PagedKVCache, page_size: int, num_heads: int, scale: float) -> None:
        self.cache = cache
        self.page_size = page_size
        self.num_heads = num_heads
        self.scale = scale

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: TorchPagedMetadata) -> torch.Tensor:
        self.cache.write(layer_id, meta.out_cache_loc, k, v)
        pad = meta.padding
        assert pad is not None  # TorchPagedMetadata checks it
        num_reqs, width = pad.gather.shape
        head_dim, num_kv = q.shape[-1], k.shape[1]
        group = self.num_heads // num_kv
        rows = group * width  # one GEMM row per (query head of the group, query row)

        q_rows = torch.cat((q, q.new_zeros(1, *q.shape[1:])))[pad.gather]  # B, W, H, D
        q_rows = q_rows.view(num_reqs, width, num_kv, group, head_dim).permute(0, 2, 3, 1, 4)
        q_rows = q_rows.reshape(num_reqs, num_kv, rows, head_dim)
        query_pos = pad.positions[:, None, None, :].expand(num_reqs, 1, group, width)
        query_pos = query_pos.reshape(num_reqs, 1, rows)

        running_max = q.new_full((num_reqs, num_kv, rows), float("-inf"), dtype=torch.float32)
        total = torch.zeros_like(running_max)
        acc = q.new_zeros((num_reqs, num_kv, rows, head_dim), dtype=torch.float32)
        k_cache, v_cache = self.cache.k[layer_id], self.cache.v[layer_id]
        last_page = meta.page_table.shape[1] - 1
        for start in range(0, meta.kv_bound, KV_CHUNK):
            key_pos = torch.arange(start, start + KV_CHUNK, device=q.device)
            # A chunk may run past the page table; those keys are past every query and masked.
            pages = meta.page_table[:, (key_pos // self.page_size).clamp_max(last_page)].long()
            slots = pages * self.page_size + key_pos % self.page_size  # B, C
            keys = k_cache[slots].permute(0, 2, 3, 1)  # B, Hkv, D, C
            vals = v_cache[slots].transpose(1, 2)  # B, Hkv, C, D
            scores = torch.matmul(q_rows, keys).float() * self.scale  # B, Hkv, rows, C
            scores = scores.masked_fill(key_pos[None, None, None, :] > query_pos[..., None], float("-inf"))
            new_max = torch.maximum(running_max, scores.amax(-1))
            # A row with no visible key yet (a padding row, or none so far) shifts by 0, not by -inf.
            shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            rescale = torch.exp(running_max - shift)
            probs = torch.exp(scores - shift[..., None])
            total = total * rescale + probs.sum(-1)
            acc = acc * rescale[..., None] + torch.matmul(probs.to(vals.dtype), vals).float()
            running_max = new_max
        seen = total[..., None] > 0  # padding rows see no key at all: their output is zero
        out = torch.where(seen, acc / total.clamp_min(1e-30)[..., None], torch.zeros_like(acc))
        out = out.to(q.dtype).view(num_reqs, num_kv, group, width, head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(num_reqs * width, self.num_heads, head_dim)[pad.scatter]
