"""Refuse a cost table or calibration that was measured on a different deployment.

Table files may carry the `Fingerprint` of the deployment they were measured on. A table measured
on another device, tier grid, draft, … silently mis-prices the planner's budget, so the loader turns
every difference in the fields that matter for that kind of file (`COST_FIELDS`,
`CALIBRATION_FIELDS`) into an issue at the spec field that names the file. `--allow-stale-tables`
turns those issues into warnings that the generated header repeats, so the override stays visible
in review.

Checkpoints are compared by content digest (`model_weights`, `draft_weights`). When a checkpoint
directory is not on the compiling machine (the 8B specs name /models/... paths that only exist on
the serving host) its digest is unknown: then the weights of that checkpoint are NOT checked, and
only what the spec itself states is (its geometry, the draft's settings, gamma, the hardware, the
tiers, ...). A table that recorded no weights digest while the spec's checkpoint is present is
stale: nothing shows it was measured with these weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dspark.fingerprint import (
    CALIBRATION_FIELDS,
    COST_FIELDS,
    DRAFT_FIELDS,
    WEIGHT_FIELDS,
    Fingerprint,
    FingerprintError,
    fingerprint_of_spec_parts,
)
from dspark.spec.derived import tier_grid
from dspark.spec.errors import FieldPath, SpecIssue, format_path
from dspark.spec.facts import SpecFacts
from dspark.spec.tables import CalibrationFile, CostModelFile

ALLOW_FLAG = "--allow-stale-tables"


@dataclass(frozen=True)
class StaleTable:
    """A table measured on a different deployment: the error, and the warning used instead of it."""

    issue: SpecIssue
    warning: str  # one line for the generated header when the override is given


@dataclass(frozen=True)
class TableCheck:
    cost_model_fingerprint: Fingerprint | None
    calibration_fingerprint: Fingerprint | None
    invalid: tuple[SpecIssue, ...]  # malformed fingerprints: always errors
    stale: tuple[StaleTable, ...]


def check_tables(facts: SpecFacts) -> TableCheck:
    spec = facts.spec
    invalid: list[SpecIssue] = []
    stale: list[StaleTable] = []
    current = None
    if facts.geometry is not None and facts.model_digest is not None and facts.draft_digest is not None:
        current = fingerprint_of_spec_parts(spec, facts.geometry, tier_grid(spec),
                                            model_digest=facts.model_digest, draft_digest=facts.draft_digest)
    cost_fields = _checkable(COST_FIELDS, current)
    if facts.cost_model is not None and not facts.cost_model.draft_bs_probes:
        # The table timed the verify step only: the draft it was measured beside does not matter.
        cost_fields = tuple(name for name in cost_fields if name not in DRAFT_FIELDS)
    calibration_fields = _checkable(CALIBRATION_FIELDS, current)

    cost_raw = getattr(facts.cost_model, "fingerprint", None)
    cost_file = spec.cost_model.file if isinstance(spec.cost_model, CostModelFile) else None
    cost_path: FieldPath = ("cost_model", "file") if cost_file else ("cost_model", "fingerprint")
    cost_fp = _parse(cost_raw, cost_path, "cost model", cost_file, invalid)
    if cost_fp is not None and current is not None:
        found = _stale(cost_path, "cost model table", cost_file, cost_fp.differences(current, cost_fields),
                       f"re-profile this deployment (build it with {ALLOW_FLAG}, run `dspark profile "
                       f"generated/{spec.name} -o DIR`) and point cost_model.file at the new table")
        stale += found

    contents = facts.calibration_file
    calibration_file = spec.calibration.file if isinstance(spec.calibration, CalibrationFile) else None
    calibration_path: FieldPath = ("calibration", "file")
    calibration_fp = None
    if contents is not None:
        calibration_fp = _parse(contents.fingerprint, calibration_path, "calibration", calibration_file,
                                invalid)
    if contents is not None and current is not None:
        differences = calibration_fp.differences(current, calibration_fields) if calibration_fp else []
        # With calibration.policy set, a file policy that disagrees is reported by the policy rule.
        stated = spec.calibration is not None and spec.calibration.policy is not None
        listed = any(line.startswith("policy:") for line in differences)
        if contents.policy is not None and contents.policy != current.policy and not (listed or stated):
            differences.append(f"policy: fitted for {contents.policy!r} but the spec has "
                               f"{current.policy!r}")
        stale += _stale(calibration_path, "calibration", calibration_file, differences,
                        "re-calibrate on this deployment and policy (`dspark calibrate`) and point "
                        "calibration.file at the new file")
    return TableCheck(cost_fp, calibration_fp, tuple(invalid), tuple(stale))


def _checkable(fields: Sequence[str], current: Fingerprint | None) -> tuple[str, ...]:
    """`fields` less the weights of checkpoints absent here (their digest is "": unknown, not "none")."""
    if current is None:
        return tuple(fields)
    return tuple(name for name in fields if not (name in WEIGHT_FIELDS and getattr(current, name) == ""))


def _parse(raw: Any, path: FieldPath, what: str, file: str | None,
           invalid: list[SpecIssue]) -> Fingerprint | None:
    if raw is None:
        return None
    try:
        return Fingerprint.from_json(raw)
    except FingerprintError as exc:
        where = f"{what} file {file!r}" if file else f"the inline {what}"
        invalid.append(SpecIssue(path, f"{where} has an invalid fingerprint: {exc}",
                                 f"rewrite the {what} with the tool that measured it, or delete its "
                                 f"fingerprint object"))
        return None


def _stale(path: FieldPath, what: str, file: str | None, differences: Sequence[str],
           redo: str) -> list[StaleTable]:
    if not differences:
        return []
    where = f"{what} file {file!r}" if file else f"the inline {what}"
    count = f"{len(differences)} fields differ" if len(differences) > 1 else "1 field differs"
    message = (f"{where} was measured on a different deployment ({count}):\n      "
               + "\n      ".join(differences))
    hint = f"{redo}, or pass {ALLOW_FLAG} to compile with the stale table anyway"
    fields = ", ".join(line.split(":", 1)[0] for line in differences)
    warning = (f"WARNING: compiled with {ALLOW_FLAG}: {format_path(path)} "
               f"{file or 'table'!r} is stale ({fields}).")
    return [StaleTable(SpecIssue(path, message, hint), warning)]


def calibration_policy(facts: SpecFacts, calibration_fp: Fingerprint | None) -> str | None:
    """The policy the calibration was fitted for, as the spec or its file states it (None: unstated)."""
    calibration = facts.spec.calibration
    if calibration is not None and calibration.policy is not None:
        return calibration.policy
    contents = facts.calibration_file
    if contents is not None and contents.policy is not None:
        return contents.policy
    return calibration_fp.policy if calibration_fp is not None else None
