"""Captured verify graphs: one graph per token tier, captured on a tier of padding requests, replayed on
whatever step was loaded into the buffers it reads. Every backend with graphs (CUDA's Triton and
FlashInfer attention, Ascend's fused attention, DeepSeek-V4 on either) runs this one runner; a generated
`graph_runner.py` fills in its constants, its graph API and its attention's hooks.

- `GraphApi` is CUDA graphs (warm-up on a side stream; graphs captured largest tier first share the
  largest one's memory pool) or NPU graphs (warm-up eagerly, one pool each).
- `GraphHooks` are what an attention backend needs around a graph: FlashInfer plans a step on the host
  before each replay (and registers each tier's graph wrapper before capturing), Ascend's fused attention
  and DeepSeek-V4's layers update the captured operators' lengths before each replay and capture inside
  their own context.
- Where a step's inputs live for the graphs to read and where its metadata is built: `GraphVerifyRunner`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import torch

from dspark.runtime.layout import StepShape, VerifyLayout, plan_verify
from dspark.runtime.runners.eager import EagerVerifyRunner
from dspark.runtime.runners.graph_buffers import StepBuffers

Outputs = tuple[torch.Tensor, torch.Tensor | None]  # hidden [tier, d], states [tier, w] or None
T = TypeVar("T")  # what a captured forward returns: the tensors its replays write


def packed_slots_for_tier(tier: int, *, max_running_requests: int, widest_request: int) -> int:
    """Request slots a compact tier's graph holds: every real request (at least one row each) plus the
    padding requests that carry the unused rows, at most `widest_request` rows apiece."""
    return min(max_running_requests, tier) + math.ceil(tier / widest_request)


def block_slots_for_tier(tier: int, *, num_draft_tokens: int) -> int:
    """Request slots a full-block (static, cap-accept) tier's graph holds: its batch size, every request
    running N rows."""
    return tier // num_draft_tokens


class GraphApi(Protocol):
    def capture(self, forward: Callable[[], T], context: AbstractContextManager[Any]) -> tuple[Any, T]:
        """Warm `forward` up, then capture it inside `context`; the graph and its output tensors."""
        ...


class CudaGraphs:
    """CUDA graphs: warmed up on a side stream (kernels compiled, the allocator settled outside the
    graph); each capture shares the previous one's memory pool, so capturing the largest tier first
    lets the smaller ones live inside its pool."""

    def __init__(self) -> None:
        self.pool: Any = None

    def capture(self, forward: Callable[[], T], context: AbstractContextManager[Any]) -> tuple[Any, T]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with context, torch.cuda.graph(graph, pool=self.pool):
            outputs = forward()
        self.pool = graph.pool()
        return graph, outputs


class NpuGraphs:
    """NPU graphs (torch_npu registers `torch.npu`): warmed up eagerly once, each with its own pool."""

    def capture(self, forward: Callable[[], T], context: AbstractContextManager[Any]) -> tuple[Any, T]:
        forward()
        graph = torch.npu.NPUGraph()
        with context, torch.npu.graph(graph):
            outputs = forward()
        return graph, outputs


class GraphHooks(Protocol):
    """An attention backend's part in capturing and replaying (`NO_HOOKS`: none)."""

    def capturing(self, tier: int, meta: Any) -> AbstractContextManager[Any]:
        """The context the tier's capture runs in, with the metadata it was captured on."""
        ...

    def before_capture(self, tier: int, meta: Any) -> None: ...

    def before_replay(self, tier: int, layout: VerifyLayout, meta: Any) -> None:
        """A step is about to replay `tier`'s graph (its layout and, where the runner builds it outside
        the graph, its metadata)."""
        ...


class NoHooks:
    def capturing(self, tier: int, meta: Any) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def before_capture(self, tier: int, meta: Any) -> None:
        pass

    def before_replay(self, tier: int, layout: VerifyLayout, meta: Any) -> None:
        pass


NO_HOOKS = NoHooks()


class AscendHooks(NoHooks):
    """Ascend's fused attention (`AscendFusedAttention`): a tier is captured inside its context, and the
    captured operator's sequence lengths, which it takes on the host, are updated before each replay."""

    def __init__(self, attn: Any) -> None:
        self.attn = attn

    def capturing(self, tier: int, meta: Any) -> AbstractContextManager[Any]:
        return self.attn.capturing(tier)  # type: ignore[no-any-return]

    def before_replay(self, tier: int, layout: VerifyLayout, meta: Any) -> None:
        self.attn.update_captured(tier, list(layout.host_qo_indptr[1:]), list(layout.host_kv_lens))


