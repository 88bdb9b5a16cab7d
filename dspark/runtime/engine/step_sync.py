"""What the engines running one step together agree on, and the one engine's agreement with itself.

A step's forward runs on every engine of a launch at once under DP attention (each DP rank's engine over
its own requests; `dspark.runtime.distributed.dp_sync`), so at a few points of a step the engines agree:
the rows of an extend step, the tier of a verify step (`global_verify`), whether the step speculates.
One engine alone agrees with itself: `LocalSync` returns what it is given, so the step's code
(`ExtendSteps`, `SpeculativeStep`) reads the same either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dspark.runtime.layout import tier_for
from dspark.runtime.planner.switch import Prediction


@dataclass(frozen=True)
class VerifyReport:
    """One DP rank's verify step, as planned on its own."""

    num_requests: int
    rows: int  # rows its requests run (sum of run_lens); 0 when it has no requests or could not plan
    tier: int  # the tier those rows need (the rows themselves without tiers)
    planned: bool  # False: its planner failed, so the step falls back to the uniform layout


@dataclass(frozen=True)
class GlobalVerify:
    """What every DP rank runs in a verify step."""

    tier: int  # rows of every DP rank's forward (0: no DP rank verifies this step)
    logit_rows: int  # rows every DP rank projects to logits: the most real rows of any DP rank
    uniform_rows: int | None  # when some DP rank could not plan: the rows every request verifies


def global_verify(reports: list[VerifyReport], tiers: tuple[int, ...], uniform_rows: Callable[[int], int],
                  fills_tier: bool) -> GlobalVerify:
    """The step every DP rank runs, from every DP rank's report (the same on every rank).

    `uniform_rows(B)` is what every request verifies in the uniform step of batches of up to B requests
    (`VerifyPlan.uniform_rows`), taken when some DP rank could not plan; `fills_tier` says that each DP
    rank fills its rows up to the global tier (graph-tier alignment), so the logits cover the whole tier.
    """
    if not any(r.num_requests for r in reports):
        return GlobalVerify(0, 0, None)
    if all(r.planned for r in reports):
        tier = max(r.tier for r in reports)
        return GlobalVerify(tier, tier if fills_tier and tiers else max(r.rows for r in reports), None)
    most = max(r.num_requests for r in reports)
    rows = uniform_rows(most)
    return GlobalVerify(tier_for(most * rows, tiers) if tiers else most * rows, most * rows, rows)


class StepSync(Protocol):
    """The agreements of a step among the engines that run it together."""

    @property
    def spans_ranks(self) -> bool:
        """Whether other engines run this engine's steps with it (then it runs every step, with or without
        requests of its own)."""
        ...

    def agree_extend(self, rows: int, logit_rows: int, probe_rows: int) -> tuple[int, int, int]:
        """The rows, logit rows and prompt-probe rows (`ExtendSteps.prefill`) every engine runs in an
        extend step."""
        ...

    def agree_verify(self, report: VerifyReport, tiers: tuple[int, ...], uniform_rows: Callable[[int], int],
                     fills_tier: bool) -> GlobalVerify:
        """The verify step every engine runs, from this engine's `report` (see `global_verify`)."""
        ...

    def unplanned(self, num_requests: int, error: ValueError) -> VerifyReport:
        """This engine's planner refused the step: the report that says so (or the refusal itself)."""
        ...

    def agree_prediction(self, prediction: Prediction) -> Prediction:
        """The step's prediction of both speculation states, from every engine's."""
        ...

    def check(self, what: str, *values: int) -> None:
        """In the check mode, fail every engine loudly unless all are about to run the same `values`."""
        ...


class LocalSync:
    """One engine alone: every agreement is its own step."""

    spans_ranks = False

    def agree_extend(self, rows: int, logit_rows: int, probe_rows: int) -> tuple[int, int, int]:
        return rows, logit_rows, probe_rows

    def agree_verify(self, report: VerifyReport, tiers: tuple[int, ...], uniform_rows: Callable[[int], int],
                     fills_tier: bool) -> GlobalVerify:
        # its own tier and its real rows' logits: nothing to pad for another engine
        return GlobalVerify(report.tier, report.rows, None)

    def unplanned(self, num_requests: int, error: ValueError) -> VerifyReport:
        raise error  # no other engine's step to fall in with: the refusal is the caller's to see

    def agree_prediction(self, prediction: Prediction) -> Prediction:
        return prediction

    def check(self, what: str, *values: int) -> None:
        pass
