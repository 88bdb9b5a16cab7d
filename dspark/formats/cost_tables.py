"""Step-cost tables (`sps-1d`, `additive`, `tier`): the one definition of their JSON format.

The spec validates an inline table or a table file with these models, `dspark profile` writes
them, the planner prices steps with them (`dspark.runtime.planner.cost_models`) and the report
reads them. Field names follow SGLang's tables.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationInfo, field_validator

from dspark.formats.fields import (
    FieldValueError,
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
            raise FieldValueError("draft times must be ≥ 0", "re-measure the draft step")
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
            raise FieldValueError("steps per second must all be > 0",
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
            raise FieldValueError("times must be ≥ 0", "check the fit; negative times are invalid")
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
                raise FieldValueError(f"row {i} has {len(row)} entries but tiers has {len(tiers)}",
                                     "give one step time per tier in every row")
            if any(seconds <= 0 for seconds in row):
                raise FieldValueError(f"row {i} has a step time ≤ 0",
                                     "re-measure that cell or re-fit the table; step times are > 0")
        return value

    draft_bs_probes: IntTuple = _draft_probes_field()
    draft_seconds: FloatTuple = _draft_seconds_field()


CostTable = Sps1dCostModel | AdditiveCostModel | TierCostModel

# The model a cost-model file of each `type` is validated against.
COST_TABLE_MODELS: dict[str, type[Sps1dCostModel] | type[AdditiveCostModel] | type[TierCostModel]] = {
    "sps-1d": Sps1dCostModel, "additive": AdditiveCostModel, "tier": TierCostModel,
}
