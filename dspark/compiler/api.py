"""The compiler's entry points: spec file in, generated package out."""

from __future__ import annotations

import os
from pathlib import Path

from dspark.compiler.emit import CompiledPackage, render_package
from dspark.compiler.write import write_package
from dspark.spec import load_spec

DEFAULT_OUTPUT_ROOT = Path("generated")


def default_package_dir(name: str) -> Path:
    return DEFAULT_OUTPUT_ROOT / name


def compile_spec(spec_path: str | os.PathLike[str],
                 package_dir: str | os.PathLike[str] | None = None, *,
                 allow_stale_tables: bool = False) -> CompiledPackage:
    """Load and render a spec in memory (nothing is written); raises `SpecError`.

    `allow_stale_tables` keeps cost tables and calibrations measured on a different deployment
    (see `dspark.spec.staleness`); the generated header then warns about each.
    """
    resolved = load_spec(spec_path, allow_stale_tables=allow_stale_tables)
    target = Path(package_dir) if package_dir is not None else default_package_dir(resolved.name)
    return render_package(resolved, target)


def build(spec_path: str | os.PathLike[str], package_dir: str | os.PathLike[str] | None = None,
          force: bool = False, *, allow_stale_tables: bool = False) -> CompiledPackage:
    """Compile a spec and write its package (default `generated/<name>` under the cwd).

    Raises `SpecError` for an invalid spec and `CompileError` when the existing package has hand
    edits (unless `force`).
    """
    package = compile_spec(spec_path, package_dir, allow_stale_tables=allow_stale_tables)
    write_package(package.files, package.package_dir, force=force)
    return package
