"""The fully resolved, validated spec that the compiler consumes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dspark.fingerprint import Fingerprint
from dspark.formats.cost_tables import CostTable
from dspark.formats.sts_calibration import SurvivalMapKnots
from dspark.modes import SpeculationOff
from dspark.spec.checkpoints import CheckpointRef
from dspark.spec.errors import FieldPath, Location, format_path
from dspark.spec.models import DeploymentSpec, TargetGeometry


@dataclass(frozen=True)
class ResolvedSpec:
    """A spec that passed every check, with everything derived from it and read from disk."""

    spec: DeploymentSpec
    source: Path  # absolute path of the spec file
    display_path: str  # posix path written into generated code (repo-relative when possible)
    source_sha256: str  # of the spec file's bytes
    geometry: TargetGeometry  # a dense geometry with head_dim always set, or a Dsv4Geometry
    model_checkpoint: CheckpointRef
    draft_checkpoint: CheckpointRef
    # dspark.checkpoints.digest.checkpoint_digest of each checkpoint at compile time: sha256 over its
    # config.json and weights, "" only when the directory is not on this machine.
    model_digest: str
    draft_digest: str
    num_draft_tokens: int  # N = gamma + 1
    max_verify_len: int  # verify.max_verify_len with 0 resolved to N
    tiers: tuple[int, ...]  # graph tier grid; empty when graph capture is off
    cost_model: CostTable | None  # inline or loaded from its file
    temperatures: tuple[float, ...] | None  # inline or loaded from the calibration file
    locations: Mapping[str, Location]  # dotted field path -> where its value is written
    cost_model_fingerprint: Fingerprint | None = None  # what the cost table was measured on
    calibration_fingerprint: Fingerprint | None = None  # what the calibration was fitted on
    calibration_policy: str | None = None  # the policy the calibration was fitted for, if stated
    survival_map: SurvivalMapKnots | None = None  # the calibration file's monotone map, if it has one
    stale_tables: tuple[str, ...] = ()  # header warnings for tables kept with --allow-stale-tables

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def speculation_off(self) -> SpeculationOff:
        """`verify.off` as the planner runs it: auto only with a planner and a table pricing decode steps
        (`check_speculation_off` refuses an explicit auto without them)."""
        priced = self.cost_model is not None and bool(self.cost_model.decode_bs_probes)
        if self.spec.verify.off is SpeculationOff.AUTO and self.spec.verify.mode.plans and priced:
            return SpeculationOff.AUTO
        return SpeculationOff.NEVER

    def location_of(self, path: str | FieldPath) -> Location | None:
        """Where a field is written in the spec, or None for a default value."""
        key = path if isinstance(path, str) else format_path(path)
        return self.locations.get(key)

    def line_of(self, path: str | FieldPath) -> int | None:
        location = self.location_of(path)
        return location.line if location else None
