"""What a validated spec resolves to once its checkpoints and referenced files are read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.families import ModelFamily
from dspark.formats.cost_tables import COST_TABLE_MODELS, CostTable
from dspark.formats.fields import FieldValueError
from dspark.formats.hf_config import FAMILIES
from dspark.formats.sts_calibration import CalibrationFileContents
from dspark.spec.checkpoints import (
    CheckpointRef,
    geometry_differences,
    geometry_from_dsv4_config,
    geometry_from_hf_config,
    resolve_checkpoint,
)
from dspark.spec.draft import resolve_draft
from dspark.spec.errors import SpecIssue
from dspark.spec.external import read_json, resolve_path, validate_file_data
from dspark.spec.models import (
    DeploymentSpec,
    Dsv4GeometrySpec,
    GeometrySpec,
    TargetGeometry,
    required_fields,
)
from dspark.spec.tables import CalibrationFile, CalibrationInline, CostModelFile

# The spec section an inline geometry of each family is written in.
GEOMETRY_SECTIONS: dict[ModelFamily, type[GeometrySpec] | type[Dsv4GeometrySpec]] = {
    ModelFamily.LLAMA: GeometrySpec, ModelFamily.QWEN3: GeometrySpec, ModelFamily.DSV4: Dsv4GeometrySpec,
}
assert set(GEOMETRY_SECTIONS) == set(ModelFamily), "every family has its geometry section"


@dataclass(frozen=True)
class SpecFacts:
    """The spec plus everything read from disk; a field is None where reading it failed. The spec's
    draft section is complete (`dspark.spec.draft.resolve_draft`) wherever it could be resolved."""

    spec: DeploymentSpec
    geometry: TargetGeometry | None  # a dense geometry with head_dim resolved, or a Dsv4Geometry
    model_checkpoint: CheckpointRef | None
    draft_checkpoint: CheckpointRef | None
    draft_config: dict[str, Any] | None
    cost_model: CostTable | None
    temperatures: tuple[float, ...] | None
    calibration_file: CalibrationFileContents | None = None  # all of a calibration file, when used
    # checkpoint_digest of each checkpoint: "" when its directory is not on this machine, None when
    # it could not be computed (that failure is already an issue).
    model_digest: str | None = None
    draft_digest: str | None = None


def gather_facts(spec: DeploymentSpec, spec_dir: Path) -> tuple[SpecFacts, list[SpecIssue]]:
    issues: list[SpecIssue] = []

    def attempt(path: tuple[str, ...], action: Any) -> Any:
        try:
            return action()
        except FieldValueError as exc:
            issues.append(SpecIssue(path, str(exc), exc.hint))
            return None

    model_ref = attempt(("model", "checkpoint"),
                        lambda: resolve_checkpoint(spec.model.checkpoint, "target", spec_dir))
    geometry = _geometry(spec, model_ref, issues, attempt)
    draft_ref = attempt(("draft", "checkpoint"),
                        lambda: resolve_checkpoint(spec.draft.checkpoint, "draft", spec_dir))
    draft_dummy = spec.draft.load_format == "dummy"
    draft_config = None
    if draft_ref is not None and not draft_dummy:
        draft_config = attempt(("draft", "checkpoint"), lambda: draft_ref.config("draft"))
    # Dummy weights are never read: "" is the digest of weights that are not compared.
    model_digest = "" if spec.model.load_format == "dummy" else _digest(
        model_ref, geometry is not None, ("model", "checkpoint"), attempt)
    config_path = draft_ref.config_path if draft_ref is not None else None
    spec, draft_issues = resolve_draft(spec, draft_config, config_path, geometry)
    issues += draft_issues
    draft_readable = draft_config is not None or (draft_ref is not None and not draft_ref.present)
    draft_digest = "" if draft_dummy else _digest(draft_ref, draft_readable, ("draft", "checkpoint"), attempt)
    cost_model = attempt(("cost_model", "file"), lambda: _cost_model(spec, spec_dir))
    calibration = attempt(("calibration", "file"), lambda: _calibration(spec, spec_dir))
    temperatures = calibration.temperatures if calibration is not None else None
    calibration_file = calibration if isinstance(calibration, CalibrationFileContents) else None
    facts = SpecFacts(spec, geometry, model_ref, draft_ref, draft_config, cost_model, temperatures,
                      calibration_file, model_digest, draft_digest)
    return facts, issues


def _digest(ref: CheckpointRef | None, readable: bool, path: tuple[str, ...], attempt: Any) -> str | None:
    """The checkpoint's digest, unless resolving or reading it already failed."""
    if ref is None or not readable:
        return None
    return attempt(path, ref.digest)


