"""Compiling a dsv4 (DeepSeek-V4) spec: the family's templates, the cache layout they are given, the
geometry deployment.py carries, the compile graph's inputs, determinism, and what export-sglang says."""

from __future__ import annotations

import ast
import runpy
from pathlib import Path

import pytest

from dspark.backends import ATTENTION_BY_BACKEND, family_attention
from dspark.cli.compile import main
from dspark.compiler import build, compile_spec
from dspark.compiler.context import ATTENTION_BACKENDS, DSV4_ATTENTION_BACKENDS, template_context
from dspark.compiler.graph import build_graph
from dspark.compiler.nodes import DERIVED
from dspark.families import DENSE_ATTENTION, DSV4_ATTENTION
from dspark.fingerprint import fingerprint_of_deployment, fingerprint_of_spec
from dspark.formats.dsv4_config import dsv4_cache_layout
from dspark.spec import load_spec
from dspark.spec.loader import display_path

from .test_spec_dsv4 import ASCEND_RATIOS, DSV4_GEOMETRY, EXPECTED, dsv4_spec_writer, line_of

ASCEND = {"backend": {"kind": "ascend", "device": "910c"}, **ASCEND_RATIOS}
ASCEND_GRAPHS = {**ASCEND, "graph": {"enabled": True, "capture_batch_sizes": [1, 2, 4, 8, 16, 32]}}
CUDA_GRAPHS = {"backend": {"kind": "cuda", "device": "h200"},
               "graph": {"enabled": True, "capture_batch_sizes": [1, 2, 4, 8, 16, 32]}}


@pytest.fixture
def dsv4_spec(write_spec):
    return dsv4_spec_writer(write_spec)


def templates(spec: Path) -> dict[str, str]:
    """Each generated file's template."""
    resolved = load_spec(spec)
    return {file: template for node in DERIVED if node.templates
            for file, template in node.templates(resolved).items()}


def deployment_of(package, tmp_path: Path):
    path = tmp_path / "deployment.py"
    path.write_bytes(package.files["deployment.py"])
    return runpy.run_path(str(path))["DEPLOYMENT"]


def test_a_tiny_dsv4_spec_compiles(dsv4_spec, tmp_path):
    package = compile_spec(dsv4_spec(), tmp_path / "out" / "demo")
    for name, data in package.files.items():
        if name.endswith(".py"):
            ast.parse(data)
    source = package.files["deployment.py"].decode()
    assert "    Dsv4Geometry,\n" in source and "geometry=Dsv4Geometry(\n" in source
    assert "ModelGeometry" not in source
    assert "            compress_ratios=(0, 4, 16, 4),\n" in source
    deployment = deployment_of(package, tmp_path)
    assert deployment.model.family == "dsv4" and deployment.model.geometry == EXPECTED
    assert deployment.attention == "torch" and deployment.model.load_format == "dummy"


def test_the_runtime_and_the_spec_fingerprint_a_dsv4_deployment_alike(dsv4_spec, tmp_path):
    for overrides in ({}, ASCEND):
        resolved = load_spec(dsv4_spec(overrides))
        package = compile_spec(resolved.source, tmp_path / "out" / "demo")
        deployment = deployment_of(package, tmp_path)
        assert fingerprint_of_deployment(deployment, resolved.tiers) == fingerprint_of_spec(resolved)
        # the family's default attention keeps the bare backend, as the dense families' does
        assert fingerprint_of_spec(resolved).backend == resolved.spec.backend.kind


@pytest.mark.parametrize(("overrides", "metadata", "runner"), [
    ({}, "dsv4/attn_metadata.py.j2", "eager/graph_runner.py.j2"),
    (ASCEND, "dsv4/attn_metadata.py.j2", "eager/graph_runner.py.j2"),
    (ASCEND_GRAPHS, "dsv4/attn_metadata.py.j2", "dsv4/ascend/graph_runner.py.j2"),
    (CUDA_GRAPHS, "dsv4/attn_metadata.py.j2", "dsv4/cuda/graph_runner.py.j2"),
])
def test_the_family_picks_the_templates(dsv4_spec, overrides, metadata, runner):
    chosen = templates(dsv4_spec(overrides))
    assert chosen["attn_metadata.py"] == metadata and chosen["graph_runner.py"] == runner
    assert chosen["deployment.py"] == "deployment.py.j2"


