"""Load a deployment spec: YAML → pydantic → checkpoints and files → whole-spec rules."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from dspark.spec.derived import num_draft_tokens, resolved_max_verify_len, tier_grid
from dspark.spec.diagnostics import issues_from_validation
from dspark.spec.errors import Location, SpecError, SpecIssue, format_path
from dspark.spec.facts import gather_facts
from dspark.spec.models import DeploymentSpec
from dspark.spec.resolved import ResolvedSpec
from dspark.spec.rules import run_rules
from dspark.spec.staleness import calibration_policy, check_tables
from dspark.spec.yaml_source import YamlDocument, locate, parse_yaml

_REPO_MARKERS = (".git", "pyproject.toml")
MAX_SPEC_BYTES = 1 << 20


def load_spec(path: str | os.PathLike[str], *, allow_stale_tables: bool = False) -> ResolvedSpec:
    """Load, validate and resolve a spec file; raises `SpecError` listing every problem.

    A cost table or calibration whose fingerprint says it was measured on a different deployment is
    an error unless `allow_stale_tables`; then it is kept and `ResolvedSpec.stale_tables` says so.
    """
    given = Path(path)
    display = display_path(given)
    raw = _read_spec(given, display)
    document = parse_yaml(_decode(raw, display), display)
    if not isinstance(document.data, dict):
        if document.issues:
            raise SpecError(_in_source_order(list(document.issues)))
        raise SpecError([SpecIssue((), "the spec must be a YAML mapping of sections",
                                   "start with `name:`, `model:`, `draft:` and `backend:`",
                                   locate(document, ()))])
    try:
        spec = DeploymentSpec.model_validate(document.data)
    except ValidationError as exc:
        found = [issue for issue in issues_from_validation(exc, document)
                 if not _covered(issue, document.issues)]
        raise SpecError(_in_source_order([*document.issues, *found])) from None
    if document.issues:
        raise SpecError(_in_source_order(list(document.issues)))
    source = given.resolve()
    facts, issues = gather_facts(spec, source.parent)
    spec = facts.spec  # its draft section filled in from the checkpoint or the defaults
    issues += run_rules(facts)
    tables = check_tables(facts)
    issues += tables.invalid
    if not allow_stale_tables:
        issues += [stale.issue for stale in tables.stale]
    if issues:
        raise SpecError(_in_source_order(
            [issue.at(locate(document, issue.path)) for issue in issues]))
    assert facts.geometry and facts.model_checkpoint and facts.draft_checkpoint
    assert facts.model_digest is not None and facts.draft_digest is not None
    return ResolvedSpec(
        spec=spec,
        source=source,
        display_path=display,
        source_sha256=hashlib.sha256(raw).hexdigest(),
        geometry=facts.geometry,
        model_checkpoint=facts.model_checkpoint,
        draft_checkpoint=facts.draft_checkpoint,
        model_digest=facts.model_digest,
        draft_digest=facts.draft_digest,
        num_draft_tokens=num_draft_tokens(spec),
        max_verify_len=resolved_max_verify_len(spec),
        tiers=tier_grid(spec),
        cost_model=facts.cost_model,
        temperatures=facts.temperatures,
        locations=_field_locations(document),
        cost_model_fingerprint=tables.cost_model_fingerprint,
        calibration_fingerprint=tables.calibration_fingerprint,
        calibration_policy=calibration_policy(facts, tables.calibration_fingerprint),
        survival_map=facts.calibration_file.survival_map if facts.calibration_file is not None else None,
        stale_tables=tuple(stale.warning for stale in tables.stale),
    )


def _read_spec(path: Path, display: str) -> bytes:
    where = Location(display, 1, 1)
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_SPEC_BYTES + 1)
    except IsADirectoryError:
        raise SpecError([SpecIssue((), "the spec path is a directory",
                                   "name the spec's .yaml file", where)]) from None
    except OSError as exc:
        raise SpecError([SpecIssue((), f"cannot read the spec: {exc.strerror or exc}",
                                   "check the spec path and its permissions", where)]) from None
    except ValueError as exc:  # a NUL character in the path
        raise SpecError([SpecIssue((), f"cannot open the spec: {exc}", "check the spec path",
                                   where)]) from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError([SpecIssue((), f"the spec is larger than {MAX_SPEC_BYTES >> 10} KiB",
                                   "a spec is a few KB; keep large tables in JSON files named by "
                                   "cost_model.file or calibration.file", where)])
    return raw


def _decode(raw: bytes, display: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_start = raw.rfind(b"\n", 0, exc.start) + 1
        line = raw.count(b"\n", 0, exc.start) + 1
        column = len(raw[line_start:exc.start].decode("utf-8", errors="replace")) + 1
        raise SpecError([SpecIssue(
            (), f"the spec is not UTF-8 text: byte {raw[exc.start]:#04x} here ({exc.reason})",
            "save the file as UTF-8 (or remove the character)",
            Location(display, line, column))]) from None


def _covered(issue: SpecIssue, by: Sequence[SpecIssue]) -> bool:
    """Whether a validation issue concerns a value the YAML reader already refused (and left out)."""
    return any(issue.path[:len(other.path)] == other.path for other in by)


def display_path(path: Path) -> str:
    """The spec path written into generated files and errors.

    Relative to the enclosing repository (the nearest ancestor with .git or pyproject.toml) so the
    generated header is the same whatever directory the compiler runs from; otherwise relative to
    the working directory, otherwise as given.
    """
    try:
        absolute = path.resolve()
    except (OSError, ValueError, RuntimeError):  # a NUL character, a symlink loop
        return path.as_posix()
    for ancestor in absolute.parents:
        if any((ancestor / marker).exists() for marker in _REPO_MARKERS):
            return absolute.relative_to(ancestor).as_posix()
    try:
        return absolute.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def _field_locations(document: YamlDocument) -> dict[str, Location]:
    return {format_path(path): location for path, location in document.value_locations.items()
            if path}


def _in_source_order(issues: list[SpecIssue]) -> list[SpecIssue]:
    def key(issue: SpecIssue) -> tuple[int, int, str]:
        where = issue.location
        return (where.line, where.column, format_path(issue.path)) if where else (0, 0, "")
    return sorted(issues, key=key)
