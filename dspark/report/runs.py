"""Per-run summaries of `dspark report`: the run's figures, its accepted / verified drafts per position,
and what its recording cannot show (and why)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dspark.report.inputs import RunData, unique_labels


@dataclass(frozen=True)
class RunSummary:
    run: str
    deployment: str
    mode: str
    policy: str
    lag_steps: int
    batch_range: tuple[int, int] | None
    steps: int
    tokens_per_second: float | None
    mean_commit_len: float | None
    verified: tuple[int, ...]  # drafts the target verified, per position
    accepted: tuple[int, ...]  # drafts accepted, per position
    # the planner's off state: decode steps without speculation, and their share of the decode seconds
    off_steps: int | None = None
    off_share: float | None = None

    @property
    def accepted_over_verified(self) -> tuple[float | None, ...]:
        return tuple(a / v if v else None for a, v in zip(self.accepted, self.verified, strict=True))


def _counts_from_steps(run: RunData) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # Draft k (0-based) is verified when the request verifies the root plus k + 1 drafts.
    verified, accepted = [0] * run.gamma, [0] * run.gamma
    for step in run.steps:
        for req in step.requests:
            for k in range(run.gamma):
                verified[k] += req.verify_len >= k + 2
                accepted[k] += req.correct_len > k
    return tuple(verified), tuple(accepted)


def _opt_float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def run_summaries(runs: Sequence[RunData], labels: Sequence[str] | None = None) -> list[RunSummary]:
    """One row per run; draft counts from the run's stats, or counted from its steps when absent."""
    labels = labels or unique_labels([r.path for r in runs])
    out = []
    for run, label in zip(runs, labels, strict=True):
        verified = run.stats.get("drafts_verified_by_position")
        accepted = run.stats.get("drafts_accepted_by_position")
        if not (isinstance(verified, list) and isinstance(accepted, list)
                and len(verified) == len(accepted) == run.gamma):
            verified, accepted = _counts_from_steps(run)
        sizes = [s.num_reqs for s in run.steps]
        out.append(RunSummary(
            run=label, deployment=run.deployment, mode=run.mode, policy=run.policy, lag_steps=run.lag_steps,
            batch_range=(min(sizes), max(sizes)) if sizes else None,
            steps=steps if isinstance(steps := run.stats.get("steps"), int) else len(run.steps),
            tokens_per_second=_opt_float(run.stats.get("tokens_per_second")),
            mean_commit_len=_opt_float(run.stats.get("mean_commit_len")),
            verified=tuple(int(v) for v in verified), accepted=tuple(int(a) for a in accepted),
            **_off_state(run)))
    return out


def _off_state(run: RunData) -> dict[str, Any]:
    """Steps and share of the decode time without speculation: from the run's stats, else counted from its
    step records (which carry the off steps since each drafted one)."""
    stats = run.stats
    off_steps, off, on = (stats.get(k) for k in ("speculation_off_steps", "speculation_off_seconds",
                                                 "speculation_on_seconds"))
    if not isinstance(off_steps, int) or _opt_float(off) is None or _opt_float(on) is None:
        if not run.steps:
            return {}
        off_steps = sum(s.off_steps for s in run.steps)
        off = sum(s.off_seconds for s in run.steps)
        on = sum(s.step_seconds for s in run.steps)
    total = float(off) + float(on)
    return {"off_steps": off_steps, "off_share": float(off) / total if total > 0 else None}


def missing_figures(runs: Sequence[RunData], labels: Sequence[str] | None = None) -> list[str]:
    """What each run's recording cannot show, and why; empty for a complete recording.

    A static step has no planner, so no predicted tau; a draft without a confidence head records no
    confidence, survival or STS samples; a static recording made before static runs computed survival
    has confidence but no survival.
    """
    labels = labels or unique_labels([r.path for r in runs])
    notes = []
    for run, label in zip(runs, labels, strict=True):
        if run.target_only or not run.steps:
            why = "it decoded target-only" if run.target_only else "steps.jsonl is empty"
            notes.append(f"`{label}`: no speculative step was recorded ({why}), so it has no tau or "
                         "calibration figures.")
            continue
        requests = [req for step in run.steps for req in step.requests]
        if all(step.tau is None for step in run.steps):
            notes.append(f"`{label}`: no planner ran ({run.verify_mode} verification), so its steps have no "
                         "predicted tau and it is not in the tau-vs-actual figures.")
        if all(req.confidence is None for req in requests):
            notes.append(f"`{label}`: the draft has no confidence head, so the steps record no confidence "
                         "or survival and the run has no calibration figures.")
        elif all(req.survival is None for req in requests):
            notes.append(f"`{label}`: the steps record confidence but no survival (a static recording "
                         "from before static runs computed it); re-record the run for survival per step.")
        if run.sts is None or not len(run.sts.logits):
            notes.append(f"`{label}`: no STS samples (`sts/` is missing or holds no shards), so it adds "
                         "nothing to the reliability diagrams.")
    return notes
