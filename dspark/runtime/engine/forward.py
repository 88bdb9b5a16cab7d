"""The models a runtime serves with, their paged KV caches, and the helpers every forward pass shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.runtime.attention.metadata import AttentionBackend
from dspark.runtime.dsv4.target import Dsv4LayerBackend
from dspark.runtime.engine.requests import Request, RequestError
from dspark.runtime.kv_cache import PagedKVCache, RequestSlots
from dspark.runtime.layout import cache_slots, prefix_slots
from dspark.runtime.models.dspark_block_draft import DSparkBlockDraft
from dspark.runtime.models.families import ServingTarget
from dspark.runtime.sampling import BatchSampling, Generator, RowGenerators

DEVICES = {"cpu": "cpu", "cuda": "cuda", "ascend": "npu"}


def backend_device(backend: str) -> torch.device:
    """The torch device a backend runs on; a clear error where that device is absent."""
    name = DEVICES[backend]
    if name == "cuda" and not torch.cuda.is_available():
        raise RequestError("this deployment was compiled for CUDA but no GPU is visible; compile "
                           "a spec with backend.kind: cpu to dry-run it here")
    return torch.device(name)


@dataclass
class EngineModels:
    """The target and draft on their device; the target's caches belong to its attention backend.

    The draft's paged cache holds, per committed position, its context K/V (a projection of the
    target's hidden states there at the draft's `target_layer_ids`), at the same slot as a dense
    target's own K/V, so one page table serves both.
    """

    target: ServingTarget
    draft: DSparkBlockDraft
    draft_kv: PagedKVCache
    attn: AttentionBackend | Dsv4LayerBackend
    slots: RequestSlots
    device: torch.device
    generator: torch.Generator  # the runtime's sampling stream (requests with a seed have their own)

    @property
    def page_size(self) -> int:
        return self.slots.page_size

    def host_page_table(self, requests: list[Request]) -> torch.Tensor:
        """The requests' rows of the host page table `[B, pages_per_request]`."""
        return self.slots.page_table[[r.handle.slot for r in requests]]

    def tensor(self, values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    @property
    def capture(self) -> tuple[int, ...]:
        """The target states the draft reads, as decoder-layer counts (0: the embeddings)."""
        return self.draft.cfg.layers_before_capture

    def append_draft_context(self, features: torch.Tensor, positions: torch.Tensor, row_req: torch.Tensor,
                             page_table: torch.Tensor) -> None:
        """Write the draft's context K/V of newly committed positions from the target's `features`
        there (`[T, len(target_layer_ids) · d]`, the states at `capture`)."""
        loc = cache_slots(page_table, row_req, positions, self.page_size)
        for layer, (k, v) in enumerate(self.draft.context_kv(features, positions)):
            self.draft_kv.write(layer, loc, k, v)

    def draft_context(self, page_table: torch.Tensor,
                      prefix: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each draft layer's cached context K/V over the requests' first `max(prefix)` slots."""
        cap = -(-int(prefix.max()) // self.page_size) * self.page_size
        slots = prefix_slots(page_table, self.page_size, cap)
        return [(self.draft_kv.k[i][slots], self.draft_kv.v[i][slots])
                for i in range(self.draft.cfg.num_layers)]

    def generators(self, requests: list[Request]) -> Generator:
        """The runtime's generator, or one stream per request when any request has a seed."""
        if all(r.generator is None for r in requests):
            return self.generator
        return RowGenerators(tuple(r.generator for r in requests), self.generator)


def batch_sampling(requests: list[Request]) -> BatchSampling:
    return BatchSampling(tuple(r.sampling for r in requests))
