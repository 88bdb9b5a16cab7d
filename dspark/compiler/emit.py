"""Render a resolved spec into the files of its generated package, entirely in memory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import networkx as nx

from dspark.compiler.context import template_context
from dspark.compiler.graph import build_graph
from dspark.compiler.manifest import manifest_bytes
from dspark.compiler.nodes import DERIVED, MANIFEST_FILE
from dspark.compiler.templates import environment
from dspark.spec import ResolvedSpec


@dataclass(frozen=True)
class CompiledPackage:
    """A spec compiled for `package_dir`: the graph and every file's exact bytes."""

    resolved: ResolvedSpec
    graph: nx.DiGraph
    package_dir: Path
    files: dict[str, bytes]  # file name inside the package -> content


def render_package(resolved: ResolvedSpec, package_dir: Path) -> CompiledPackage:
    """`package_dir` is where the package will live; relative checkpoints are stored against it."""
    graph = build_graph(resolved)
    context = template_context(resolved, package_dir)
    env = environment()
    files: dict[str, bytes] = {}
    for node in DERIVED:
        for file, template in (node.templates(resolved) if node.templates else {}).items():
            files[file] = env.get_template(template).render(context).encode("utf-8")
    files[MANIFEST_FILE] = manifest_bytes(resolved, graph, files)
    return CompiledPackage(resolved, graph, package_dir, dict(sorted(files.items())))