def _geometry(spec: DeploymentSpec, ref: CheckpointRef | None, issues: list[SpecIssue],
              attempt: Any) -> TargetGeometry | None:
    inline = _inline_geometry(spec, issues)
    if ref is None:
        return inline
    config = attempt(("model", "checkpoint"), lambda: ref.config("model"))
    if config is None:
        if ref.present:
            return None  # the config could not be read; that issue is already recorded
        if inline is None:
            section = GEOMETRY_SECTIONS[spec.model.family]
            issues.append(SpecIssue(
                ("model", "geometry"),
                f"required field is missing: checkpoint {spec.model.checkpoint!r} is not on "
                f"this machine, so there is no config.json to read the geometry from",
                f"add model.geometry ({required_fields(section)}) or "
                "point model.checkpoint at a directory with a config.json"))
        return inline
    from_checkpoint = attempt(("model", "checkpoint"),
                              lambda: _checkpoint_geometry(spec.model.family, config, ref.config_path))
    if from_checkpoint is None:
        return None
    for field, mine, theirs in geometry_differences(inline, from_checkpoint) if inline else ():
        issues.append(SpecIssue(
            ("model", "geometry", field),
            f"{field} is {mine!r} here but {theirs!r} in {str(ref.config_path)!r}",
            "remove model.geometry (it is read from the checkpoint) or make it match"))
    return from_checkpoint


def _inline_geometry(spec: DeploymentSpec, issues: list[SpecIssue]) -> TargetGeometry | None:
    """The spec's own geometry as it compiles, and what it cannot say for its family."""
    inline = spec.model.geometry
    if inline is None:
        return None
    if isinstance(inline, Dsv4GeometrySpec):
        return inline.geometry()
    issues += _family_geometry_issues(spec.model.family, inline)
    return _with_head_dim(inline)


def _checkpoint_geometry(family: ModelFamily, config: dict[str, Any], path: Path) -> TargetGeometry:
    """The geometry a checkpoint's config.json describes, read by the family's own reader."""
    if family.dense:
        return _with_head_dim(geometry_from_hf_config(config, path, family))
    return geometry_from_dsv4_config(config, path)


def _family_geometry_issues(family: str, inline: GeometrySpec) -> list[SpecIssue]:
    """What an inline geometry cannot say for `family` (a checkpoint's config is read per family)."""
    fam, issues = FAMILIES[family], []
    if fam.head_dim_default is not None and inline.head_dim is None:
        issues.append(SpecIssue(
            ("model", "geometry", "head_dim"),
            f"required field is missing: {family} configs do not derive head_dim from hidden_size / "
            f"num_heads (transformers defaults it to {fam.head_dim_default})",
            "set model.geometry.head_dim to the checkpoint's head_dim"))
    if not fam.has_mlp_bias and inline.mlp_bias:
        issues.append(SpecIssue(("model", "geometry", "mlp_bias"), f"{family} models have no MLP bias",
                                "remove mlp_bias"))
    return issues


def _with_head_dim(geometry: GeometrySpec) -> GeometrySpec:
    return geometry.model_copy(update={"head_dim": geometry.resolved_head_dim})


def _cost_model(spec: DeploymentSpec, spec_dir: Path) -> CostTable | None:
    cost = spec.cost_model
    if not isinstance(cost, CostModelFile):
        return cost
    path = resolve_path(cost.file, spec_dir)
    model = COST_TABLE_MODELS[cost.type]
    data = read_json(path, f"{cost.type} cost model file")
    if isinstance(data, dict) and data.get("type", cost.type) != cost.type:
        raise FieldValueError(f"cost model file {str(path)!r} holds a {data['type']!r} table",
                             f"set cost_model.type: {data['type']} or use the right file")
    return validate_file_data(model, data, path, f"{cost.type} cost model file",
                              extra={"type": cost.type})


def _calibration(spec: DeploymentSpec, spec_dir: Path) -> CalibrationInline | None:
    """The inline calibration, or the file's contents (a `CalibrationFileContents`)."""
    calibration = spec.calibration
    if isinstance(calibration, CalibrationFile):
        path = resolve_path(calibration.file, spec_dir)
        data = read_json(path, "calibration file")
        return validate_file_data(CalibrationFileContents, data, path, "calibration file")
    return calibration
