"""Cost-model and calibration tables: inline in the spec or in a JSON file it names."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag, ValidationInfo, field_validator

from dspark.spec.errors import SpecValueError
from dspark.spec.fieldtypes import (
    FloatTuple,
    IntTuple,
    Section,
    TableFingerprint,
    same_length,
    strictly_increasing,
)

# Rows of per-tier seconds; the outer list becomes a tuple here, each row through FloatTuple.
FloatRows = Annotated[tuple[FloatTuple, ...],
                      BeforeValidator(lambda value: tuple(value) if isinstance(value, list) else value)]


def _draft_probes_field() -> Any:
    return Field(default=(), description="Optional: batch sizes at which the draft's step time was "
                                         "measured, strictly increasing.")


def _draft_seconds_field() -> Any:
    return Field(default=(), description="Optional: the draft's seconds per step at each draft_bs_probes "
                                         "entry (≥ 0); the planner adds them to the verify step time.")


class _DraftCostTerm(Section):
    """Validators of the optional draft-cost term every cost table may carry (fields declared per
    table, after its own, so that dumps and the generated code list the table's fields first)."""

    @field_validator("draft_bs_probes", check_fields=False)
    @classmethod
    def _draft_increasing(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        return strictly_increasing(value, "draft_bs_probes")

    @field_validator("draft_seconds", check_fields=False)
    @classmethod
    def _draft_non_negative(cls, value: tuple[float, ...], info: ValidationInfo) -> tuple[float, ...]:
        same_length(value, info, "draft_bs_probes")
        if any(seconds < 0 for seconds in value):
            raise SpecValueError("draft times must be ≥ 0", "re-measure the draft step")
        return value


class Sps1dCostModel(_DraftCostTerm):
    """Steps-per-second table over the step's token count, looked up by floor."""

    type: Literal["sps-1d"] = Field(description="Cost model kind.")
    fingerprint: TableFingerprint = None
    sample_batch_tokens: IntTuple = Field(
        min_length=1, description="Probed token counts M, strictly increasing.")
    sample_steps_per_sec: FloatTuple = Field(
        min_length=1, description="Measured steps per second at each probed M (> 0).")
    max_batch_tokens: int = Field(
        ge=1, description="Largest token count the table may be used for.")

    @field_validator("sample_batch_tokens")
    @classmethod
    def _increasing(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        return strictly_increasing(value, "sample_batch_tokens")

    @field_validator("sample_steps_per_sec")
    @classmethod
    def _positive_rates(cls, value: tuple[float, ...], info: ValidationInfo) -> tuple[float, ...]:
        same_length(value, info, "sample_batch_tokens")
        if any(rate <= 0 for rate in value):
            raise SpecValueError("steps per second must all be > 0",
                                 "re-measure or drop the probes with a zero rate")
        return value

    draft_bs_probes: IntTuple = _draft_probes_field()
    draft_seconds: FloatTuple = _draft_seconds_field()


class AdditiveCostModel(_DraftCostTerm):
    """Step time T(B, M) = bias + alpha(B) + theta(M), theta linearly interpolated."""

    type: Literal["additive"] = Field(description="Cost model kind.")
    fingerprint: TableFingerprint = None
    bias_seconds: float = Field(ge=0, description="Constant step overhead in seconds.")
    bs_probes: IntTuple = Field(
        min_length=1, description="Probed batch sizes B, strictly increasing.")
    alpha_seconds: FloatTuple = Field(description="Seconds added per probed batch size (≥ 0).")
    m_probes: IntTuple = Field(
        min_length=1, description="Probed token counts M, strictly increasing.")
    theta_seconds: FloatTuple = Field(description="Seconds added per probed token count (≥ 0).")

    @field_validator("bs_probes", "m_probes")
    @classmethod
    def _increasing(cls, value: tuple[int, ...], info: ValidationInfo) -> tuple[int, ...]:
        return strictly_increasing(value, str(info.field_name))

    @field_validator("alpha_seconds", "theta_seconds")
    @classmethod
    def _non_negative(cls, value: tuple[float, ...], info: ValidationInfo) -> tuple[float, ...]:
        same_length(value, info, "bs_probes" if info.field_name == "alpha_seconds" else "m_probes")
        if any(seconds < 0 for seconds in value):
            raise SpecValueError("times must be ≥ 0", "check the fit; negative times are invalid")
        return value

    draft_bs_probes: IntTuple = _draft_probes_field()
    draft_seconds: FloatTuple = _draft_seconds_field()


class TierCostModel(_DraftCostTerm):
    """Step time measured per (batch size, graph tier); M rows cost what the smallest tier >= M costs."""

    type: Literal["tier"] = Field(description="Cost model kind.")
    fingerprint: TableFingerprint = None
    tiers: IntTuple = Field(
        min_length=1, description="Graph tiers (token counts), strictly increasing; M above the last is "
                                  "infeasible.")
    bs_probes: IntTuple = Field(
        min_length=1, description="Probed batch sizes B, strictly increasing.")
    step_seconds: FloatRows = Field(
        description="One row per bs_probes entry, each with one step time per tier in seconds (> 0); "
                    "interpolated along B within a tier, never across tiers.")

    @field_validator("tiers", "bs_probes")
    @classmethod
    def _increasing(cls, value: tuple[int, ...], info: ValidationInfo) -> tuple[int, ...]:
        return strictly_increasing(value, str(info.field_name))

    @field_validator("step_seconds")
    @classmethod
    def _grid(cls, value: tuple[tuple[float, ...], ...],
              info: ValidationInfo) -> tuple[tuple[float, ...], ...]:
        same_length(value, info, "bs_probes")
        tiers = info.data.get("tiers")
        for i, row in enumerate(value):
            if tiers is not None and len(row) != len(tiers):
                raise SpecValueError(f"row {i} has {len(row)} entries but tiers has {len(tiers)}",
                                     "give one step time per tier in every row")
            if any(seconds <= 0 for seconds in row):
                raise SpecValueError(f"row {i} has a step time ≤ 0",
                                     "re-measure that cell or re-fit the table; step times are > 0")
        return value

    draft_bs_probes: IntTuple = _draft_probes_field()
    draft_seconds: FloatTuple = _draft_seconds_field()


class CostModelFile(Section):
    """A cost model stored in a JSON file with the same field names as the inline form."""

    type: Literal["sps-1d", "additive", "tier"] = Field(description="Cost model kind.")
    file: str = Field(min_length=1, description="JSON file path, relative to the spec file.")


CostTable = Sps1dCostModel | AdditiveCostModel | TierCostModel

# The model a cost-model file of each `type` is validated against.
COST_TABLE_MODELS: dict[str, type[Sps1dCostModel] | type[AdditiveCostModel] | type[TierCostModel]] = {
    "sps-1d": Sps1dCostModel, "additive": AdditiveCostModel, "tier": TierCostModel,
}


def _cost_model_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        kind, has_file = value.get("type"), "file" in value
    else:
        kind, has_file = getattr(value, "type", None), hasattr(value, "file")
    if has_file:
        return "file"
    return kind if isinstance(kind, str) else None


CostModelSpec = Annotated[
    Annotated[Sps1dCostModel, Tag("sps-1d")]
    | Annotated[AdditiveCostModel, Tag("additive")]
    | Annotated[TierCostModel, Tag("tier")]
    | Annotated[CostModelFile, Tag("file")],
    Discriminator(
        _cost_model_tag,
        custom_error_type="cost_model_type",
        custom_error_message="cost_model.type must be 'sps-1d', 'additive' or 'tier'",
    ),
]


class CalibrationInline(Section):
    """Per-position STS temperatures T_1..T_gamma."""

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
            raise SpecValueError("temperatures must all be > 0",
                                 "use 1.0 for an uncalibrated position")
        return value


class CalibrationFile(Section):
    """Calibration stored in a JSON file with a `temperatures` list."""

    file: str = Field(min_length=1, description="JSON file path, relative to the spec file.")
    policy: str | None = Field(
        default=None, min_length=1,
        description="Optional: the sampling policy the file was fitted for, `greedy` or "
                    "`sample:temperature=T,top_p=P,top_k=K`; must equal the policy of "
                    "serving.generation and the file's own `policy`.")


def _calibration_tag(value: Any) -> str:
    has_file = "file" in value if isinstance(value, dict) else hasattr(value, "file")
    return "file" if has_file else "inline"


CalibrationSpec = Annotated[
    Annotated[CalibrationInline, Tag("inline")] | Annotated[CalibrationFile, Tag("file")],
    Discriminator(_calibration_tag),
]
