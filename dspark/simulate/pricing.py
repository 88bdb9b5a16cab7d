"""What a simulated step costs: the cost table's seconds for the rows the target runs.

The same runtime tables the planner evaluates (`dspark.runtime.planner.cost_models`) price every
policy's step, draft term included, so the adaptive policy is judged by the cost model it plans with.
A step of a deployment with graph tiers runs its tier (padding rows included); a `tier` table prices
that itself, the other kinds are asked about the padded row count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dspark.runtime.layout import tier_for
from dspark.runtime.planner.cost_models import AdditiveCostTable, CostModel, SpsTable, TierCostTable


class CostFitError(ValueError):
    """The cost table says nothing about a step the simulation needs priced."""


@dataclass(frozen=True)
class StepPricer:
    """Seconds of one decode step: verify (the table) plus the draft term when the table has one."""

    table: CostModel
    tiers: tuple[int, ...] = ()  # graph tiers a step is padded to; () = steps run their real rows
    # Seconds every step takes beyond the table: engine work a profile does not time (accepting,
    # committing, the draft context, planning), measured on a recording's own steps. 0: the table alone.
    step_overhead: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.step_overhead < float("inf"):
            raise ValueError(f"step_overhead must be a finite number of seconds >= 0, got "
                             f"{self.step_overhead}")

    def padded_rows(self, rows: int) -> int:
        """Rows the target runs for a step of `rows` real rows: its tier when the deployment has tiers."""
        return tier_for(rows, self.tiers) if self.tiers else rows

    def seconds(self, num_reqs: int, rows: int) -> float:
        """Predicted seconds of a step of `num_reqs` requests and `rows` real rows."""
        return (self.table.step_time(num_reqs, self.padded_rows(rows)) + self.table.draft_time(num_reqs)
                + self.step_overhead)

    @property
    def decode_source(self) -> str:
        """What prices a target-only decode step: the table's decode term, or its verify step of one row
        per request without the draft (a table profiled before the decode term was measured)."""
        return ("the table's decode term" if self.table.prices_decode
                else "the table's verify step at one row per request, no draft (it has no decode term)")

    def decode_time(self, num_reqs: int) -> float:
        """A target-only decode step of `num_reqs` requests (one row each) as the planner prices it: the
        table's decode term, or its verify step of those rows without the draft (`decode_source`)."""
        if self.table.prices_decode:
            return self.table.decode_time(num_reqs)
        return self.table.step_time(num_reqs, self.padded_rows(num_reqs))

    def decode_seconds(self, num_reqs: int) -> float:
        """Predicted seconds of a target-only decode step: `decode_time` plus the overhead the planner
        never sees."""
        return self.decode_time(num_reqs) + self.step_overhead

    def step_seconds(self, num_reqs: int, rows: int, drafted: bool) -> float:
        """A simulated step's price: drafted and verified, or a target-only decode step."""
        return self.seconds(num_reqs, rows) if drafted else self.decode_seconds(num_reqs)

    def misfit(self, num_reqs: int, num_draft_tokens: int) -> str | None:
        """Why the table cannot price steps of `num_reqs` requests of up to N rows each (None: it can).

        Every policy's rows lie between B (one row each) and B·N (static), so both ends must be in the
        table's range; past its largest probe a table only repeats its edge value, which is no price.
        """
        most = num_reqs * num_draft_tokens
        if self.tiers and most > self.tiers[-1]:
            return (f"a static step of B = {num_reqs} requests runs {most} rows, above the largest graph "
                    f"tier {self.tiers[-1]}")
        table = self.table
        if isinstance(table, SpsTable) and most > table.max_batch_tokens:
            return (f"a static step of B = {num_reqs} requests runs {most} rows but the sps-1d table's "
                    f"max_batch_tokens is {table.max_batch_tokens}")
        if isinstance(table, (AdditiveCostTable, TierCostTable)) and num_reqs > table.bs_probes[-1]:
            return f"B = {num_reqs} is above the table's largest batch probe {table.bs_probes[-1]}"
        if isinstance(table, AdditiveCostTable) and most > table.m_probes[-1]:
            return (f"a static step of B = {num_reqs} requests runs {most} rows, above the additive "
                    f"table's largest row probe {table.m_probes[-1]}")
        if isinstance(table, TierCostTable) and most > table.tiers[-1]:
            return (f"a static step of B = {num_reqs} requests runs {most} rows, above the tier table's "
                    f"last tier {table.tiers[-1]}")
        if table.decode_bs_probes and num_reqs > table.decode_bs_probes[-1]:
            return (f"B = {num_reqs} is above the decode term's largest batch probe "
                    f"{table.decode_bs_probes[-1]}")
        if table.draft_bs_probes and num_reqs > table.draft_bs_probes[-1]:
            return (f"B = {num_reqs} is above the draft term's largest batch probe "
                    f"{table.draft_bs_probes[-1]}")
        return None

    def fitting(self, concurrencies: Sequence[int], num_draft_tokens: int) -> list[int]:
        return [c for c in concurrencies if self.misfit(c, num_draft_tokens) is None]
