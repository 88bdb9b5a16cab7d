"""Resolve `model.checkpoint` / `draft.checkpoint`, read what their config.json says, and compute
their content digest (`dspark.checkpoints.digest`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from dspark.checkpoints import EMBEDDED_PREFIX, embedded_root
from dspark.checkpoints.digest import DigestError, checkpoint_digest
from dspark.families import ModelFamily
from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.formats.dsv4_hf_config import DSV4_MODEL_TYPE, dsv4_geometry
from dspark.formats.fields import FieldValueError
from dspark.formats.hf_config import (
    FAMILIES,
    HF_GEOMETRY_KEYS,
    HF_OPTIONAL_KEYS,
    ConfigFieldError,
    geometry_values,
)
from dspark.spec.external import path_kind, read_json, resolve_path, validate_file_data
from dspark.spec.models import GeometrySpec, TargetGeometry

Role = Literal["target", "draft"]

@dataclass(frozen=True)
class CheckpointRef:
    """A checkpoint as written in the spec and where it lives on this machine."""

    raw: str
    directory: Path
    embedded: str | None = None

    @property
    def config_path(self) -> Path:
        return self.directory / "config.json"

    @property
    def present(self) -> bool:
        """Whether the checkpoint directory is on this machine (anything else at the path is an
        error that `config` reports)."""
        return path_kind(self.directory) != "missing"

    def config(self, what: str) -> dict[str, Any] | None:
        """The checkpoint's config.json, or None when the directory is not on this machine."""
        kind = path_kind(self.directory)
        if kind == "missing":
            return None
        if kind != "directory":
            raise FieldValueError(f"{what} checkpoint {str(self.directory)!r} is not a directory",
                                 "point at the checkpoint directory (the one holding config.json "
                                 "and the *.safetensors files), not at a file in it")
        if path_kind(self.config_path) != "file":
            raise FieldValueError(f"checkpoint directory {str(self.directory)!r} has no config.json",
                                 f"add the {what} config.json or point at the right directory")
        data = read_json(self.config_path, f"{what} config")
        if not isinstance(data, dict):
            raise FieldValueError(f"{what} config {str(self.config_path)!r} is not a JSON object",
                                 "use the config.json written with the checkpoint")
        return data

    def digest(self) -> str:
        """`checkpoint_digest` of the directory; "" when it is not on this machine."""
        if not self.present:
            return ""
        try:
            return checkpoint_digest(self.directory)
        except DigestError as exc:
            raise FieldValueError(str(exc), "make the checkpoint's files readable") from None


def resolve_checkpoint(raw: str, role: Role, spec_dir: Path) -> CheckpointRef:
    if not raw.startswith(EMBEDDED_PREFIX):
        return CheckpointRef(raw, resolve_path(raw, spec_dir))
    name = raw[len(EMBEDDED_PREFIX):]
    root = embedded_root()
    available = sorted(p.name for p in root.iterdir() if (p / role).is_dir()) if root.is_dir() \
        else []
    if not re.fullmatch(r"[a-z0-9_]+", name) or not (root / name / role).is_dir():
        raise FieldValueError(
            f"unknown embedded checkpoint {raw!r} (no {role} model in dspark's checkpoints)",
            f"use one of: {', '.join(EMBEDDED_PREFIX + a for a in available)}" if available
            else "no embedded checkpoints are installed; use a checkpoint directory")
    return CheckpointRef(raw, root / name / role, embedded=name)


def geometry_from_hf_config(config: dict[str, Any], path: Path, family: str = "llama") -> GeometrySpec:
    """The model config a checkpoint's config.json describes, read as the runtime's loader reads it
    (`dspark.formats.hf_config`), so the compiled geometry is what will load; a value the runtime
    does not implement is refused here, naming the config key."""
    fam = FAMILIES[family]
    if config.get("model_type") == DSV4_MODEL_TYPE:
        raise FieldValueError(f"model config {str(path)!r} is a DeepSeek-V4 config (model_type "
                              f"{DSV4_MODEL_TYPE!r}), not a {family} one",
                              f"set model.family: {ModelFamily.DSV4}")
    missing = [key for key in HF_GEOMETRY_KEYS.values()
               if key not in config and key not in HF_OPTIONAL_KEYS]
    if missing:
        raise FieldValueError(f"model config {str(path)!r} lacks {', '.join(missing)}",
                             f"use the Hugging Face {fam.architecture} config.json of the checkpoint")
    try:
        values = geometry_values(config, family)
    except ConfigFieldError as exc:
        raise FieldValueError(f"model config {str(path)!r}: {exc}", exc.hint) from None
    return validate_file_data(GeometrySpec, values, path, "model config")


def geometry_from_dsv4_config(config: dict[str, Any], path: Path) -> Dsv4Geometry:
    """The DeepSeek-V4 geometry a checkpoint's config.json describes (`dsv4_geometry`, the reader the
    runtime's model is built from); a key whose value dspark's DSV4 does not implement is refused here,
    naming config.json and the key."""
    try:
        return dsv4_geometry(config)
    except ConfigFieldError as exc:
        raise FieldValueError(f"model config {str(path)!r}: {exc}", exc.hint) from None


def geometry_differences(inline: TargetGeometry, from_checkpoint: TargetGeometry
                         ) -> list[tuple[str, Any, Any]]:
    """(field, inline value, checkpoint value) for every field where two geometries of one kind disagree."""
    mine, theirs = _compiled_values(inline), _compiled_values(from_checkpoint)
    return [(field, value, theirs[field]) for field, value in mine.items() if value != theirs[field]]


def _compiled_values(geometry: TargetGeometry) -> dict[str, Any]:
    """Every field of a geometry as it is compiled (a dense geometry's head_dim resolved)."""
    if isinstance(geometry, GeometrySpec):
        values = {name: getattr(geometry, name) for name in GeometrySpec.model_fields}
        return {**values, "head_dim": geometry.resolved_head_dim}
    return {field.name: getattr(geometry, field.name) for field in fields(geometry)}
