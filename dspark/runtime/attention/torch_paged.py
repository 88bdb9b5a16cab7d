"""Paged attention in plain torch over `TorchPagedMetadata` (the CPU backend; it runs on any device).

The step's requests run in query blocks of similar row counts (`QueryBlocks`), so the work follows
the rows the step runs. Each block reads its requests' keys and values a whole page at a time, up to
its longest KV length (not the page table's capacity), and a KV head's products read them in place.
Greedy speculative decoding is bit-exact with target-only decoding only if a row's output does not
depend on which other rows share its step. Each block's rows run through `ops.chunked_attention`,
whose products all have one shape fixed by the model (a tile of (query row, head) pairs against a
chunk of `KV_CHUNK` keys) and whose key chunks are added in key order; a chunk whose keys are all past
a row's position adds exact zeros, so reading further because another request's keys go further
leaves the row's result unchanged (docs/exactness.md).
"""

from __future__ import annotations

import torch

from dspark.runtime.attention.metadata import QueryBlock, QueryBlocks, TorchPagedMetadata, row_class_bounds
from dspark.runtime.kv_cache import PagedKVCache
from dspark.runtime.models import ops


class TorchPagedAttention:
    def __init__(self, cache: PagedKVCache, page_size: int, num_heads: int, scale: float) -> None:
        self.cache = cache
        self.page_size = page_size
        self.num_heads = num_heads
        self.scale = scale
        # The step whose blocks the masks were laid out for, and each block's mask: a step's layers
        # share them (the metadata is built once per step, so its identity marks the step).
        self._masks_of: QueryBlocks | None = None
        self._masks: dict[int, ops.PairMask] = {}

    @property
    def query_group(self) -> int:
        """Query heads per KV head, which `QueryBlocks.plan` groups a step's requests by."""
        return self.num_heads // self.cache.k.shape[-2]

    def row_classes(self, max_rows: int) -> tuple[int, ...]:
        """The most rows of each query-block class (`row_class_bounds`): a step across classes pays an
        attention call per class, which a plan that keeps its requests in one class saves."""
        return row_class_bounds(max_rows, self.query_group)

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: TorchPagedMetadata) -> torch.Tensor:
        self.cache.write(layer_id, meta.out_cache_loc, k, v)
        blocks = meta.blocks
        assert blocks is not None  # TorchPagedMetadata checks it
        q_padded = torch.cat((q, q.new_zeros(1, *q.shape[1:])))  # the zero row padding gathers
        if self._masks_of is not blocks:
            self._masks_of, self._masks = blocks, {}
        outs = [self._attend_block(layer_id, q_padded, block, i) for i, block in enumerate(blocks.blocks)]
        if not outs:
            return q.new_zeros(q.shape)
        return torch.cat(outs)[blocks.scatter]

    def _read_kv(self, layer_id: int, block: QueryBlock) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's requests' first `kv_bound` keys and values `[B, kv_bound, Hkv, D]` each, read a
        whole page (contiguous rows of the cache) at a time in one copy."""
        k_cache, v_cache = self.cache.k[layer_id], self.cache.v[layer_id]
        num_kv, head_dim = k_cache.shape[1:]

        def read(cache: torch.Tensor) -> torch.Tensor:
            paged = cache.view(-1, self.page_size * num_kv * head_dim).index_select(0, block.pages)
            return paged.view(block.num_requests, -1, num_kv, head_dim)[:, :block.kv_bound]

        return read(k_cache), read(v_cache)

    def _mask(self, i: int, block: QueryBlock, group: int, dtype: torch.dtype) -> ops.PairMask:
        mask = self._masks.get(i)
        if mask is None:
            # [b, pairs, kv_bound]
            hidden = block.hidden[:, :, 0].transpose(1, 2).repeat_interleave(group, dim=1)
            mask = self._masks[i] = ops.PairMask(hidden, dtype)
        return mask

    def _attend_block(self, layer_id: int, q_padded: torch.Tensor, block: QueryBlock,
                      i: int) -> torch.Tensor:
        """`[b * width, H, D]`: the block's padded query rows attended over their requests' keys."""
        num_reqs, width = block.gather.shape
        num_kv, head_dim = self.cache.k.shape[-2:]
        group = self.num_heads // num_kv
        f32 = torch.promote_types(q_padded.dtype, torch.float32)
        # Pairs (query row, query head of the KV group), row-major: [Hkv, b, width * group, D].
        q = (q_padded[block.gather].to(f32) * self.scale).view(num_reqs, width, num_kv, group, head_dim)
        q = q.permute(2, 0, 1, 3, 4).reshape(num_kv, num_reqs, width * group, head_dim)
        keys, vals = self._read_kv(layer_id, block)
        out = ops.chunked_attention(q, keys, vals, self._mask(i, block, group, f32))  # Hkv, b, pairs, D
        out = out.reshape(num_kv, num_reqs, width, group, head_dim).permute(1, 2, 0, 3, 4)
        return out.reshape(num_reqs * width, self.num_heads, head_dim).to(q_padded.dtype)
