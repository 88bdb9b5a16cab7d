"""Verify plans: how many rows each request verifies, and runs, in a step (docs/planner.md).

The generated `planner_config.py` instantiates the plan of its verify mode. A plan is immutable
configuration; the only per-runtime state, the lagged survival history, is owned by the runtime and
passed in.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dspark.modes import SpeculationOff, VerifyMode, num_draft_tokens
from dspark.runtime.planner.budget import (
    BudgetDecision,
    Ranking,
    ScheduleConfig,
    decide_budget,
    fraction_of,
    price_of_rows,
    tier_aligned_budget,
)
from dspark.runtime.planner.cost_models import CostModel, cost_model_from_dict
from dspark.runtime.planner.survival import LaggedSurvival, survival_from_logits
from dspark.runtime.planner.survival_map import SurvivalMap
from dspark.runtime.planner.switch import SpeculationSwitch, SwitchConfig


@dataclass(frozen=True)
class StepPlan:
    """One step's decision, on the host: rows per request, and (adaptive modes) why."""

    verify_lens: tuple[int, ...]  # the rows whose drafts may be accepted, root included
    run_lens: tuple[int, ...]  # the rows each request puts into the target forward
    survival: torch.Tensor | None = None  # float32 [B, gamma] on the device: what the rows were allocated by
    decision: BudgetDecision | None = None
    aligned_budget: int | None = None  # the budget after graph-tier alignment, when it applied
    # The table's price of the rows that run (the step offset included): the decision's, unless a rule applied
    # after it (`one_row_class`) changed the rows. What the step's measured time is compared with.
    step_seconds: float | None = None

    @functools.cached_property  # read by the run's counters and again by the step recorder
    def tau(self) -> float | None:
        """Expected committed tokens of the rows actually allocated: B + the survival of every
        verified draft (None without a planner)."""
        if self.decision is None or self.survival is None:
            return None
        lens = torch.tensor(self.verify_lens, device=self.survival.device)
        verified = torch.arange(self.survival.shape[1], device=lens.device)[None, :] < (lens - 1)[:, None]
        return len(self.verify_lens) + float((self.survival * verified).sum())


class VerifyPlan(Protocol):
    """What the engine asks of a plan: the step's rows from the draft's confidence."""

    @property
    def mode(self) -> VerifyMode: ...

    @property
    def gamma(self) -> int: ...

    @property
    def lag_steps(self) -> int: ...

    @property
    def num_draft_tokens(self) -> int: ...

    @property
    def step_offset_window(self) -> int:
        """Steps the engine's measured `StepOffset` is the median of (0: the planner prices by the table
        alone)."""
        ...

    def plan_step(self, confidence_logits: torch.Tensor | None, num_reqs: int, slots: Sequence[int],
                  generations: Sequence[int], history: LaggedSurvival | None,
                  offset_seconds: float = 0.0, sampled: Sequence[bool] = (),
                  context_len: float | None = None) -> StepPlan:
        """The step's `verify_lens`; `offset_seconds` (the engine's measured `StepOffset`) is added to
        every price the budget weighs; `sampled[r]`: request r's drafts were sampled."""
        ...

    def history_lag(self) -> int:
        """The lag of the survival history the runtime keeps for `plan_step` (0: none)."""
        ...

    def speculation_switch(self) -> SpeculationSwitch | None:
        """A runtime's off-state machine, or None where every step speculates."""
        ...

    # -- under DP attention (dspark.runtime.distributed.dp_sync) ----------------------------------------
    @property
    def fills_tier(self) -> bool:
        """Whether a step's rows grow to fill the graph tier it runs (graph-tier alignment)."""
        ...

    def align_to_tier(self, step: StepPlan, tier: int, context_len: float | None = None) -> StepPlan:
        """`step` refilled for the (DP-global) `tier` it runs, where `fills_tier` (its price, at the batch's
        mean `context_len`, then that of the rows it runs); else `step`."""
        ...

    def uniform_rows(self, max_reqs: int) -> int:
        """The rows every request verifies in the uniform step of batches of up to `max_reqs`: the
        layout every DP rank falls back to when one could not plan."""
        ...

    def uniform_step(self, num_reqs: int, rows: int) -> StepPlan:
        """Every request verifies `rows` rows (root included), whatever its confidence."""
        ...


