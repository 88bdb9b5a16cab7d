"""The compile graph: structure, Merkle hashes, and `explain`."""

from __future__ import annotations

import networkx as nx
import pytest

from dspark.cli.compile import main
from dspark.compiler import compile_spec
from dspark.compiler.explain import dependent_fields, explain_file
from dspark.compiler.graph import build_graph
from dspark.spec import load_spec

SECTIONS = {"spec.name", "spec.model", "spec.draft", "spec.parallelism", "spec.backend",
            "spec.verify", "spec.graph", "spec.cost_model", "spec.calibration", "spec.serving"}
DERIVED = {"model_geometry", "parallel_plan", "tier_grid", "planner_config", "backend_metadata",
           "graph_capture", "deployment", "runtime_entry", "manifest"}


def test_nodes_edges_and_files(write_spec):
    graph = build_graph(load_spec(write_spec()))
    assert set(graph) == SECTIONS | DERIVED
    assert nx.is_directed_acyclic_graph(graph)
    assert graph.has_edge("spec.model", "model_geometry")
    assert graph.has_edge("model_geometry", "parallel_plan")
    assert graph.has_edge("spec.graph", "tier_grid")
    assert graph.has_edge("tier_grid", "graph_capture")
    assert graph.has_edge("spec.cost_model", "planner_config")
    assert not graph.has_edge("spec.cost_model", "deployment")
    files = {f for _, data in graph.nodes(data=True) for f in data.get("files", ())}
    assert files == {"__init__.py", "__main__.py", "deployment.py", "planner_config.py",
                     "attn_metadata.py", "graph_runner.py", "manifest.json"}
    assert graph.nodes["backend_metadata"]["files"] == ("attn_metadata.py",)
    assert "draft.gamma" in graph.nodes["spec.draft"]["fields"]
    assert "serving.generation.top_k" in graph.nodes["spec.serving"]["fields"]
    assert all(len(data["hash"]) == 64 for _, data in graph.nodes(data=True))


@pytest.mark.parametrize(("overrides", "section"), [
    ({"graph": {"enabled": True, "capture_batch_sizes": [1, 8, 32]}}, "spec.graph"),
    ({"serving": {"generation": {"top_k": 5}}}, "spec.serving"),
    ({"calibration": {"temperatures": [1.0, 1.1, 1.2]}}, "spec.calibration"),
    ({"parallelism": {"tp": 2}}, "spec.parallelism"),
    ({"model": {"dtype": "bfloat16"}}, "spec.model"),
])
def test_a_field_change_changes_exactly_the_downstream_hashes(write_spec, overrides, section):
    before = build_graph(load_spec(write_spec()))
    after = build_graph(load_spec(write_spec(overrides, name="changed.yaml")))
    changed = {n for n in before if before.nodes[n]["hash"] != after.nodes[n]["hash"]}
    assert changed == {section} | nx.descendants(before, section)


def test_hashes_ignore_spec_formatting(write_spec):
    plain = build_graph(load_spec(write_spec()))
    text = write_spec().read_text()
    commented = build_graph(load_spec(write_spec(text="# a comment\n" + text, name="c.yaml")))
    assert {n: d["hash"] for n, d in plain.nodes(data=True)} == {
        n: d["hash"] for n, d in commented.nodes(data=True)}


def test_explain_lists_upstream_fields_with_lines(write_spec):
    package = compile_spec(write_spec({"graph": {"enabled": True, "capture_batch_sizes": [32]}}))
    fields = dict(dependent_fields(package.resolved, package.graph, "graph_capture"))
    assert fields["graph.capture_batch_sizes"] == [32]
    assert fields["draft.gamma"] == 3
    assert "cost_model" not in fields and "model.dtype" not in fields
    text = explain_file(package.resolved, package.graph, "graph_runner.py")
    line = package.resolved.line_of("graph.capture_batch_sizes")
    assert "graph.capture_batch_sizes = [32]  (" in text and f":{line}:" in text
    assert "serving.page_size = 16  (default)" in text
    assert "derived: tier_grid" in text


def test_explain_of_an_unknown_file_fails(write_spec, capsys):
    assert main(["explain", str(write_spec()), "nope.py"]) == 1
    assert "generated files:" in capsys.readouterr().err


def test_graph_command_text_and_dot(write_spec, capsys):
    spec = str(write_spec())
    assert main(["graph", spec]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert len(lines) == len(SECTIONS | DERIVED)
    order = [line.split()[0] for line in lines]
    assert order.index("tier_grid") < order.index("graph_capture") < order.index("manifest")
    assert "<- spec.graph, spec.draft" not in text and "<- spec.draft, spec.graph" in text
    assert main(["graph", spec, "--dot"]) == 0
    dot = capsys.readouterr().out
    assert dot.startswith("digraph dspark {") and '"tier_grid" -> "graph_capture";' in dot
