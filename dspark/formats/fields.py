"""Building blocks of every validated format (the spec and the files it names): the strict frozen
base model, list-valued fields, and the error a field validator raises."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator


class FieldValueError(ValueError):
    """Raised inside pydantic validators; the spec loader shows `hint` under the message."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


def _list_to_tuple(value: Any) -> Any:
    # YAML and JSON only have lists; tuples keep the frozen models deeply immutable.
    return tuple(value) if isinstance(value, list) else value


IntTuple = Annotated[tuple[int, ...], BeforeValidator(_list_to_tuple)]
FloatTuple = Annotated[tuple[float, ...], BeforeValidator(_list_to_tuple)]
NullableFloatTuple = Annotated[tuple[float | None, ...], BeforeValidator(_list_to_tuple)]


def strictly_increasing(values: tuple[int, ...], what: str) -> tuple[int, ...]:
    for i in range(1, len(values)):
        if values[i] <= values[i - 1]:
            raise FieldValueError(
                f"{what} must be strictly increasing, but item {i} ({values[i]}) follows "
                f"{values[i - 1]}", "sort the list and remove duplicates")
    if values and values[0] < 1:
        raise FieldValueError(f"{what} must be positive, got {values[0]}",
                             "use token/batch counts of at least 1")
    return values


def same_length(values: tuple[Any, ...], info: ValidationInfo, other: str) -> None:
    reference = info.data.get(other)
    if reference is not None and len(values) != len(reference):
        raise FieldValueError(
            f"has {len(values)} entries but {other} has {len(reference)}",
            f"give exactly one {info.field_name} value per {other} entry")


INT64_MAX = 2**63 - 1


class Section(BaseModel):
    """Strict (no "7" -> 7 coercion), frozen, closed to unknown keys, and finite.

    NaN and infinities are refused at every float field: no measured time, rate or temperature is
    ever infinite, and a non-finite value would otherwise pass validation only to break the
    compiler's canonical JSON (which refuses them) or poison the planner's arithmetic. Integers
    must fit 64 bits for the same reason: Python takes any size, the tensors and arrays the
    runtime builds from them do not.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _fits_int64(cls, value: Any) -> Any:
        if _too_large(value):
            raise FieldValueError("an integer here does not fit 64 bits (its magnitude is above "
                                 f"{INT64_MAX})", "write a realistic value")
        return value


def _too_large(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) > INT64_MAX
    if isinstance(value, tuple):
        return any(_too_large(item) for item in value)
    return False


# A table file's record of the deployment it was measured on (`dspark.fingerprint`). Never dumped: it
# describes the measurement, not the table, so it stays out of generated code and the planner's input.
TableFingerprint = Annotated[dict[str, Any] | None, Field(
    exclude=True,
    description="Optional: the deployment the table was measured on (a fingerprint object as the "
                "profiler writes it); compiling refuses a table measured on a different deployment "
                "unless --allow-stale-tables is given.")]
