"""A step's target forward, from host values: the layout is planned, its attention metadata built and the
target run (an extend step) or the verify runner run (a verify step) on the rank that holds them.

What a step needs arrives as an `ExtendForward`, `VerifyForward` or `LogitsForward`: lengths, page-table
rows, slots and the tier as host values, and the token ids. Under tensor parallelism the engine's rank
broadcasts exactly these and every rank plans its own layout and metadata on its own device
(`dspark.runtime.distributed.lockstep`): no device tensor or backend object (a FlashInfer wrapper's plan,
a captured graph) crosses a process, and a rank's graphs replay on its own buffers. The hidden states of
the last forward stay on each rank for the logits call that follows, which names rows of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from dspark.runtime.attention.metadata import AttentionBackend, AttentionMetadata
from dspark.runtime.families.dsv4.target import Dsv4LayerBackend
from dspark.runtime.layout import ExtendLayout, VerifyLayout, plan_extend
from dspark.runtime.models.families import ServingTarget
from dspark.runtime.package import VerifyRunner


@dataclass(frozen=True)
class ExtendForward:
    """Rows appended after each request's cache (a prefill chunk, a target-only decode step), and a
    padding request of `padding_rows` after them (DP attention)."""

    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    page_table: torch.Tensor  # int32 [B, pages_per_request], host
    slots: tuple[int, ...]
    padding_rows: int
    input_ids: torch.Tensor  # int64 [sum(extend_lens)]: the real rows' tokens
    capture: tuple[int, ...]  # the target states to return (decoder-layer counts; 0: the embeddings)


@dataclass(frozen=True)
class VerifyForward:
    """A verify step as the planner decided it; `tier` forces the tier (DP attention's global one)."""

    run_lens: tuple[int, ...]
    verify_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    page_table: torch.Tensor  # int32 [B, pages_per_request], on any device (a follower gets the host's copy)
    slots: tuple[int, ...]
    tier: int | None
    fixed_ids: torch.Tensor  # int64 [B * N]: each request's root and drafts at the fixed stride


@dataclass(frozen=True)
class LogitsForward:
    """Logits of `rows` of the last forward's hidden states (None: all), projected over `pad_to` rows
    (zero rows after them) where every DP rank must project the same number."""

    rows: tuple[int, ...] | None
    pad_to: int | None = None


StepCommand = ExtendForward | VerifyForward | LogitsForward


def on_host(command: StepCommand) -> StepCommand:
    """`command` with its tensors on the host: what crosses to another rank."""
    moved = {name: value.cpu() for name, value in vars(command).items() if isinstance(value, torch.Tensor)}
    return replace(command, **moved) if moved else command


class StepForwards(Protocol):
    """What the engine runs its forwards through: a `StepForward`, or under tensor parallelism the
    `LeaderForward` that broadcasts each command to the followers first."""

    @property
    def runner(self) -> VerifyRunner: ...

    def extend(self, step: ExtendForward) -> tuple[torch.Tensor, torch.Tensor | None, ExtendLayout]: ...

    def verify(self, step: VerifyForward) -> tuple[VerifyLayout, torch.Tensor, torch.Tensor | None]: ...

    def logits(self, step: LogitsForward) -> torch.Tensor: ...


class StepForward:
    """Runs a rank's share of each step's forward; the engine's rank and its followers run the same."""

    def __init__(self, target: ServingTarget, attn: AttentionBackend | Dsv4LayerBackend,
                 build_extend_metadata: Callable[[ExtendLayout], AttentionMetadata | Any],
                 runner: VerifyRunner, device: torch.device) -> None:
        self.target = target
        self.attn = attn
        self.build_extend_metadata = build_extend_metadata
        self.runner = runner
        self.device = device
        self.hidden: torch.Tensor | None = None  # the last forward's [rows, d], which `logits` reads

    def extend(self, step: ExtendForward) -> tuple[torch.Tensor, torch.Tensor | None, ExtendLayout]:
        layout = plan_extend(step.prefix_lens, step.extend_lens, step.page_table, self.runner.shape.page_size,
                             self.device, step.slots, padding_rows=step.padding_rows)
        ids = step.input_ids.to(self.device)
        if step.padding_rows:
            ids = F.pad(ids, (0, step.padding_rows))
        hidden, states = self.target.forward_paged_states(ids, layout.positions, self.attn,
                                                          self.build_extend_metadata(layout), step.capture)
        self.hidden = hidden
        return hidden, states, layout

    def verify(self, step: VerifyForward) -> tuple[VerifyLayout, torch.Tensor, torch.Tensor | None]:
        layout = self.runner.plan(step.run_lens, step.verify_lens, list(step.prefix_lens), step.page_table,
                                  list(step.slots), tier=step.tier)
        hidden, states = self.runner.run_states(layout, layout.pack(step.fixed_ids.to(self.device)))
        self.hidden = hidden
        return layout, hidden, states

    def logits(self, step: LogitsForward) -> torch.Tensor:
        assert self.hidden is not None, "logits before any forward"
        hidden = self.hidden if step.rows is None else self.hidden[list(step.rows)]
        rows = hidden.shape[0]
        if step.pad_to is None or step.pad_to == rows:
            return self.target.compute_logits(hidden)
        # rows are dim 0 ([T, dim], or [T, hc_mult, dim] hyper-connection streams)
        padding = (0, 0) * (hidden.dim() - 1) + (0, step.pad_to - rows)
        return self.target.compute_logits(F.pad(hidden, padding))[:rows]


def run_forward(forward: StepForwards, step: StepCommand) -> Any:
    """Run any step command through `forward` (its result as that method returns it)."""
    if isinstance(step, ExtendForward):
        return forward.extend(step)
    if isinstance(step, VerifyForward):
        return forward.verify(step)
    return forward.logits(step)