def test_the_eager_runner_imports_the_dsv4_attention(dsv4_spec):
    for overrides, module, cls in (({}, "dspark.runtime.families.dsv4.cpu_attention", "Dsv4PagedAttention"),
                                   (ASCEND, "dspark.runtime.families.dsv4.ascend_layers",
                                    "Dsv4AscendLayers")):
        runner = compile_spec(dsv4_spec(overrides)).files["graph_runner.py"].decode()
        assert f"\nfrom {module} import {cls}\n" in runner


def test_every_attention_runs_a_family_and_has_its_code():
    named = {attention for names in ATTENTION_BY_BACKEND.values() for attention in names}
    assert named == DENSE_ATTENTION | DSV4_ATTENTION
    assert set(ATTENTION_BACKENDS) == DENSE_ATTENTION and set(DSV4_ATTENTION_BACKENDS) == DSV4_ATTENTION
    assert ATTENTION_BY_BACKEND["ascend"][0] == "fused_infer_attention"  # the dense families' default
    assert family_attention("ascend", "dsv4") == ("sparse_attn_sharedkv",)
    assert family_attention("cuda", "dsv4") == ("triton",)


def test_dense_specs_keep_their_templates(write_spec):
    chosen = templates(write_spec())
    assert chosen["deployment.py"] == "deployment.py.j2"
    assert chosen["graph_runner.py"] == "eager/graph_runner.py.j2"
    assert chosen["attn_metadata.py"] == "cpu/attn_metadata.py.j2"


def test_the_templates_get_the_cache_layout(dsv4_spec, write_spec, tmp_path):
    resolved = load_spec(dsv4_spec({"serving": {"chunked_prefill_tokens": 4096}}))
    context = template_context(resolved, tmp_path)
    # a prefill chunk runs at most a whole context's rows of one request
    assert context["dsv4_layout"] == dsv4_cache_layout(EXPECTED, 4, 16, prefill_rows=1024)
    assert context["model_family"] == "dsv4" and context["geometry_class"] == "Dsv4Geometry"
    assert "            compress_ratios=(0, 4, 16, 4)," in context["geometry_fields"].splitlines()
    resolved = load_spec(dsv4_spec({"serving": {"chunked_prefill_tokens": 64}}))
    assert template_context(resolved, tmp_path)["dsv4_layout"].max_rows_per_request >= 64
    dense = template_context(load_spec(write_spec()), tmp_path)
    assert dense["dsv4_layout"] is None and dense["model_family"] == "llama"


def test_the_attention_files_read_the_model(dsv4_spec, write_spec):
    graph = build_graph(load_spec(dsv4_spec()))
    for node in ("backend_metadata", "graph_capture"):
        assert graph.has_edge("spec.model", node) and graph.has_edge("model_geometry", node)
    dense = build_graph(load_spec(write_spec()))
    assert not dense.has_edge("spec.model", "backend_metadata")
    # a geometry change reaches the attention metadata (its cache layout) and nothing it does not feed
    before = build_graph(load_spec(dsv4_spec()))
    after = build_graph(load_spec(dsv4_spec(geometry={**DSV4_GEOMETRY, "window": 32}, name="w.yaml")))
    changed = {n for n in before if before.nodes[n]["hash"] != after.nodes[n]["hash"]}
    assert {"backend_metadata", "graph_capture", "deployment"} <= changed
    assert "planner_config" not in changed


def test_the_parallel_plan_replicates_the_latent_kv_head(dsv4_spec):
    graph = build_graph(load_spec(dsv4_spec({"parallelism": {"tp": 2}})))
    plan = graph.nodes["parallel_plan"]["value"]
    assert (plan["heads_per_rank"], plan["kv_heads_per_rank"]) == (2, 1)


def test_a_dsv4_package_is_deterministic_and_checks(dsv4_spec, tmp_path, capsys):
    specs = tmp_path / "specs"
    specs.mkdir()
    spec = dsv4_spec(ASCEND_GRAPHS | {"verify": {"mode": "compact", "allow_no_cost_model": True}},
                     name="specs/demo.yaml")
    first = compile_spec(spec, tmp_path / "generated" / "demo").files
    assert compile_spec(spec, tmp_path / "generated" / "demo").files == first
    build(spec, tmp_path / "generated" / "demo")
    assert main(["check", "--specs", str(specs), "--generated", str(tmp_path / "generated")]) == 0
    assert "generated matches" in capsys.readouterr().out


def test_export_sglang_refuses_dsv4_at_the_family(dsv4_spec, capsys):
    spec = dsv4_spec()
    assert main(["export-sglang", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{display_path(spec)}:{line_of(spec, 'family: dsv4')}:")
    assert "model.family: export-sglang does not cover the dsv4 family" in err
    assert "dense families (llama, qwen3)" in err and "Traceback" not in err
