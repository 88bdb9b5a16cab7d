"""Helpers shared by runtime tests: compile a variant of a repo spec into a temp directory."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from dspark.compiler.api import build

from .conftest import merged

REPO = Path(__file__).resolve().parents[1]


def spec_with(tmp_path: Path, build: str, name: str, sections: dict[str, Any]) -> Path:
    """`specs/<build>.yaml` with its table files made absolute, named `name` and `sections` set (a value of
    None writes the section empty), written into `tmp_path`; returns the spec's path (not compiled)."""
    data = yaml.safe_load((REPO / "specs" / f"{build}.yaml").read_text())
    for key in ("cost_model", "calibration"):  # their files, relative to specs/
        if isinstance(data.get(key), dict) and "file" in data[key]:
            data[key]["file"] = str(REPO / "specs" / data[key]["file"])
    data.update(name=name, **sections)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def compile_on_and_off(tmp_path: Path, spec: Callable[[dict[str, Any]], Path], section: dict[str, Any],
                       field: str, settings_class: str) -> Path:
    """Compile with the CLI the spec `spec(section)` writes (an optional section written), then `spec` of the
    section disabled: the first's deployment.py sets `field` to a `settings_class`, the second's names neither
    and loads `field` as None. Returns the first's package directory."""
    from dspark.cli.compile import main as compile_main
    from dspark.runtime.package import load_package

    assert compile_main(["build", str(spec(section)), "-o", str(tmp_path / "pkg")]) == 0
    assert f"{field}={settings_class}(" in (tmp_path / "pkg" / "deployment.py").read_text()
    assert compile_main(["build", str(spec({"enabled": False})), "-o", str(tmp_path / "off")]) == 0
    assert getattr(load_package(tmp_path / "off").deployment, field) is None
    assert settings_class not in (tmp_path / "off" / "deployment.py").read_text()
    return tmp_path / "pkg"


def compile_variant(tmp_path: Path, spec: str, overrides: dict[str, Any], name: str) -> Path:
    """Compile `specs/<spec>` with `overrides` deep-merged in; returns the package directory."""
    data = yaml.safe_load((REPO / "specs" / spec).read_text())
    data = merged(data, {"name": name, **overrides})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    out = tmp_path / "pkgs" / name
    build(path, out)
    return out


def import_file(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_package_module(directory: Path, module: str) -> ModuleType:
    """`directory/<module>.py` of a generated package, imported as part of its package (the
    generated modules import each other relatively)."""
    name = f"_test_pkg_{directory.name}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, directory / "__init__.py",
                                                      submodule_search_locations=[str(directory)])
        assert spec is not None and spec.loader is not None
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"{name}.{module}")
