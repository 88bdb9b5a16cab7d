"""`dspark-compile check`: are the committed generated packages what the specs compile to?"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dspark.compiler.diff import diff_files
from dspark.compiler.emit import render_package
from dspark.compiler.write import GENERATED_ROOT_INIT, existing_files
from dspark.spec import SpecError, load_spec


@dataclass(frozen=True)
class CheckReport:
    stale: tuple[str, ...]  # one unified diff or message per out-of-date package
    spec_errors: tuple[str, ...]  # formatted reports of specs that do not load

    @property
    def ok(self) -> bool:
        return not self.stale and not self.spec_errors


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
    for orphan in sorted(p for p in generated_dir.glob("*/") if p.is_dir()):
        if orphan.name not in names and orphan.name != "__pycache__" and not spec_errors:
            stale.append(f"{orphan}: no spec in {specs_dir} compiles to it; delete it or "
                         f"restore its spec\n")
    return CheckReport(tuple(stale), tuple(spec_errors))
