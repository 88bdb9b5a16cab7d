"""The contents of a calibration JSON file, as `dspark calibrate` writes it.

The spec's inline `calibration: {temperatures: [...]}` is only the temperatures; the file also
records how they were fitted (data set, sample count, ECE/Brier/AUC before and after, the grid), and
optionally the fingerprint of the deployment and the sampling policy it was fitted for. Every known
key is typed, so a damaged file fails here instead of being half-read, and unknown keys are still
rejected so a typo in a hand-edited file is not silently ignored.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from dspark.formats.fields import (
    FieldValueError,
    FloatTuple,
    NullableFloatTuple,
    Section,
    TableFingerprint,
)


class StsTemperatures(Section):
    """Per-position STS temperatures T_1..T_gamma and the policy they were fitted for."""

    temperatures: FloatTuple = Field(description="One temperature (> 0) per draft position.")
    policy: str | None = Field(
        default=None, min_length=1,
        description="Optional: the sampling policy the temperatures were fitted for, `greedy` or "
                    "`sample:temperature=T,top_p=P,top_k=K` (as `dspark calibrate` records it); "
                    "must equal the policy of serving.generation.")

    @field_validator("temperatures")
    @classmethod
    def _positive(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if any(t <= 0 for t in value):
            raise FieldValueError("temperatures must all be > 0",
                                 "use 1.0 for an uncalibrated position")
        return value


# Lists with one entry per draft position, so their length must equal the temperature count.
_PER_POSITION = ("ece_before", "ece_after", "brier_before", "brier_after", "auc_before", "auc_after",
                 "mean_survival_before", "mean_survival_after", "reach_rate")


class CalibrationFileContents(StsTemperatures):
    """A calibration file: `temperatures` (required) plus what `dspark calibrate` records beside it."""

    dataset: str | None = Field(default=None, description="The recorded load the fit used.")
    num_samples: int | None = Field(default=None, ge=0, description="Recorded request-steps.")
    num_bins: int | None = Field(default=None, ge=1, description="ECE bins.")
    grid: FloatTuple | None = Field(default=None, description="Temperatures searched.")
    ece_before: FloatTuple | None = Field(default=None, description="Per-position ECE, T = 1.")
    ece_after: FloatTuple | None = Field(default=None, description="Per-position ECE, fitted T.")
    brier_before: FloatTuple | None = Field(default=None, description="Per-position Brier, T = 1.")
    brier_after: FloatTuple | None = Field(default=None, description="Per-position Brier, fitted T.")
    auc_before: NullableFloatTuple | None = Field(
        default=None, description="Per-position ranking AUC, T = 1 (null where one class is absent).")
    auc_after: NullableFloatTuple | None = Field(
        default=None, description="Per-position ranking AUC, fitted T (null where one class is absent).")
    mean_survival_before: FloatTuple | None = Field(default=None, description="Mean survival, T = 1.")
    mean_survival_after: FloatTuple | None = Field(default=None, description="Mean survival, fitted T.")
    reach_rate: FloatTuple | None = Field(
        default=None, description="Share of request-steps whose accepted prefix reached each position.")
    fingerprint: TableFingerprint = None

    @model_validator(mode="after")
    def _one_entry_per_position(self) -> CalibrationFileContents:
        gamma = len(self.temperatures)
        wrong = [f"{name} has {len(values)}" for name in _PER_POSITION
                 if (values := getattr(self, name)) and len(values) != gamma]
        if wrong:
            raise FieldValueError(f"{', '.join(wrong)} entries but there are {gamma} temperatures",
                                 "give one value per draft position (rewrite the file with "
                                 "`dspark calibrate`)")
        return self