@dataclass(frozen=True)
class StaticVerifyPlan:
    """`static` mode: no planner, every request verifies all `N = gamma + 1` rows.

    With a confidence head the survival is still computed (with the calibration's temperatures,
    when the spec has one), so a static run's recording carries it for calibration and reports.
    """

    gamma: int
    temperatures: tuple[float, ...] | None = None
    survival_map: SurvivalMap | None = None
    mode: VerifyMode = VerifyMode.STATIC
    lag_steps: int = 0
    step_offset_window: int = 0  # nothing is priced

    def __post_init__(self) -> None:
        if self.gamma < 1:
            raise ValueError(f"gamma must be >= 1 (N = gamma + 1 >= 2), got {self.gamma}")
        if self.mode.plans:
            raise ValueError(f"StaticVerifyPlan serves static mode, not {self.mode}")

    @property
    def num_draft_tokens(self) -> int:
        return num_draft_tokens(self.gamma)

    def history_lag(self) -> int:
        return 0  # every request verifies every row: nothing to remember

    def plan_step(self, confidence_logits: torch.Tensor | None, num_reqs: int, slots: Sequence[int] = (),
                  generations: Sequence[int] = (), history: LaggedSurvival | None = None,
                  offset_seconds: float = 0.0, sampled: Sequence[bool] = (),
                  context_len: float | None = None) -> StepPlan:
        full = (self.num_draft_tokens,) * num_reqs
        survival = None
        if confidence_logits is not None:
            survival = survival_from_logits(confidence_logits, self.temperatures, self.survival_map)
        return StepPlan(full, full, survival)

    def speculation_switch(self) -> None:
        return None  # no cost model prices the steps

    fills_tier = False

    def align_to_tier(self, step: StepPlan, tier: int, context_len: float | None = None) -> StepPlan:
        return step

    def uniform_rows(self, max_reqs: int) -> int:
        return self.num_draft_tokens  # the static step is uniform already

    def uniform_step(self, num_reqs: int, rows: int) -> StepPlan:
        full = (self.num_draft_tokens,) * num_reqs
        return StepPlan(full, full)


