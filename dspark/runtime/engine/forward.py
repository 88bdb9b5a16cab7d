"""The models a runtime serves with, their paged KV caches, and the helpers every forward pass shares."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from dspark.runtime.attention.metadata import (
    AttentionBackend,
    PagedAttnMetadata,
    QueryBlocks,
    TorchPagedMetadata,
)
from dspark.runtime.attention.torch_paged import TorchPagedAttention
from dspark.runtime.attention.triton_paged import TritonPagedAttention
from dspark.runtime.engine.requests import Request, RequestError
from dspark.runtime.families.dsv4.dspark_stages import Dsv4DSparkStages
from dspark.runtime.families.dsv4.target import Dsv4LayerBackend
from dspark.runtime.kv_cache import PagedKVCache, RequestSlots
from dspark.runtime.layout import cache_slots, prefix_slots
from dspark.runtime.models.dspark_block_draft import BlockProposal, DSparkBlockDraft, TokenPicker
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


# A deployment's draft: a DSpark block draft (its own checkpoint), or the DSpark stages a DeepSeek-V4
# checkpoint carries beside its target. Both cache a context per committed position from the target's
# features, and draft a batch of blocks over it.
ServingDraft = DSparkBlockDraft | Dsv4DSparkStages


def draft_cache(draft: ServingDraft, num_pages: int, page_size: int, dtype: torch.dtype,
                device: torch.device) -> PagedKVCache:
    """The draft's paged context cache over the pool's pages (one slot per committed position, where the
    target's own K/V would sit): a block draft's K/V heads, or each V4 stage's one K=V latent."""
    if isinstance(draft, Dsv4DSparkStages):
        g = draft.cfg.stage
        return PagedKVCache(draft.cfg.num_layers, num_pages, page_size, 1, g.head_dim, dtype, device,
                            keys_are_values=True)
    cfg = draft.cfg
    return PagedKVCache(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)


class DraftGraphs(Protocol):
    """The draft step in captured graphs (`runners.draft_graphs.GraphDraftRunner`)."""

    def accepts(self, num_requests: int, gamma: int, greedy: bool, keep_conf_inputs: bool) -> bool: ...

    def propose(self, roots: torch.Tensor, prefix: torch.Tensor, page_table: torch.Tensor
                ) -> BlockProposal: ...


@dataclass
class EngineModels:
    """The target and draft on their device; the target's caches belong to its attention backend.

    The draft's paged cache holds, per committed position, its context K/V (a projection of the
    target's hidden states there at the draft's `target_layer_ids`), at the same slot as a dense
    target's own K/V, so one page table serves both.
    """

    target: ServingTarget
    draft: ServingDraft
    draft_kv: PagedKVCache
    attn: AttentionBackend | Dsv4LayerBackend
    slots: RequestSlots
    device: torch.device
    generator: torch.Generator  # the runtime's sampling stream (requests with a seed have their own)
    # the draft's block attention over its paged cache (None: the context is gathered densely)
    draft_attn: DraftPagedAttention | None = None
    # the greedy draft step's graphs, one per batch-size tier (None: every draft step runs eagerly)
    draft_graphs: DraftGraphs | None = None

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

    def propose(self, roots: torch.Tensor, prefix_host: Sequence[int], page_table: torch.Tensor,
                pick: TokenPicker | None, gamma: int, keep_conf_inputs: bool = False) -> BlockProposal:
        """One draft step of the requests whose roots sit at positions `prefix_host` (every position
        before is draft context): through the draft's paged attention where the device has one, else
        over the context gathered densely; a greedy step replays the draft's graph where it has one."""
        prefix = self.tensor(list(prefix_host))
        graphs = self.draft_graphs
        if graphs is not None and graphs.accepts(len(prefix_host), gamma, pick is None, keep_conf_inputs):
            return graphs.propose(roots, prefix, page_table)
        if self.draft_attn is None:
            return self.draft.propose(roots, prefix, self.draft_context(page_table, prefix), prefix, pick,
                                      gamma=gamma, keep_conf_inputs=keep_conf_inputs)
        assert not isinstance(self.draft, Dsv4DSparkStages), "the V4 stages gather their window"
        block = PagedDraftBlock.plan(self.draft_attn, prefix_host, prefix, gamma, page_table, self.page_size)
        return self.draft.propose_paged(roots, prefix, block, pick, gamma=gamma,
                                        keep_conf_inputs=keep_conf_inputs)

    def draft_context(self, page_table: torch.Tensor,
                      prefix: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each draft layer's cached context K/V `[B, C, Hkv, D]`: the requests' first `max(prefix)` slots,
        or for a draft that reads a window, the `context_window` positions before each request's block
        (positions below 0 read slot 0 of its page table, which the draft masks)."""
        window = self.draft.cfg.context_window
        if window is None:
            cap = -(-int(prefix.max()) // self.page_size) * self.page_size
            slots = prefix_slots(page_table, self.page_size, cap)
        else:
            positions = (prefix[:, None] - window + torch.arange(window, device=prefix.device)).clamp(min=0)
            rows = torch.arange(prefix.shape[0], device=prefix.device)[:, None].expand_as(positions)
            slots = cache_slots(page_table, rows, positions, self.page_size)
        return [(self.draft_kv.k[i][slots], self.draft_kv.v[i][slots])
                for i in range(self.draft.cfg.num_layers)]

    def generators(self, requests: list[Request]) -> Generator:
        """The runtime's generator, or one stream per request when any request has a seed."""
        if all(r.generator is None for r in requests):
            return self.generator
        return RowGenerators(tuple(r.generator for r in requests), self.generator)


DraftPagedAttention = TorchPagedAttention | TritonPagedAttention


def draft_attention(draft_kv: PagedKVCache, page_size: int, draft: ServingDraft,
                    device: torch.device) -> DraftPagedAttention | None:
    """The paged attention a block draft's block reads its context through: the batch-invariant torch one
    on the CPU, the Triton kernel on CUDA; None elsewhere and for the V4 stages, whose window (at most
    `context_window` entries a request) is gathered densely."""
    if isinstance(draft, Dsv4DSparkStages):
        return None
    cfg = draft.cfg
    if device.type == "cpu":
        return TorchPagedAttention(draft_kv, page_size, cfg.num_heads, cfg.head_dim ** -0.5)
    if device.type == "cuda":
        return TritonPagedAttention(draft_kv, page_size, cfg.num_heads, cfg.head_dim ** -0.5)
    return None


@dataclass(frozen=True)
class PagedDraftBlock:
    """One draft step's block attention, laid out once for every layer: request b's `gamma` block rows
    at positions `P_b … P_b + gamma - 1` write their keys and values into the draft's cache there (the
    slots the commit overwrites with context), and every block row sees its request's first
    `P_b + gamma` keys: the context and the whole block, which has no mask inside it. The attention
    masks by each row's last visible position, so all of a block's rows carry `P_b + gamma - 1`."""

    backend: DraftPagedAttention
    meta: PagedAttnMetadata

    @classmethod
    def plan(cls, backend: DraftPagedAttention, prefix_host: Sequence[int] | None, prefix: torch.Tensor,
             gamma: int, page_table: torch.Tensor, page_size: int) -> PagedDraftBlock:
        """`prefix` is the requests' first block positions on the page table's device; `prefix_host`
        the same on the host, which only the torch attention's query blocks read (the Triton kernel's
        metadata is derived on the device, so a captured graph can plan a step it replays)."""
        device = page_table.device
        num_reqs = prefix.shape[0]
        row_req = torch.arange(num_reqs, device=device).repeat_interleave(gamma)
        first = prefix[row_req]  # each block row's request's first block position
        positions = first + torch.arange(gamma, device=device).repeat(num_reqs)
        last_visible = first + (gamma - 1)
        fields = dict(
            qo_indptr=torch.arange(0, gamma * num_reqs + 1, gamma, dtype=torch.int32, device=device),
            kv_lens=(prefix + gamma).to(torch.int32),
            page_table=page_table, positions=last_visible,
            out_cache_loc=cache_slots(page_table, row_req, positions, page_size), max_seqlen_q=gamma)
        if isinstance(backend, TorchPagedAttention):
            if prefix_host is None:
                raise ValueError("the torch paged attention plans its query blocks on the host: "
                                 "pass prefix_host")
            blocks = QueryBlocks.plan([gamma * b for b in range(num_reqs + 1)],
                                      [p + gamma for p in prefix_host], last_visible, page_table, page_size,
                                      query_group=backend.query_group)
            return cls(backend, TorchPagedMetadata(**fields, blocks=blocks))
        return cls(backend, PagedAttnMetadata(**fields))

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.backend.attend(layer_id, q, k, v, self.meta)  # type: ignore[arg-type]


def batch_sampling(requests: list[Request]) -> BatchSampling:
    return BatchSampling(tuple(r.sampling for r in requests))
