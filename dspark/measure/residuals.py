"""How well a cost table reproduces measured step times: residuals and their summary.

One definition for every consumer: the profiler's fits (`cost_fit`), `dspark cost-eval` and the
report all predict a sample with `predict_seconds` (the verify step only: the profile does not
measure the draft) and summarise with `fit_quality` / `model_fit_quality`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dspark.formats.profile import Sample
from dspark.measure.tiers import TIER_RADIUS, near_tier
from dspark.runtime.planner.cost_models import CostModel, SpsTable


@dataclass(frozen=True)
class FitResidual:
    """One sample against a table, predicted at the sample's own `M` as the runtime evaluates it."""

    num_reqs: int
    num_rows: int
    measured_seconds: float
    predicted_seconds: float

    @property
    def residual_seconds(self) -> float:
        return self.measured_seconds - self.predicted_seconds

    @property
    def relative_error(self) -> float:
        return self.residual_seconds / self.measured_seconds


def predict_seconds(model: CostModel, num_reqs: int, num_rows: int) -> float | None:
    """The table's verify step seconds at (B, M), or None where it has no prediction (M past max_rows).

    An SPS table holds steps per second, so its seconds are the reciprocal of the lookup.
    """
    if model.max_rows is not None and num_rows > model.max_rows:
        return None
    if isinstance(model, SpsTable):
        return 1.0 / model.lookup(num_rows)
    return model.step_time(num_reqs, num_rows)


def fit_quality(residuals: Sequence[FitResidual]) -> tuple[float, float, float]:
    """RMS seconds, R² and max |relative error| of a table over some samples."""
    if not residuals:
        raise ValueError("no residuals to summarise; the table predicted none of the samples")
    measured = np.array([r.measured_seconds for r in residuals])
    res = np.array([r.residual_seconds for r in residuals])
    ss_res = float(res @ res)
    ss_tot = float(((measured - measured.mean()) ** 2).sum())
    # Constant measurements leave R² undefined; a fit that reproduces them exactly is called perfect.
    r_squared = 1.0 - ss_res / ss_tot if ss_tot > 0.0 else (1.0 if ss_res == 0.0 else 0.0)
    return float(np.sqrt(ss_res / len(res))), r_squared, float(np.max(np.abs(res / measured)))


@dataclass(frozen=True)
class FitQuality:
    """How well a table's verify step time reproduces the samples it can predict.

    Samples within ±radius rows of a tier are "near a tier", the rest "elsewhere" (every sample when
    there are no tiers); a mean |error| is None where its group is empty. Samples above the table's
    max_rows are counted in `num_outside` and not predicted.
    """

    num_samples: int
    rms_seconds: float
    r_squared: float
    max_relative_error: float
    num_boundary: int
    num_elsewhere: int
    boundary_mean_abs_error_seconds: float | None
    elsewhere_mean_abs_error_seconds: float | None
    num_outside: int = 0

    def __post_init__(self) -> None:
        if self.num_samples < 1 or self.num_boundary + self.num_elsewhere != self.num_samples:
            raise ValueError(f"FitQuality counts disagree: {self.num_samples} samples, {self.num_boundary} "
                             f"near a tier, {self.num_elsewhere} elsewhere")
        if self.rms_seconds < 0 or self.max_relative_error < 0:
            raise ValueError("rms_seconds and max_relative_error are magnitudes and must be >= 0")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def residuals_of(model: CostModel, samples: Sequence[Sample]) -> tuple[list[FitResidual], int]:
    """The residual of every sample the model predicts, and how many it cannot (above its max_rows)."""
    residuals: list[FitResidual] = []
    outside = 0
    for num_reqs, num_rows, seconds in samples:
        predicted = predict_seconds(model, num_reqs, num_rows)
        if predicted is None:
            outside += 1
        else:
            residuals.append(FitResidual(num_reqs, num_rows, seconds, predicted))
    return residuals, outside


def model_fit_quality(model: CostModel, samples: Sequence[Sample], tiers: Sequence[int] = (),
                      radius: int = TIER_RADIUS) -> FitQuality | None:
    """`FitQuality` of `model` over `samples` = `(B, M, seconds)`; None when it predicts none of them."""
    residuals, outside = residuals_of(model, samples)
    if not residuals:
        return None
    rms, r_squared, max_relative = fit_quality(residuals)
    near = near_tier([r.num_rows for r in residuals], tiers, radius)
    errors = np.abs([r.residual_seconds for r in residuals])
    return FitQuality(len(residuals), rms, r_squared, max_relative, int(near.sum()), int((~near).sum()),
                      float(errors[near].mean()) if near.any() else None,
                      float(errors[~near].mean()) if (~near).any() else None, outside)
