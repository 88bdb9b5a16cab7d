"""Load a deployment spec: YAML → pydantic → checkpoints and files → whole-spec rules."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from pydantic import ValidationError

from dspark.spec.diagnostics import issues_from_validation
from dspark.spec.errors import Location, SpecError, SpecIssue, format_path
from dspark.spec.facts import gather_facts
from dspark.spec.models import DeploymentSpec
from dspark.spec.resolved import ResolvedSpec
from dspark.spec.rules import num_draft_tokens, resolved_max_verify_len, run_rules, tier_grid
from dspark.spec.staleness import calibration_policy, check_tables
from dspark.spec.yaml_source import YamlDocument, locate, parse_yaml

_REPO_MARKERS = (".git", "pyproject.toml")


def load_spec(path: str | os.PathLike[str], *, allow_stale_tables: bool = False) -> ResolvedSpec:
    """Load, validate and resolve a spec file; raises `SpecError` listing every problem.

    A cost table or calibration whose fingerprint says it was measured on a different deployment is
    an error unless `allow_stale_tables`; then it is kept and `ResolvedSpec.stale_tables` says so.
    """
    given = Path(path)
    display = display_path(given)
    try:
        raw = given.read_bytes()
    except OSError as exc:
        raise SpecError([SpecIssue((), f"cannot read the spec: {exc.strerror}",
                                   "check the spec path", Location(display, 1, 1))]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError([SpecIssue((), f"the spec is not UTF-8 text ({exc.reason})",
                                   "save the file as UTF-8", Location(display, 1, 1))]) from None
    document = parse_yaml(text, display)
    if not isinstance(document.data, dict):
        raise SpecError([SpecIssue((), "the spec must be a YAML mapping of sections",
                                   "start with `name:`, `model:`, `draft:` and `backend:`",
                                   locate(document, ()))])
    try:
        spec = DeploymentSpec.model_validate(document.data)
    except ValidationError as exc:
        raise SpecError(_in_source_order(issues_from_validation(exc, document))) from None
    source = given.resolve()
    facts, issues = gather_facts(spec, source.parent)
    issues += run_rules(facts)
    tables = check_tables(facts)
    issues += tables.invalid
    if not allow_stale_tables:
        issues += [stale.issue for stale in tables.stale]
    if issues:
        raise SpecError(_in_source_order(
            [issue.at(locate(document, issue.path)) for issue in issues]))
    assert facts.geometry and facts.model_checkpoint and facts.draft_checkpoint
    return ResolvedSpec(
        spec=spec,
        source=source,
        display_path=display,
        source_sha256=hashlib.sha256(raw).hexdigest(),
        geometry=facts.geometry,
        model_checkpoint=facts.model_checkpoint,
        draft_checkpoint=facts.draft_checkpoint,
        num_draft_tokens=num_draft_tokens(spec),
        max_verify_len=resolved_max_verify_len(spec),
        tiers=tier_grid(spec),
        cost_model=facts.cost_model,
        temperatures=facts.temperatures,
        locations=_field_locations(document),
        cost_model_fingerprint=tables.cost_model_fingerprint,
        calibration_fingerprint=tables.calibration_fingerprint,
        calibration_policy=calibration_policy(facts, tables.calibration_fingerprint),
        stale_tables=tuple(stale.warning for stale in tables.stale),
    )


def display_path(path: Path) -> str:
    """The spec path written into generated files and errors.

    Relative to the enclosing repository (the nearest ancestor with .git or pyproject.toml) so the
    generated header is the same whatever directory the compiler runs from; otherwise relative to
    the working directory, otherwise as given.
    """
    absolute = path.resolve()
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
