"""The package's layering, enforced (docs/architecture.md, "Layers").

- The spec, the compiler, the file formats and the shared vocabulary never import torch, the
  runtime or anything built on it: `dspark-compile` stays light on a machine without torch.
- The runtime never imports the compiler, the spec, measurement, reports, the load client or the
  command line: a generated package needs only the runtime.
- No module imports another module's private (underscore) names.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "dspark"

LIGHT = ("dspark.spec", "dspark.compiler", "dspark.formats", "dspark.modes", "dspark.backends",
         "dspark.fingerprint", "dspark.checkpoints", "dspark.atomic", "dspark.cli.compile")
HEAVY = ("torch", "triton", "dspark.runtime", "dspark.measure", "dspark.report", "dspark.bench",
         "dspark.train", "dspark.simulate", "dspark.cli")
# The one file format stored as torch tensors.
TORCH_FORMATS = ("dspark.formats.sts_shards",)
RUNTIME_MUST_NOT = ("dspark.compiler", "dspark.spec", "dspark.measure", "dspark.report", "dspark.bench",
                    "dspark.cli", "dspark.train", "dspark.simulate")
FORMATS_MUST_NOT = ("dspark.runtime", "dspark.measure", "dspark.report", "dspark.spec", "dspark.compiler",
                    "dspark.cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`, which annotations read and nothing loads."""
    guards = ("TYPE_CHECKING", "typing.TYPE_CHECKING")
    return {id(child) for node in ast.walk(tree)
            if isinstance(node, ast.If) and ast.unparse(node.test) in guards
            for stmt in node.body for child in ast.walk(stmt)}


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import in the file, nested ones too
    (but not the type-checking-only ones)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree)
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((base, [alias.name for alias in node.names], node.lineno))
    return out


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


SOURCES = sorted(PACKAGE.rglob("*.py"))


def violations(layer: tuple[str, ...], forbidden: tuple[str, ...], exempt: tuple[str, ...] = ()) -> list[str]:
    return [f"{path.relative_to(REPO)}:{line}: imports {module}"
            for path in SOURCES
            if within(module_name(path), layer) and not within(module_name(path), exempt)
            for module, names, line in imports(path)
            if within(module, forbidden) or any(within(f"{module}.{n}", forbidden) for n in names)]


def test_light_layers_import_nothing_heavy() -> None:
    bad = violations(LIGHT, HEAVY, exempt=TORCH_FORMATS)
    assert not bad, "\n".join(bad)


def test_runtime_imports_neither_compiler_nor_the_tools_built_on_it() -> None:
    bad = violations(("dspark.runtime",), RUNTIME_MUST_NOT)
    assert not bad, "\n".join(bad)


def test_formats_stand_alone() -> None:
    bad = violations(("dspark.formats",), FORMATS_MUST_NOT)
    assert not bad, "\n".join(bad)


def test_no_module_imports_another_modules_private_names() -> None:
    bad = []
    for path in SOURCES:
        for module, names, line in imports(path):
            if not within(module, ("dspark",)):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            private_module = any(p.startswith("_") and not p.startswith("__") for p in module.split("."))
            if private or private_module:
                bad.append(f"{path.relative_to(REPO)}:{line}: from {module} import {', '.join(names)}")
    assert not bad, "\n".join(bad)


def test_no_private_attribute_of_an_imported_module_is_used() -> None:
    bad = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        aliases = {alias.asname or alias.name.split(".")[0]
                   for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)
                   for alias in node.names
                   if (getattr(node, "module", None) or alias.name).startswith("dspark")
                   or getattr(node, "level", 0)}
        for node in ast.walk(tree):
            private = node.attr.startswith("_") and not node.attr.startswith("__") if isinstance(
                node, ast.Attribute) else False
            if private and isinstance(node.value, ast.Name) and node.value.id in aliases:
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_compiling_every_spec_loads_no_torch() -> None:
    code = ("import sys, pathlib\n"
            "from dspark.compiler import compile_spec\n"
            "for spec in sorted(pathlib.Path('specs').glob('*.yaml')):\n"
            "    compile_spec(spec)\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')\n"
            "               or m.startswith(('dspark.runtime', 'dspark.measure', 'dspark.report')))\n"
            "print(heavy)\n"
            "sys.exit(1 if heavy else 0)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
