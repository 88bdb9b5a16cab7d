"""Counters of a run and of the last decode step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dspark.runtime.layout import VerifyLayout
from dspark.runtime.planner.verify_plan import StepPlan


@dataclass(frozen=True, kw_only=True)
class StepInfo:
    """The last decode step, for serving metrics."""

    num_reqs: int
    committed: int
    rows: int
    planned_rows: int
    padding_rows: int
    tier: int
    budget: int | None
    tau: float | None
    seconds: float


@dataclass
class RunStats:
    """Counts of one `generate` call. Acceptance is measured on verified drafts, never inferred."""

    gamma: int
    requests: int = 0
    steps: int = 0
    request_steps: int = 0
    generated_tokens: int = 0
    committed_tokens: int = 0
    verify_rows: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    padding_rows: int = 0  # rows added to reach the step's graph tier
    planned_rows: int = 0  # sum of verify_lens (in cap-accept fewer rows than run)
    predicted_tau: float = 0.0  # sum over planned steps of the planner's tau
    planned_committed: int = 0  # committed tokens of those same steps
    drafts_verified: list[int] = field(default_factory=list)
    drafts_accepted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.drafts_verified = [0] * self.gamma
        self.drafts_accepted = [0] * self.gamma

    def record_step(self, correct: list[int], verify_lens: list[int], layout: VerifyLayout,
                    step: StepPlan) -> None:
        for c, vl in zip(correct, verify_lens, strict=True):
            for k in range(vl - 1):
                self.drafts_verified[k] += 1
                self.drafts_accepted[k] += int(k < c)
        committed = sum(correct) + len(correct)
        self.steps += 1
        self.request_steps += len(correct)
        self.committed_tokens += committed
        self.verify_rows += layout.total_rows
        self.padding_rows += layout.num_padding_rows
        self.planned_rows += sum(verify_lens)
        tau = step.tau
        if tau is not None:
            self.predicted_tau += tau
            self.planned_committed += committed

    @property
    def wall_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    def to_json(self) -> dict[str, Any]:
        per_request_step = self.request_steps or 1
        return {
            "requests": self.requests,
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "wall_seconds": round(self.wall_seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
            "tokens_per_second": round(self.generated_tokens / max(self.wall_seconds, 1e-9), 2),
            "mean_commit_len": round(self.committed_tokens / per_request_step, 4),
            "mean_accepted_drafts": round(sum(self.drafts_accepted) / per_request_step, 4),
            "verify_rows": self.verify_rows,
            "padding_rows": self.padding_rows,
            "planned_rows": self.planned_rows,
            "mean_predicted_tau_per_step": (round(self.predicted_tau / self.steps, 4)
                                            if self.planned_committed else None),
            "mean_committed_per_planned_step": (round(self.planned_committed / self.steps, 4)
                                                if self.planned_committed else None),
            "drafts_verified_by_position": self.drafts_verified,
            "drafts_accepted_by_position": self.drafts_accepted,
            "acceptance_by_position": [round(a / v, 4) if v else None
                                       for a, v in zip(self.drafts_accepted, self.drafts_verified,
                                                       strict=True)],
        }