class FlashInferHooks(NoHooks):
    """FlashInfer's paged attention (`FlashInferPagedAttention`): each tier's graph has its own wrapper
    over fixed-size page buffers, and every step is planned on the host before its replay."""

    def __init__(self, attn: Any, slots_for_tier: Callable[[int], int], pages_per_request: int) -> None:
        self.attn = attn
        self.slots_for_tier = slots_for_tier
        self.pages_per_request = pages_per_request

    def before_capture(self, tier: int, meta: Any) -> None:
        self.attn.add_graph(tier, self.slots_for_tier(tier), self.pages_per_request)
        self.attn.plan(meta, graph=tier)

    def before_replay(self, tier: int, layout: VerifyLayout, meta: Any) -> None:
        self.attn.plan(meta, graph=tier)


class LayerHooks(NoHooks):
    """DeepSeek-V4's device layers (`Dsv4CudaLayers`, `Dsv4AscendLayers`): a tier is captured inside their
    context on its metadata, whose device arrays they refresh from each step's before its replay."""

    def __init__(self, attn: Any) -> None:
        self.attn = attn

    def capturing(self, tier: int, meta: Any) -> AbstractContextManager[Any]:
        return self.attn.capturing(tier, meta)  # type: ignore[no-any-return]

    def before_replay(self, tier: int, layout: VerifyLayout, meta: Any) -> None:
        self.attn.update_captured(tier, meta)


class GraphVerifyRunner(EagerVerifyRunner):
    """Plans a step (as the eager runner does), loads it into the inputs the graphs read, replays its
    tier's graph.

    Where a step's inputs live and where its attention metadata is built depend on the backend:

    - `loads_layout` (the dense families): the whole layout is copied into `StepBuffers` before each
      replay and the graphs read it there; otherwise (DeepSeek-V4's layers) only the input ids are, and
      the metadata carries its own device arrays, which the hooks refresh before each replay.
    - `metadata_in_graph` (Triton's and Ascend's attention): the metadata is derived from the buffers
      inside the graph; otherwise (FlashInfer's host plan, DeepSeek-V4's layers) it is built before each
      replay and handed to the hooks.
    """

    def __init__(self, target: Any, attn: Any, shape: StepShape, pages_per_request: int,
                 build_metadata: Callable[[VerifyLayout], Any], graphs: GraphApi,
                 capture: tuple[int, ...] = (), hooks: GraphHooks = NO_HOOKS, loads_layout: bool = True,
                 metadata_in_graph: bool = True) -> None:
        if metadata_in_graph and not loads_layout:
            raise ValueError("metadata built inside the graph reads the layout's buffers: load the layout")
        # the target states the draft reads (`capture`) are outputs of every graph
        super().__init__(target, attn, shape, build_metadata, capture)
        self.pages_per_request = pages_per_request
        self.hooks = hooks
        self.loads_layout = loads_layout
        self.metadata_in_graph = metadata_in_graph
        tiers = shape.tiers
        slots = shape.slots_for_tier(tiers[-1]) if shape.slots_for_tier is not None else 0
        self.buffers = StepBuffers(slots, tiers[-1], pages_per_request, shape.num_draft_tokens, self.device)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, Outputs] = {}
        for tier in reversed(tiers):  # largest first: CUDA graphs of smaller tiers reuse its pool
            self.graphs[tier], self.outputs[tier] = self._capture(tier, graphs)

    def run_states(self, layout: VerifyLayout, input_ids: torch.Tensor) -> Outputs:
        tier, rows = layout.tier, layout.total_rows
        if self.loads_layout:
            self.buffers.load(layout, input_ids)
        else:
            self.buffers.input_ids[:rows].copy_(input_ids)
            self.buffers.input_ids[rows:tier].zero_()
        meta = None if self.metadata_in_graph else self.build_metadata(layout)
        self.hooks.before_replay(tier, layout, meta)
        self.graphs[tier].replay()
        hidden, states = self.outputs[tier]
        return hidden[:rows], None if states is None else states[:rows]

    def _capture(self, tier: int, graphs: GraphApi) -> tuple[Any, Outputs]:
        # Captured on a tier of padding requests only; a replay computes whatever step was loaded.
        empty = torch.zeros(0, self.pages_per_request, dtype=torch.int32, device=self.device)
        padding_only = plan_verify((), (), [], empty, self.shape, self.device, tier=tier, slots=[])
        layout = padding_only
        if self.loads_layout:
            self.buffers.load(padding_only, self.buffers.input_ids[:0])
            layout = self.buffers.view(padding_only)
        meta = self.build_metadata(layout)
        self.hooks.before_capture(tier, meta)
        ids = self.buffers.input_ids[:tier]
        positions = layout.positions if self.loads_layout else meta.device.positions

        def forward() -> Outputs:
            step_meta = self.build_metadata(layout) if self.metadata_in_graph else meta
            return self.target.forward_paged_states(ids, positions, self.attn, step_meta, self.capture)

        return graphs.capture(forward, self.hooks.capturing(tier, meta))