@dataclass(frozen=True)
class AdaptiveVerifyPlan:
    """`cap-accept` and `compact`: confidence → survival → budget → `verify_lens`.

    The budget is the argmax of expected committed tokens per second under the cost model
    (every row when there is none); it may be chosen from confidence `lag_steps` old, as an
    overlapped scheduler must, while the rows are allocated by this step's survival.
    """

    gamma: int
    mode: VerifyMode
    min_verify_len: int = 1
    max_verify_len: int = 0
    survival_eps: float = 1e-6
    align_to_graph_tier: bool = False
    lag_steps: int = 0
    temperatures: tuple[float, ...] | None = None
    survival_map: SurvivalMap | None = None  # the calibration's monotone map after the temperatures
    cost_model: dict[str, Any] | None = None  # the table as the compiler embedded it
    token_tiers: tuple[int, ...] = ()  # graph tiers a packed step is padded to
    forced_budget_fraction: float | None = None  # experiments: verify this share of candidates
    speculation_off: SpeculationOff = SpeculationOff.NEVER  # may the planner switch speculation off
    off_margin: float = SwitchConfig.margin  # ... and its hysteresis (`SwitchConfig`)
    off_patience: int = SwitchConfig.patience
    probe_every: int = SwitchConfig.probe_every
    step_offset_window: int = 64  # the measured step offset's window (`StepOffset`; 0 turns it off)
    # The most rows of each query-block class of the attention backend, where it pays per class
    # (`TorchPagedAttention.row_classes`; empty: the backend's cost follows the rows): a packed step's
    # greedy requests are kept in one class (`one_row_class`), unless its steps run graph tiers.
    row_classes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.mode.plans:
            raise ValueError(f"AdaptiveVerifyPlan serves cap-accept and compact, not {self.mode}")
        if self.temperatures is not None and len(self.temperatures) != self.gamma:
            raise ValueError(f"{len(self.temperatures)} temperatures for gamma {self.gamma}; "
                             "give one per draft position")
        if self.survival_map is not None and self.survival_map.gamma != self.gamma:
            raise ValueError(f"a survival map of {self.survival_map.gamma} positions for gamma {self.gamma}")
        if self.align_to_graph_tier and not self.token_tiers:
            raise ValueError("align_to_graph_tier needs the graph's token_tiers")
        if any(b < 1 for b in self.row_classes) or list(self.row_classes) != sorted(set(self.row_classes)):
            raise ValueError(f"row_classes must be increasing positive row counts, got {self.row_classes}")
        if self.step_offset_window < 0:
            raise ValueError(f"step_offset_window must be >= 0 (0 turns the measured offset off), got "
                             f"{self.step_offset_window}")
        if self.forced_budget_fraction is not None and not 0.0 <= self.forced_budget_fraction <= 1.0:
            raise ValueError(f"forced_budget_fraction must be in [0, 1], got "
                             f"{self.forced_budget_fraction}")
        # Validate eagerly so that a bad generated config fails at import, not mid-serving.
        object.__setattr__(self, "_config", ScheduleConfig(self.gamma, self.min_verify_len,
                                                           self.max_verify_len, self.survival_eps))
        table = None if self.cost_model is None else cost_model_from_dict(self.cost_model, "PLAN.cost_model")
        object.__setattr__(self, "_table", table)
        object.__setattr__(self, "speculation_off", SpeculationOff(self.speculation_off))
        switch = SwitchConfig(self.off_margin, self.off_patience, self.probe_every)
        object.__setattr__(self, "_off_switch", switch)
        if self.speculation_off is SpeculationOff.AUTO and (table is None or not table.prices_decode):
            raise ValueError("speculation_off 'auto' needs a cost model with the decode term "
                             "(decode_bs_probes, decode_seconds) to price a step without speculation")

    @property
    def num_draft_tokens(self) -> int:
        return num_draft_tokens(self.gamma)

    @property
    def schedule(self) -> ScheduleConfig:
        return self._config  # type: ignore[attr-defined, no-any-return]

    @property
    def table(self) -> CostModel | None:
        return self._table  # type: ignore[attr-defined, no-any-return]

    @property
    def off_switch(self) -> SwitchConfig:
        """The off state's hysteresis."""
        return self._off_switch  # type: ignore[attr-defined, no-any-return]

    def speculation_switch(self) -> SpeculationSwitch | None:
        """A runtime's off-state machine, where the planner may switch speculation off."""
        if self.speculation_off is SpeculationOff.NEVER or self.forced_budget_fraction is not None:
            return None
        assert self.table is not None  # __post_init__: 'auto' has a table that prices decoding
        return self.off_state(self.table.decode_time)

    def off_state(self, decode_time: Callable[[int], float]) -> SpeculationSwitch:
        """This plan's off-state machine, pricing a target-only step of B requests by `decode_time(B)` (the
        table's decode term when serving; a simulation may price it otherwise)."""
        assert self.table is not None  # the switch prices the drafted steps by the table
        limits = [rows for rows in (self.tier_row_limit, self.table.max_rows) if rows is not None]
        return SpeculationSwitch(self.table, self.off_switch, self.schedule.cap, min(limits, default=None),
                                 decode_time)

    @property
    def tier_row_limit(self) -> int | None:
        """The most rows a packed step may run: the largest captured tier (a full-block step always runs
        B x N rows; None without tiers)."""
        return self.token_tiers[-1] if self.token_tiers and self.mode.packs_rows else None

    def with_overrides(self, **changes: Any) -> AdaptiveVerifyPlan:
        """A copy with some fields replaced (e.g. a forced budget fraction for an experiment)."""
        return dataclasses.replace(self, **changes)

    def history_lag(self) -> int:
        """The lag of the survival history a runtime keeps for this plan: `lag_steps`, or 1 without a lag,
        for the budget of requests that sample (`plan_step`)."""
        return self.lag_steps or 1

    def plan_step(self, confidence_logits: torch.Tensor | None, num_reqs: int, slots: Sequence[int],
                  generations: Sequence[int], history: LaggedSurvival | None = None,
                  offset_seconds: float = 0.0, sampled: Sequence[bool] = (),
                  context_len: float | None = None) -> StepPlan:
        """`context_len`: the batch's mean cached tokens a request, which a table with a context term prices
        (None: the table's own context). `sampled[r]`: request r's drafts were sampled, not greedy (empty:
        none were). `history` (lag
        `history_lag()`) is needed with a lag and with any sampled request."""
        if confidence_logits is None:
            raise ValueError(f"{self.mode} planning needs the draft's confidence logits; use a draft "
                             "with a confidence head")
        cfg = self.schedule
        survival = survival_from_logits(confidence_logits, self.temperatures, self.survival_map)
        budget_survival = survival
        any_sampled = any(sampled)
        if history is not None:
            if history.lag_steps != self.history_lag():
                raise ValueError(f"the survival history lags {history.lag_steps} steps; this plan needs "
                                 f"{self.history_lag()} (history_lag())")
            # Greedy steps without a lag only record: the history is there for a sampled request later.
            if self.lag_steps or any_sampled:
                budget_survival = history.lagged(slots, generations, survival)
            history.record(slots, generations, survival)
            if not self.lag_steps and any_sampled:
                # Slot k's confidence reads the token drawn at slot k - 1, so a sampled request's
                # survival past draft j depends on draft j's draw. A budget chosen from it would make
                # whether draft j is verified depend on its own draw, and the committed token would no
                # longer follow the target's distribution (docs/planner.md, "Sampled drafts"); the
                # budget reads such a request's survival from its previous step instead, and the
                # allocation by this step's survival stays a stopping rule along each row.
                if len(sampled) != num_reqs:
                    raise ValueError(f"sampled has {len(sampled)} flags for {num_reqs} requests")
                mask = torch.tensor(list(sampled), dtype=torch.bool, device=survival.device)
                budget_survival = torch.where(mask[:, None], budget_survival, survival)
        elif self.lag_steps or any_sampled:
            raise ValueError("plan_step needs the runtime's survival history (LaggedSurvival(history_lag())) "
                             + ("for its lag" if self.lag_steps else "for requests that sample"))
        # One copy to the host and one ranking of each survival: without lag the budget and the
        # allocation share both.
        budget_ranking = Ranking.of(budget_survival, cfg)
        # Packed rows must fit the largest captured tier; a full-block step always runs B x N rows.
        max_rows = self.tier_row_limit
        table = self.table
        if table is not None and context_len is not None:
            table = table.at_context(context_len)
        decision = decide_budget(budget_ranking, table, cfg, max_rows=max_rows, offset_seconds=offset_seconds)
        ranking = budget_ranking if budget_survival is survival else Ranking.of(survival, cfg)
        budget = decision.budget
        if self.forced_budget_fraction is not None:  # in [0, 1]: checked by __post_init__
            budget = fraction_of(budget_ranking.num_candidates, self.forced_budget_fraction)
            if max_rows is not None:
                budget = min(budget, max_rows - num_reqs * cfg.floor)
        aligned = None
        if self.align_to_graph_tier and self.mode.packs_rows:
            aligned = tier_aligned_budget(num_reqs, budget, cfg.floor, cfg.cap, self.token_tiers)
            budget = aligned
        verify_lens = tuple(ranking.verify_lens(budget).tolist())
        if self.row_classes and self.mode.packs_rows and not self.token_tiers:
            # (a step padded to a graph tier pays for the tier's rows, which alignment may fill)
            verify_lens = one_row_class(verify_lens, self.row_classes, sampled, cfg.cap)
        step_seconds = decision.predicted_step_seconds
        if table is not None and sum(verify_lens) != decision.num_rows:  # forced, aligned or one row class
            step_seconds = price_of_rows(table, num_reqs, sum(verify_lens), offset_seconds)
        run_lens = verify_lens if self.mode.packs_rows else (self.num_draft_tokens,) * num_reqs
        return StepPlan(verify_lens, run_lens, survival, decision, aligned, step_seconds)

    @property
    def fills_tier(self) -> bool:
        return self.align_to_graph_tier and self.mode.packs_rows

    def align_to_tier(self, step: StepPlan, tier: int, context_len: float | None = None) -> StepPlan:
        """Under DP attention every DP rank runs the largest tier any needs: with graph-tier alignment a
        DP rank's padding rows there are paid for too, so its budget grows to fill that tier (never
        past `B * cap`, never below survival_eps: it may stay short); the step's price grows by what the
        table says the rows it adds cost."""
        if not self.fills_tier or step.survival is None:
            return step
        cfg, num_reqs = self.schedule, len(step.verify_lens)
        budget = sum(step.verify_lens) - num_reqs * cfg.floor
        filled = max(budget, min(tier, num_reqs * cfg.cap) - num_reqs * cfg.floor)
        if filled == budget:
            return step
        verify_lens = tuple(Ranking.of(step.survival, cfg).verify_lens(filled).tolist())
        seconds, table = step.step_seconds, self.table
        if seconds is not None and table is not None:
            if context_len is not None:
                table = table.at_context(context_len)
            seconds += (price_of_rows(table, num_reqs, sum(verify_lens))
                        - price_of_rows(table, num_reqs, sum(step.verify_lens)))
        return dataclasses.replace(step, verify_lens=verify_lens, run_lens=verify_lens, aligned_budget=filled,
                                   step_seconds=seconds)

    def uniform_rows(self, max_reqs: int) -> int:
        if not self.mode.packs_rows:
            return self.num_draft_tokens  # cap-accept runs every row anyway
        cap = self.schedule.cap
        return min(cap, self.token_tiers[-1] // max_reqs) if self.token_tiers else cap

    def uniform_step(self, num_reqs: int, rows: int) -> StepPlan:
        lens = (rows,) * num_reqs
        return StepPlan(lens, lens if self.mode.packs_rows else (self.num_draft_tokens,) * num_reqs)


def one_row_class(verify_lens: Sequence[int], bounds: Sequence[int], sampled: Sequence[bool],
                  cap: int) -> tuple[int, ...]:
    """`verify_lens` with every greedy request below the step's widest query-block class raised to that
    class's fewest rows (never past `cap`).

    Where the attention pays a call per class of rows per request (the CPU backend's tiles of
    (row, query head) pairs), a step whose requests span two classes costs more than its rows say:
    measured at B = 16, 12 requests of 8 rows and 4 of 3 cost more than all 16 at 8 rows, while layouts
    within one class cost what their rows do (benchmarks/verify_step_layouts.py). The cost table prices
    rows alone, so the budget cannot see this; raising the short requests into the widest class saves
    the call and verifies drafts for the rows' price alone. Greedy requests only: a sampled request's
    draft j must be verified or not whatever it drew (docs/planner.md, "Sampled drafts"), and whether
    any request reaches the widest class can depend on another request's survival past its own draws.
    """
    def row_class(rows: int) -> int:
        return bisect.bisect_left(bounds, rows)

    widest = max((row_class(rows) for rows in verify_lens), default=0)
    if widest == 0:
        return tuple(verify_lens)
    fewest = min(bounds[widest - 1] + 1, cap)
    flags = sampled or (False,) * len(verify_lens)
    return tuple(rows if is_sampled else max(rows, fewest)
                 for rows, is_sampled in zip(verify_lens, flags, strict=True))
