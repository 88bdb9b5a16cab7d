"""The eager verify runner: lay a step out, build its attention metadata once, run the target forward.

Without graph capture there is nothing backend-specific in running a step, so every backend's
generated `graph_runner.py` uses this class when `graph.enabled` is false (and the CPU backend,
which captures no graphs, always: with tiers its steps are still padded to their tier, exactly as a
replay would be, so tier effects and tier alignment run and can be measured on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dspark.runtime.attention.metadata import AttentionBackend, AttentionMetadata
from dspark.runtime.layout import StepShape, VerifyLayout, plan_verify
from dspark.runtime.models.families import ServingTarget


class EagerVerifyRunner:
    def __init__(self, target: ServingTarget, attn: AttentionBackend, shape: StepShape,
                 build_metadata: Callable[[VerifyLayout], AttentionMetadata], capture: tuple[int, ...] = ()
                 ) -> None:
        self.target = target
        self.capture = capture  # the target states the draft reads (decoder-layer counts; 0: embeddings)
        self.attn = attn
        self.shape = shape
        self.build_metadata = build_metadata
        self.device = target.lm_head.weight.device

    def plan(self, run_lens: tuple[int, ...], verify_lens: tuple[int, ...], prefix_lens: list[int],
             page_table: torch.Tensor, slots: list[int], tier: int | None = None) -> VerifyLayout:
        return plan_verify(run_lens, verify_lens, prefix_lens, page_table, self.shape, self.device, tier=tier,
                           slots=slots)

    def run(self, layout: VerifyLayout, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states `[total_rows, d]` of the real rows; padding rows run but are dropped."""
        return self.run_states(layout, input_ids)[0]

    def run_states(self, layout: VerifyLayout, input_ids: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`run` plus the real rows' target states at `capture` (what the draft's context reads)."""
        ids = F.pad(input_ids, (0, layout.num_padding_rows))
        hidden, states = self.target.forward_paged_states(ids, layout.positions, self.attn,
                                                          self.build_metadata(layout), self.capture)
        real = slice(0, layout.total_rows)
        return hidden[real], None if states is None else states[real]
