"""Build the compile graph: one content-hashed node per spec section and derived artifact."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import networkx as nx

from dspark.compiler.nodes import (
    DERIVED,
    FILE_NODES,
    MANIFEST_FILE,
    SPEC_SECTIONS,
    section_fields,
    section_value,
)
from dspark.compiler.templates import template_sha256
from dspark.spec import ResolvedSpec


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)


def build_graph(resolved: ResolvedSpec) -> nx.DiGraph:
    """Nodes carry `kind` (spec | derived | file), `value`, `hash`, and `fields` (spec nodes) or
    `files` (nodes that emit files). A hash covers the node's value and its inputs' hashes."""
    graph = nx.DiGraph()
    for section in SPEC_SECTIONS:
        graph.add_node(f"spec.{section}", kind="spec", value=section_value(resolved, section),
                       fields=section_fields(resolved, section))
    for node in DERIVED:
        value = node.value(resolved)
        if node.templates:
            templates = sorted(node.templates(resolved).values())
            value = {"value": value, "templates": {t: template_sha256(t) for t in templates}}
        graph.add_node(node.id, kind="file" if node.files else "derived", value=value, files=node.files)
        graph.add_edges_from((source, node.id) for source in node.inputs_of(resolved))
    graph.add_node("manifest", kind="file", value=None, files=(MANIFEST_FILE,))
    graph.add_edges_from((source, "manifest") for source in FILE_NODES)
    for node_id in nx.lexicographical_topological_sort(graph):
        inputs = sorted(graph.predecessors(node_id))
        payload = {"node": node_id, "value": graph.nodes[node_id]["value"],
                   "inputs": {source: graph.nodes[source]["hash"] for source in inputs}}
        graph.nodes[node_id]["hash"] = hashlib.sha256(
            canonical_json(payload).encode("ascii")).hexdigest()
    return graph


def ordered_nodes(graph: nx.DiGraph) -> list[str]:
    return list(nx.lexicographical_topological_sort(graph))


def node_for_file(graph: nx.DiGraph, file: str) -> str:
    for node_id, data in graph.nodes(data=True):
        if file in data.get("files", ()):
            return node_id
    known = sorted(f for _, data in graph.nodes(data=True) for f in data.get("files", ()))
    raise KeyError(f"{file!r} is not a generated file; generated files: {', '.join(known)}")


def spec_inputs(graph: nx.DiGraph, node_id: str) -> list[str]:
    """Spec-section nodes that `node_id` depends on, directly or through derived nodes."""
    return sorted(n for n in nx.ancestors(graph, node_id) if graph.nodes[n]["kind"] == "spec")


def node_link(graph: nx.DiGraph) -> dict[str, Any]:
    """The graph as deterministic node-link JSON (values left out: hashes stand for them)."""
    nodes = []
    for node_id in ordered_nodes(graph):
        data = graph.nodes[node_id]
        entry: dict[str, Any] = {"id": node_id, "kind": data["kind"], "hash": data["hash"]}
        if data["kind"] == "spec":
            entry["fields"] = list(data["fields"])
        if data.get("files"):
            entry["files"] = list(data["files"])
        nodes.append(entry)
    edges = [{"source": s, "target": t} for s, t in sorted(graph.edges())]
    return {"directed": True, "multigraph": False, "graph": {}, "nodes": nodes, "edges": edges}


def render_text(graph: nx.DiGraph) -> str:
    width = max(len(node_id) for node_id in graph)
    lines = []
    for node_id in ordered_nodes(graph):
        data = graph.nodes[node_id]
        inputs = ", ".join(sorted(graph.predecessors(node_id))) or "-"
        files = f"  -> {', '.join(data['files'])}" if data.get("files") else ""
        lines.append(f"{node_id:<{width}}  {data['hash'][:12]}  <- {inputs}{files}")
    return "\n".join(lines) + "\n"


def render_dot(graph: nx.DiGraph) -> str:
    shapes = {"spec": "box", "derived": "ellipse", "file": "note"}
    lines = ["digraph dspark {", "  rankdir=LR;"]
    for node_id in ordered_nodes(graph):
        data = graph.nodes[node_id]
        label = "\\n".join([node_id, data["hash"][:12], *data.get("files", ())])
        lines.append(f'  "{node_id}" [shape={shapes[data["kind"]]}, label="{label}"];')
    lines += [f'  "{s}" -> "{t}";' for s, t in sorted(graph.edges())]
    lines.append("}")
    return "\n".join(lines) + "\n"
