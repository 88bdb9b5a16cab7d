"""`dspark-compile explain`: which spec fields a generated file depends on, and where they are."""

from __future__ import annotations

from typing import Any

import networkx as nx

from dspark.compiler.graph import node_for_file, spec_inputs
from dspark.spec import ResolvedSpec


def explain_file(resolved: ResolvedSpec, graph: nx.DiGraph, file: str) -> str:
    node = node_for_file(graph, file.replace("\\", "/").rsplit("/", 1)[-1])
    lines = [f"{file} is rendered by graph node {node} "
             f"(hash {graph.nodes[node]['hash'][:12]}) from:"]
    derived = sorted(n for n in nx.ancestors(graph, node) if graph.nodes[n]["kind"] != "spec")
    if derived:
        lines.append(f"  derived: {', '.join(derived)}")
    for field, value in dependent_fields(resolved, graph, node):
        location = resolved.location_of(field)
        where = str(location) if location else "default"
        lines.append(f"  {field} = {value!r}  ({where})")
    return "\n".join(lines) + "\n"


def dependent_fields(resolved: ResolvedSpec, graph: nx.DiGraph, node: str
                     ) -> list[tuple[str, Any]]:
    """(dotted field path, value) for every spec field upstream of `node`."""
    dumped = resolved.spec.model_dump(mode="json")
    out = []
    for section in spec_inputs(graph, node):
        for field in graph.nodes[section]["fields"]:
            out.append((field, _lookup(dumped, field)))
    return out


def _lookup(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        data = data[part]
    return data
