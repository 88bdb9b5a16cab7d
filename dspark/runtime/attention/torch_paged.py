"""Paged attention in plain torch over `TorchPagedMetadata` (the CPU backend; it runs on any device).

The step's requests run in query blocks of similar row counts (`QueryBlocks`), so the work follows
the rows the step runs. Each block reads its requests' keys and values a whole page at a time, up to
its longest KV length (not the page table's capacity), and a KV head's products read them in place.
Greedy speculative decoding is bit-exact with target-only decoding only if a row's output does not
depend on which other rows share its step; here it does not:

- the query rows are the free (vectorised) dimension of every product (`keys @ q.T`,
  `values.T @ probs.T` and the probabilities' sum `ones @ probs.T`), so a row's dot products run the
  same instructions in the same order whatever the block's width or request count;
- the softmax shift is each row's maximum score, exact in any order;
- keys are summed in fixed chunks of `KV_CHUNK` positions (each a product over exactly that many
  keys) whose results are added in key order; a chunk whose keys are all past a row's position
  adds exact zeros, so reading further because another request's keys go further leaves the row's
  result unchanged.

`tests/test_runtime_invariance.py` checks the property on the machine it runs on.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from dspark.runtime.attention.metadata import KV_CHUNK, QueryBlock, TorchPagedMetadata
from dspark.runtime.kv_cache import PagedKVCache

# torch computes a batched product of fewer than 400 multiply-adds with its own loop, which sums in
# another order than the BLAS kernel it uses above that: a product whose size follows the step's row
# count must stay above the line at one row. The keys' and values' products do (head_dim x 64 keys);
# the probabilities' sum is a product with rows of ones, so it takes 8 of them (8 x 64 = 512).
ONES_ROWS = 8
# The products' columns are a block's (query head of a KV group, query row) pairs: at least two, for BLAS
# runs a single column as a matrix-vector product, which sums in another order than the matrix kernel.
MIN_COLUMNS = 2


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
        """The block's requests' first `kv_bound` keys and values, `[B, kv_bound, Hkv, D]` each,
        read a whole page at a time. A KV head's keys are then a strided `[B, kv_bound, D]` view
        that a batched product reads in place."""
        k_cache, v_cache = self.cache.k[layer_id], self.cache.v[layer_id]
        num_kv, head_dim = k_cache.shape[1:]

        def read(cache: torch.Tensor) -> torch.Tensor:
            paged = cache.view(-1, self.page_size * num_kv * head_dim).index_select(0, block.pages)
            return paged.view(block.num_requests, -1, num_kv, head_dim)[:, :block.kv_bound]

        return read(k_cache), read(v_cache)

    def _attend_block(self, layer_id: int, q_padded: torch.Tensor, block: QueryBlock) -> torch.Tensor:
        """`[b * width, H, D]`: the block's padded query rows attended over their requests' keys."""
        num_reqs, width = block.gather.shape
        num_kv = self.cache.k.shape[-2]
        group = self.num_heads // num_kv
        if group * width < MIN_COLUMNS:
            # One query head per KV head (MHA) and one row: the products would have a single column, which
            # BLAS runs as a matrix-vector product that sums in another order. Add hidden zero rows.
            pad = -(-MIN_COLUMNS // group) - width
            zero_row = q_padded.shape[0] - 1
            wider = dataclasses.replace(block, gather=F.pad(block.gather, (0, pad), value=zero_row),
                                        hidden=F.pad(block.hidden, (0, pad), value=True))
            out = self._attend_block(layer_id, q_padded, wider)
            return out.view(num_reqs, width + pad, *out.shape[1:])[:, :width].reshape(-1, *out.shape[1:])
        head_dim = q_padded.shape[-1]
        rows = group * width  # one column of the products per (query head of the group, query row)
        bound = block.kv_bound
        chunks = bound // KV_CHUNK
        batch = num_reqs * chunks  # the per-chunk products batch over (request, chunk)

        # Queries pre-scaled, as the columns of the products: Hkv, B, D, rows.
        q_cols = (q_padded[block.gather] * self.scale).view(num_reqs, width, num_kv, group, head_dim)
        q_cols = q_cols.permute(2, 0, 4, 3, 1).reshape(num_kv, num_reqs, head_dim, rows)
        keys, vals = self._read_kv(layer_id, block)

        scores = keys.new_empty((num_kv, num_reqs, bound, rows))
        for h in range(num_kv):
            torch.bmm(keys[:, :, h], q_cols[h], out=scores[h])
        scores = scores.float()  # Hkv, B, kv_bound, rows
        scores.view(num_kv, num_reqs, bound, group, width).masked_fill_(block.hidden, float("-inf"))
        # A max is exact in any order (here over a transposed copy: a contiguous reduction is several
        # times faster); a row with no visible key (a padding row) shifts by 0, not by -inf.
        top = scores.transpose(-1, -2).contiguous().amax(-1)[..., None, :]
        probs = torch.exp(scores - torch.where(torch.isinf(top), torch.zeros_like(top), top)).to(vals.dtype)
        # Per chunk of KV_CHUNK keys: values^T @ probs and the probabilities' sum, each summed in one product.
        weighted = vals.new_empty((num_kv, batch, head_dim, rows))
        for h in range(num_kv):
            per_chunk = vals[:, :, h].reshape(batch, KV_CHUNK, head_dim).transpose(1, 2)
            torch.bmm(per_chunk, probs[h].view(batch, KV_CHUNK, rows), out=weighted[h])
        ones = vals.new_ones((1, ONES_ROWS, KV_CHUNK)).expand(num_kv * batch, ONES_ROWS, KV_CHUNK)
        sums = torch.bmm(ones, probs.view(num_kv * batch, KV_CHUNK, rows))[:, :1]
        weighted = weighted.view(num_kv, num_reqs, chunks, head_dim, rows)
        sums = sums.view(num_kv, num_reqs, chunks, 1, rows)
        acc, total = weighted[:, :, 0].float(), sums[:, :, 0].float()  # Hkv, B, D (or 1), rows
        for chunk in range(1, chunks):  # in key order; a chunk past every row's keys adds exact zeros
            acc = acc + weighted[:, :, chunk].float()
            total = total + sums[:, :, chunk].float()
        out = torch.where(total > 0, acc / total.clamp_min(1e-30), torch.zeros_like(acc))
        out = out.to(q_padded.dtype).view(num_kv, num_reqs, head_dim, group, width).permute(1, 4, 0, 3, 2)
        return out.reshape(num_reqs * width, self.num_heads, head_dim)
