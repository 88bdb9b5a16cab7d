"""Helpers shared by runtime tests: compile a variant of a repo spec into a temp directory."""

from __future__ import annotations

import importlib
import importlib.util
import sys
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
