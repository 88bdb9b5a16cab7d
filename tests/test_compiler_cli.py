"""`dspark-compile` commands: build, check, diff, export-sglang, stale tables, overwrite protection,
atomicity, speed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark.cli.compile import main
from dspark.compiler import compile_spec, emit, write

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def project(tmp_path, write_spec, monkeypatch):
    """A scratch project (specs/ + generated/) built once; the cwd is its root."""
    (tmp_path / "pyproject.toml").touch()
    (tmp_path / "specs").mkdir()
    shutil.move(write_spec(), tmp_path / "specs" / "demo.yaml")
    monkeypatch.chdir(tmp_path)
    assert main(["build", "specs/demo.yaml"]) == 0
    return tmp_path


def test_build_writes_the_package_and_generated_init(project):
    package = project / "generated" / "demo"
    assert (package / "deployment.py").is_file() and (package / "manifest.json").is_file()
    assert (project / "generated" / "__init__.py").read_text().startswith('"""')
    assert not [p for p in (project / "generated").iterdir() if p.name.startswith(".")]


def test_build_reports_spec_errors_with_exit_2(project, capsys):
    spec = project / "specs" / "demo.yaml"
    spec.write_text(spec.read_text().replace("gamma: 3", "gamma: -1"))
    assert main(["build", "specs/demo.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specs/demo.yaml:") and "draft.gamma" in err and "hint:" in err


def test_repository_generated_packages_are_up_to_date(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert main(["check"]) == 0, capsys.readouterr()


def test_check_passes_then_fails_with_a_diff_after_a_change(project, capsys):
    assert main(["check"]) == 0
    spec = project / "specs" / "demo.yaml"
    spec.write_text(spec.read_text().replace("gamma: 3", "gamma: 4"))
    capsys.readouterr()
    assert main(["check"]) == 1
    out = capsys.readouterr().out
    assert "--- generated/demo/attn_metadata.py" in out
    assert "-NUM_DRAFT_TOKENS = 4 " in out and "+NUM_DRAFT_TOKENS = 5 " in out


def test_check_reports_missing_and_extra_files(project, capsys):
    package = project / "generated" / "demo"
    (package / "graph_runner.py").unlink()
    (package / "stray.py").write_text("x = 1\n")
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "deployment.cpython-311.pyc").write_bytes(b"\0")
    assert main(["check"]) == 1
    out = capsys.readouterr().out
    assert "--- /dev/null\n+++ generated/demo/graph_runner.py" in out
    assert "--- generated/demo/stray.py\n+++ /dev/null" in out
    assert "__pycache__" not in out


def test_check_reports_packages_without_a_spec(project, capsys):
    shutil.copytree(project / "generated" / "demo", project / "generated" / "old")
    assert main(["check"]) == 1
    assert "generated/old: no spec" in capsys.readouterr().out


def test_diff_between_two_specs(project, write_spec, capsys):
    other = write_spec({"serving": {"page_size": 32}}, name="other.yaml")
    assert main(["diff", "specs/demo.yaml", str(other)]) == 1
    out = capsys.readouterr().out
    assert "--- a/demo/attn_metadata.py\n+++ b/demo/attn_metadata.py" in out
    assert "-PAGE_SIZE = 16\n+PAGE_SIZE = 32" in out
    assert main(["diff", "specs/demo.yaml", "specs/demo.yaml"]) == 0
    assert capsys.readouterr().out == ""


def test_hand_edits_are_not_overwritten_without_force(project, capsys):
    target = project / "generated" / "demo" / "deployment.py"
    target.write_text(target.read_text() + "# tweak\n")
    assert main(["build", "specs/demo.yaml"]) == 1
    err = capsys.readouterr().err
    assert "generated/demo/deployment.py" in err and "--force" in err
    assert target.read_text().endswith("# tweak\n")
    assert main(["build", "specs/demo.yaml", "--force"]) == 0
    assert not target.read_text().endswith("# tweak\n")


def test_unknown_files_and_caches(project):
    package = project / "generated" / "demo"
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert main(["build", "specs/demo.yaml"]) == 0  # byte-code is not a hand edit
    (package / "notes.txt").write_text("mine")
    assert main(["build", "specs/demo.yaml"]) == 1
    assert (package / "notes.txt").exists()


def test_a_failing_render_writes_nothing(project, monkeypatch):
    out = project / "fresh" / "demo"

    def broken_context(resolved, package_dir):
        return {**real_context(resolved, package_dir), "N": object()}

    real_context = emit.template_context
    monkeypatch.setattr(emit, "template_context", broken_context)
    with pytest.raises(TypeError):
        main(["build", "specs/demo.yaml", "-o", str(out)])
    assert not (project / "fresh").exists()


def test_a_failing_write_leaves_the_old_package(project, monkeypatch):
    package = project / "generated" / "demo"
    before = {p.name: p.read_bytes() for p in package.iterdir()}
    spec = project / "specs" / "demo.yaml"
    spec.write_text(spec.read_text().replace("gamma: 3", "gamma: 4"))

    def exploding_swap(staging, target):
        raise OSError("disk full")

    monkeypatch.setattr(write, "_swap_in", exploding_swap)
    with pytest.raises(OSError):
        main(["build", "specs/demo.yaml"])
    assert {p.name: p.read_bytes() for p in package.iterdir()} == before
    assert sorted(p.name for p in (project / "generated").iterdir()) == ["__init__.py", "demo"]
    with pytest.raises(OSError):
        main(["build", "specs/demo.yaml", "-o", "elsewhere/demo"])
    assert list((project / "elsewhere").iterdir()) == []


def test_the_compiler_never_imports_torch(project):
    code = ("import sys\nfrom dspark.cli.compile import main\n"
            "assert main(['build', 'specs/demo.yaml', '-o', 'out/demo']) == 0\n"
            "assert main(['check']) == 0\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=project,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "dspark.cli.compile" in imported
    assert not {name for name in imported if name.split(".")[0] == "torch"}


def test_one_compile_is_fast(project):
    compile_spec("specs/demo.yaml")  # warm caches (templates, pydantic schemas)
    start = time.perf_counter()
    compile_spec("specs/demo.yaml")
    assert time.perf_counter() - start < 1.0


def _stale_cost_table(project) -> None:
    """Switch the demo spec to compact with a cost table measured on another device."""
    from dspark.fingerprint import fingerprint_of_spec
    from dspark.spec import load_spec

    spec = project / "specs" / "demo.yaml"
    spec.write_text(spec.read_text() + "verify:\n  mode: compact\n"
                    "cost_model:\n  type: sps-1d\n  file: cost.json\n")
    table = {"sample_batch_tokens": [4, 8], "sample_steps_per_sec": [100.0, 90.0], "max_batch_tokens": 8}
    (project / "specs" / "cost.json").write_text(json.dumps(table))
    measured = fingerprint_of_spec(load_spec(spec)).to_json()
    (project / "specs" / "cost.json").write_text(json.dumps({**table, "fingerprint": {
        **measured, "device": "h100"}}))


def test_stale_tables_fail_every_command_unless_allowed(project, write_spec, capsys):
    _stale_cost_table(project)
    other = write_spec({"serving": {"page_size": 32}}, name="other.yaml")
    for command in (["build", "specs/demo.yaml"], ["check"], ["diff", "specs/demo.yaml", str(other)],
                    ["export-sglang", "specs/demo.yaml"]):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert "specs/demo.yaml:" in err and "cost_model.file" in err, command
        assert "device: measured on 'h100' but the spec has 'generic'" in err, command
        assert "--allow-stale-tables" in err, command
        assert main([*command, "--allow-stale-tables"]) != 2, command
        capsys.readouterr()
    warning = "WARNING: compiled with --allow-stale-tables: cost_model.file 'cost.json' is stale (device)."
    package = project / "generated" / "demo"
    assert main(["build", "specs/demo.yaml", "--allow-stale-tables"]) == 0
    for name in ("deployment.py", "planner_config.py", "graph_runner.py"):
        text = (package / name).read_text()
        assert warning in " ".join(text.split()), name
        assert max(len(line) for line in text.splitlines()) <= 110, name  # wrapped for the lint
    assert "fingerprint" not in (package / "planner_config.py").read_text()
    assert main(["check", "--allow-stale-tables"]) == 0
    assert main(["export-sglang", "specs/demo.yaml", "--allow-stale-tables"]) == 0
    assert f"# {warning}" in capsys.readouterr().out


def _launch(argv: list[str], capsys) -> tuple[list[str], dict[str, str], list[str]]:
    """export-sglang output split into flag lines, exported variables and comment lines."""
    assert main(["export-sglang", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    env = dict(line.removeprefix("export ").split("=", 1) for line in lines if line.startswith("export "))
    flags = [line.strip().removesuffix(" \\") for line in lines if line.startswith("  --")]
    comments = [line for line in lines if line.startswith("#")]
    return flags, env, comments


def test_export_sglang_for_the_h200_compact_spec(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    flags, env, comments = _launch(["specs/llama31_8b_h200_compact.yaml"], capsys)
    assert env == {"SGLANG_RAGGED_VERIFY_MODE": "compact", "SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS": "1"}
    assert flags == [
        "--model-path /models/Meta-Llama-3.1-8B-Instruct", "--dtype bfloat16",
        "--speculative-algorithm DSPARK", "--speculative-draft-model-path /models/dspark-llama31-8b-draft",
        "--speculative-dspark-block-size 7", "--speculative-num-draft-tokens 8",
        "--tp-size 1", "--dp-size 1", "--max-running-requests 32", "--max-total-tokens 65536",
        "--page-size 16", "--context-length 8192",
        # SGLang's tiers are captured batch sizes x N: 8 .. 256, the spec's token_tiers exactly.
        "--cuda-graph-bs-decode 1 2 3 4 6 8 12 16 20 24 28 32"]
    assert any("no SGLang flag found for: verify.min_verify_len=1" in line for line in comments)
    assert any("no SGLang flag found for: backend.device=h200" in line for line in comments)
    assert any("flat table and verifies every row" in line for line in comments)  # allow_no_cost_model


def test_export_sglang_maps_tables_tiers_and_modes(write_spec, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    table = {"sample_batch_tokens": [4, 8], "sample_steps_per_sec": [100.0, 90.0], "max_batch_tokens": 64}
    (tmp_path / "cost.json").write_text(json.dumps(table))
    (tmp_path / "sts.json").write_text(json.dumps({"temperatures": [1.0, 1.1, 1.2]}))
    spec = write_spec({"verify": {"mode": "compact", "align_to_graph_tier": True, "lag_steps": 2},
                       "cost_model": {"type": "sps-1d", "file": "cost.json"},
                       "calibration": {"file": "sts.json"},
                       "graph": {"enabled": True, "token_tiers": [4, 6, 8, 16, 24, 40, 64, 128]},
                       "parallelism": {"dp": 2, "dp_attention": True},
                       "backend": {"kind": "ascend", "device": "910b"}})
    flags, env, comments = _launch([str(spec)], capsys)
    assert env["SGLANG_RAGGED_VERIFY_MODE"] == "compact"
    assert env["SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS"] == "2"
    n = 4  # gamma 3 + 1
    (graph,) = [flag for flag in flags if flag.startswith("--cuda-graph-bs-decode ")]
    buckets = {int(bs) * n for bs in graph.split()[1:]}
    extra = {int(t) for t in env["SGLANG_DSPARK_RAGGED_CAPTURE_TOKEN_BUCKETS"].split(",")}
    assert sorted(buckets | extra) == [4, 6, 8, 16, 24, 40, 64, 128]  # the spec's grid, no more
    for flag in ("--speculative-dspark-sps-table-path cost.json",
                 "--speculative-dspark-confidence-sts-path sts.json",
                 "--speculative-dspark-align-verify-tokens-to-graph-tier", "--dp-size 2",
                 "--enable-dp-attention", "--device npu", "--attention-backend ascend"):
        assert flag in flags, flag
    static, env, _ = _launch([str(write_spec({"graph": {"enabled": False}}, name="static.yaml"))], capsys)
    assert env == {"SGLANG_RAGGED_VERIFY_MODE": "static"}
    assert "--cuda-graph-backend-decode disabled" in static
