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
    speculating: bool = True  # False: a target-only decode step (the run's mode, or speculation off)


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
    planned_steps: int = 0
    # A speculative run's steps with speculation switched off (the planner's off state), their seconds,
    # the seconds of its drafted steps, and how often the planner switched between the two.
    off_steps: int = 0
    off_seconds: float = 0.0
    on_seconds: float = 0.0
    switches: int = 0
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
            self.planned_steps += 1

    def record_decode_step(self, num_reqs: int, speculating_off: bool) -> None:
        """A target-only decode step of `num_reqs` requests: of a target-only run, or of a speculative
        run with speculation switched off (`speculating_off`)."""
        self.steps += 1
        self.request_steps += num_reqs
        self.committed_tokens += num_reqs
        self.verify_rows += num_reqs
        self.off_steps += int(speculating_off)

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
            "mean_predicted_tau_per_step": (round(self.predicted_tau / self.planned_steps, 4)
                                            if self.planned_steps else None),
            "mean_committed_per_planned_step": (round(self.planned_committed / self.planned_steps, 4)
                                                if self.planned_steps else None),
            "speculation_off_steps": self.off_steps,
            "speculation_off_seconds": round(self.off_seconds, 4),
            "speculation_on_seconds": round(self.on_seconds, 4),
            "speculation_switches": self.switches,
            "drafts_verified_by_position": self.drafts_verified,
            "drafts_accepted_by_position": self.drafts_accepted,
            "acceptance_by_position": [round(a / v, 4) if v else None
                                       for a, v in zip(self.drafts_accepted, self.drafts_verified,
                                                       strict=True)],
        }
