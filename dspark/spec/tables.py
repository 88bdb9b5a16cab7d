"""How a spec names its cost model and its calibration: inline, or a JSON file with the same fields."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from dspark.formats.cost_tables import AdditiveCostModel, Sps1dCostModel, TierCostModel
from dspark.formats.fields import Section
from dspark.formats.sts_calibration import StsTemperatures


class CostModelFile(Section):
    """A cost model stored in a JSON file with the same field names as the inline form."""

    type: Literal["sps-1d", "additive", "tier"] = Field(description="Cost model kind.")
    file: str = Field(min_length=1, description="JSON file path, relative to the spec file.")


def _cost_model_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        kind, has_file = value.get("type"), "file" in value
    elif isinstance(value, Section):
        kind, has_file = getattr(value, "type", None), hasattr(value, "file")
    else:
        return None  # a list or a scalar: no table at all
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


class CalibrationInline(StsTemperatures):
    """Per-position STS temperatures T_1..T_gamma, written in the spec."""


class CalibrationFile(Section):
    """Calibration stored in a JSON file with a `temperatures` list."""

    file: str = Field(min_length=1, description="JSON file path, relative to the spec file.")
    policy: str | None = Field(
        default=None, min_length=1,
        description="Optional: the sampling policy the file was fitted for, `greedy` or "
                    "`sample:temperature=T,top_p=P,top_k=K`; must equal the policy of "
                    "serving.generation and the file's own `policy`.")


def _calibration_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        return "file" if "file" in value else "inline"
    if isinstance(value, (CalibrationInline, CalibrationFile)):
        return "file" if isinstance(value, CalibrationFile) else "inline"
    return None  # a list or a scalar: neither form


CalibrationSpec = Annotated[
    Annotated[CalibrationInline, Tag("inline")] | Annotated[CalibrationFile, Tag("file")],
    Discriminator(
        _calibration_tag,
        custom_error_type="calibration_type",
        custom_error_message="calibration must be a mapping with `file` or `temperatures`",
    ),
]
