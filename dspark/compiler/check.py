"""`dspark-compile check`: are the committed generated packages what the specs compile to?"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dspark.compiler.diff import diff_files
from dspark.compiler.emit import render_package
from dspark.compiler.nodes import MANIFEST_FILE
from dspark.compiler.write import GENERATED_ROOT_INIT, existing_files
from dspark.spec import SpecError, load_spec


@dataclass(frozen=True)
class CheckReport:
    stale: tuple[str, ...]  # one unified diff or message per out-of-date package
    spec_errors: tuple[str, ...]  # formatted reports of specs that do not load
    orphans: tuple[str, ...] = ()  # one message per package that no spec in the specs directory makes

    @property
    def ok(self) -> bool:
        return not self.stale and not self.spec_errors and not self.orphans


def check_generated(specs_dir: Path, generated_dir: Path, *,
                    allow_stale_tables: bool = False) -> CheckReport:
    stale: list[str] = []
    spec_errors: list[str] = []
    specs = sorted(specs_dir.glob("*.yaml"))
    if not specs:
        stale.append(f"no specs found in {specs_dir}\n")
    names: set[str] = set()
    for spec_path in specs:
        try:
            resolved = load_spec(spec_path, allow_stale_tables=allow_stale_tables)
        except SpecError as exc:
            spec_errors.append(str(exc))
            continue
        names.add(resolved.name)
        package_dir = generated_dir / resolved.name
        fresh = render_package(resolved, package_dir).files
        diff = diff_files(existing_files(package_dir), fresh, package_dir.as_posix(),
                          package_dir.as_posix())
        if diff:
            stale.append(diff)
    init = generated_dir / "__init__.py"
    if not init.is_file():
        stale.append(diff_files({}, {"__init__.py": GENERATED_ROOT_INIT.encode()},
                                generated_dir.as_posix(), generated_dir.as_posix()))
    orphans = []
    # A spec that failed to load may be the one that makes a package, so orphans wait for it.
    for package in sorted(p for p in generated_dir.glob("*/") if p.is_dir()):
        if package.name not in names and package.name != "__pycache__" and not spec_errors:
            orphans.append(_orphan_message(package, specs_dir))
    return CheckReport(tuple(stale), tuple(spec_errors), tuple(orphans))


def _orphan_message(package: Path, specs_dir: Path) -> str:
    built_from = _manifest_spec(package)
    origin = f" (its manifest says it was built from {built_from})" if built_from else ""
    return (f"{package.as_posix()}: no spec in {specs_dir.as_posix()} compiles to it{origin}; "
            f"building again cannot fix this: move its spec into {specs_dir.as_posix()}/ (then build "
            f"it) or delete the package\n")


def _manifest_spec(package: Path) -> str | None:
    try:
        data = json.loads((package / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    spec = data.get("spec") if isinstance(data, dict) else None
    path = spec.get("path") if isinstance(spec, dict) else None
    return path if isinstance(path, str) and path else None
