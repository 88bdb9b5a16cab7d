"""Paged attention in plain torch over `TorchPagedMetadata` (the CPU backend; it runs on any device).

The step's requests run in query blocks of similar row counts (`QueryBlocks`), so the work follows
the rows the step runs. Each block reads its requests' keys through their page tables in chunks of
`KV_CHUNK` positions, up to its longest KV length (not the page table's capacity), and combines the
chunks with an online softmax in a fixed order. Greedy speculative decoding is bit-exact with
target-only decoding only if a row's output does not depend on which other rows share its step;
here it does not:

- the query rows are the free (vectorised) dimension of both products: `keys @ q.T` and
  `values.T @ probs.T`, so a row's dot products run the same instructions in the same order
  whatever the block's width or request count (the other operand is always `[KV_CHUNK, head_dim]`);
- the softmax reduces a contiguous row of `KV_CHUNK` scores, one shape in every step;
- a chunk whose keys are all past a row's position changes nothing, bit for bit: its scores are
  -inf, the running maximum stays, the rescale factor is exp(0) = 1 and it adds exact zeros, so
  reading further because another request's keys go further leaves this row's result unchanged.

`tests/test_runtime_invariance.py` checks the property on the machine it runs on.
"""

from __future__ import annotations

import torch

from dspark.runtime.attention.metadata import KV_CHUNK, QueryBlock, TorchPagedMetadata
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
        blocks = meta.blocks
        assert blocks is not None  # TorchPagedMetadata checks it
        q_padded = torch.cat((q, q.new_zeros(1, *q.shape[1:])))  # the zero row padding gathers
        outs = [self._attend_block(layer_id, q_padded, block) for block in blocks.blocks]
        if not outs:
            return q.new_zeros(q.shape)
        return torch.cat(outs)[blocks.scatter]

    def _read_kv(self, layer_id: int, block: QueryBlock) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's requests' first `kv_bound` positions: keys `[B, Hkv, kv_bound, D]` and values
        with a column of ones appended, `[B, Hkv, kv_bound, D + 1]` (so the product with the
        probabilities also sums them). Read a whole page at a time; keys past a request's length are
        read but masked."""
        num_reqs, bound = block.page_table.shape[0], block.kv_bound
        num_pages = -(-bound // self.page_size)
        last_page = block.page_table.shape[1] - 1
        columns = torch.arange(num_pages, device=block.page_table.device).clamp_max(last_page)
        pages = block.page_table[:, columns].long().flatten()
        k_cache, v_cache = self.cache.k[layer_id], self.cache.v[layer_id]
        num_kv, head_dim = k_cache.shape[1:]

        def read(cache: torch.Tensor) -> torch.Tensor:  # B, bound, Hkv, D
            paged = cache.view(-1, self.page_size * num_kv * head_dim).index_select(0, pages)
            return paged.view(num_reqs, num_pages * self.page_size, num_kv, head_dim)[:, :bound]

        keys = read(k_cache).transpose(1, 2).contiguous()
        vals = v_cache.new_empty((num_reqs, num_kv, bound, head_dim + 1))
        vals[..., :head_dim] = read(v_cache).transpose(1, 2)
        vals[..., head_dim] = 1
        return keys, vals

    def _attend_block(self, layer_id: int, q_padded: torch.Tensor, block: QueryBlock) -> torch.Tensor:
        """`[b * width, H, D]`: the block's padded query rows attended over their requests' keys."""
        num_reqs, width = block.gather.shape
        head_dim = q_padded.shape[-1]
        num_kv = self.cache.k.shape[-2]
        group = self.num_heads // num_kv
        rows = group * width  # one column of the products per (query head of the group, query row)
        chunks = block.kv_bound // KV_CHUNK

        # Queries pre-scaled, as the columns of the products: B, Hkv, D, rows.
        q_cols = (q_padded[block.gather] * self.scale).view(num_reqs, width, num_kv, group, head_dim)
        q_cols = q_cols.permute(0, 2, 4, 3, 1).reshape(num_reqs, num_kv, head_dim, rows)
        query_pos = block.positions[:, None, :].expand(num_reqs, group, width).reshape(num_reqs, 1, 1, rows)
        key_pos = torch.arange(block.kv_bound, device=q_padded.device)[:, None]
        keys, vals = self._read_kv(layer_id, block)

        scores = torch.matmul(keys, q_cols).float()  # B, Hkv, kv_bound, rows
        scores.masked_fill_(key_pos > query_pos, float("-inf"))
        # A max is exact in any order (here over a transposed copy: a contiguous reduction is several
        # times faster); a row with no visible key (a padding row) shifts by 0, not by -inf.
        top = scores.transpose(-1, -2).contiguous().amax(-1)[..., None, :]
        probs = torch.exp(scores - torch.where(torch.isinf(top), torch.zeros_like(top), top))
        # Per chunk: [values | 1]^T @ probs, both sums over the chunk's KV_CHUNK keys in one product.
        per_chunk = vals.view(num_reqs, num_kv, chunks, KV_CHUNK, head_dim + 1).transpose(-1, -2)
        sums = torch.matmul(per_chunk, probs.to(vals.dtype).view(num_reqs, num_kv, chunks, KV_CHUNK, rows))
        acc = sums[:, :, 0].float()  # B, Hkv, D + 1, rows
        for chunk in range(1, chunks):  # in key order; a chunk past every row's keys adds exact zeros
            acc = acc + sums[:, :, chunk].float()
        total = acc[:, :, head_dim:]
        out = torch.where(total > 0, acc[:, :, :head_dim] / total.clamp_min(1e-30), torch.zeros_like(total))
        out = out.to(q_padded.dtype).view(num_reqs, num_kv, head_dim, group, width).permute(0, 4, 1, 3, 2)
        return out.reshape(num_reqs * width, self.num_heads, head_dim)
