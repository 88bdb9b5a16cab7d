"""Deployment specs: pydantic models, YAML loading with positioned errors, whole-spec rules."""

from dspark.spec.errors import Location, SpecError, SpecIssue
from dspark.spec.loader import load_spec
from dspark.spec.models import DeploymentSpec
from dspark.spec.resolved import ResolvedSpec


def spec_json_schema() -> dict:
    """JSON schema of the spec format (what `dspark-compile schema` prints)."""
    return DeploymentSpec.model_json_schema()


__all__ = ["DeploymentSpec", "Location", "ResolvedSpec", "SpecError", "SpecIssue", "load_spec",
           "spec_json_schema"]
