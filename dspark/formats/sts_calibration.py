"""STS calibration files: the one definition of their JSON format, with its reader and writer.

The spec's inline `calibration: {temperatures: [...]}` is only the temperatures; the file also
records how they were fitted (data set, sample count, ECE/Brier/AUC before and after, the grid), and
optionally the fingerprint of the deployment and the sampling policy it was fitted for. Every known
key is typed, so a damaged file fails here instead of being half-read, and unknown keys are still
rejected so a typo in a hand-edited file is not silently ignored. `dspark calibrate` writes the file
(`write_calibration`), the spec validates it with `CalibrationFileContents`, the report reads it
(`read_calibration`); the first five fields are the ones SGLang's runtime reads (docs/formats.md).

`survival_map` (optional, versioned) extends the temperatures with a monotone map per draft position on the
cumulative survival (`dspark.runtime.planner.survival_map`); a file without it means the identity.
"""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from dspark.formats.fields import (
    FieldValueError,
    FloatTuple,
    NullableFloatTuple,
    Section,
    TableFingerprint,
)
from dspark.formats.json_io import FormatError, read_json_file, validation_message, write_json_file


class StsTemperatures(Section):
    """Per-position STS temperatures T_1..T_gamma and the policy they were fitted for."""

    temperatures: FloatTuple = Field(min_length=1, description="One temperature (> 0) per draft position.")
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
    survival_map: SurvivalMapKnots | None = Field(
        default=None, description="Optional: a monotone map per position on the cumulative survival, "
                                  "after the temperatures (absent: the identity).")

    @model_validator(mode="after")
    def _one_entry_per_position(self) -> CalibrationFileContents:
        gamma = len(self.temperatures)
        wrong = [f"{name} has {len(values)}" for name in _PER_POSITION
                 if (values := getattr(self, name)) and len(values) != gamma]
        if self.survival_map is not None and len(self.survival_map.x) != gamma:
            wrong.append(f"survival_map has {len(self.survival_map.x)}")
        if wrong:
            raise FieldValueError(f"{', '.join(wrong)} entries but there are {gamma} temperatures",
                                 "give one value per draft position (rewrite the file with "
                                 "`dspark calibrate`)")
        return self


SURVIVAL_MAP_VERSION = 1


def survival_map_problems(x: Any, y: Any) -> str | None:
    """What is wrong with knots `x`, `y` (one list per draft position), or None."""
    rows = list(x) if isinstance(x, (list, tuple)) else None
    cols = list(y) if isinstance(y, (list, tuple)) else None
    if not rows or cols is None or len(rows) != len(cols) or not all(
            isinstance(r, (list, tuple)) and isinstance(c, (list, tuple)) and len(r) == len(c) == len(rows[0])
            and len(r) >= 2 for r, c in zip(rows, cols, strict=True)):
        return ("x and y must be one list of at least 2 knots per draft position, the same count at every "
                "position")
    values = [v for r in rows + cols for v in r]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        return "knots must be finite numbers"
    if any(r[0] != 0 or r[-1] != 1 for r in rows):
        return "every position's x must start at 0 and end at 1"
    if any(a > b for r in rows + cols for a, b in itertools.pairwise(r)):
        return "x and y must be non-decreasing along each position's knots (the map is monotone)"
    if any(not 0 <= v <= 1 for c in cols for v in c):
        return "y must lie in [0, 1] (survivals)"
    return None


class SurvivalMapKnots(Section):
    """A calibration file's `survival_map`: knots per draft position of a monotone piecewise-linear map."""

    version: int = Field(description=f"The map's format version ({SURVIVAL_MAP_VERSION}).")
    x: tuple[FloatTuple, ...] = Field(description="Per position, the knots' survivals: 0 .. 1.")
    y: tuple[FloatTuple, ...] = Field(description="Per position, the mapped survivals, in [0, 1].")

    @field_validator("x", "y", mode="before")
    @classmethod
    def _rows(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value

    @model_validator(mode="after")
    def _monotone(self) -> SurvivalMapKnots:
        if self.version != SURVIVAL_MAP_VERSION:
            raise FieldValueError(f"version {self.version} is not one this dspark reads",
                                  f"rewrite the file with this dspark (version {SURVIVAL_MAP_VERSION})")
        problems = survival_map_problems(self.x, self.y)
        if problems:
            raise FieldValueError(problems, "rewrite the file with `dspark calibrate`")
        return self


class CalibrationFileError(FormatError):
    """A calibration file is unreadable or malformed; the message starts with its path."""


# The file's key order: SGLang's five fields first (its reader needs only these), then how the fit went.
FILE_KEYS = ("temperatures", "dataset", "num_samples", "ece_before", "ece_after", "brier_before",
             "brier_after", "auc_before", "auc_after", "mean_survival_before", "mean_survival_after",
             "reach_rate", "num_bins", "grid", "policy", "fingerprint", "survival_map")


def calibration_from_json(data: Any, where: str) -> CalibrationFileContents:
    """Validate a calibration object; `where` (usually the file) starts every error."""
    if not isinstance(data, dict):
        raise CalibrationFileError(f"{where}: a calibration must be a JSON object with 'temperatures', got "
                                   f"{type(data).__name__}")
    try:
        return CalibrationFileContents.model_validate(data)
    except ValidationError as error:
        raise CalibrationFileError(f"{where}: {validation_message(error)}") from None


def read_calibration(path: str | os.PathLike[str]) -> CalibrationFileContents:
    """A calibration file, validated."""
    data = read_json_file(path, "STS calibration file", "write it with `dspark calibrate`",
                          CalibrationFileError)
    return calibration_from_json(data, str(path))


def calibration_json(contents: CalibrationFileContents) -> dict[str, Any]:
    """The file's object in `FILE_KEYS` order; fields that are not set are left out (SGLang omits them)."""
    out: dict[str, Any] = {}
    for key in FILE_KEYS:
        value = getattr(contents, key)
        if isinstance(value, SurvivalMapKnots):
            out[key] = {"version": value.version, "x": [list(r) for r in value.x],
                        "y": [list(r) for r in value.y]}
        elif value is not None:
            out[key] = list(value) if isinstance(value, tuple) else value
    return out


def write_calibration(path: str | os.PathLike[str], contents: CalibrationFileContents) -> Path:
    """Write the file atomically (strict JSON: a NaN metric is refused, not written)."""
    return write_json_file(path, calibration_json(contents))
