"""A corpus of bad specs (tests/spec_corpus/*.yaml, one defect each): every one is refused by the CLI
with exit status 2 and a located `file:line:col: field.path: message` report, with bounded work (a count
of function calls, not a wall time), no traceback and nothing written.

Each spec states its expectation in a header comment, `# expect: FIELD.PATH @ LINE[:COLUMN]`, next to
the defect it describes; JSON tables and checkpoint configs the specs name live beside them.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from dspark.cli.compile import main
from dspark.spec.loader import display_path

from .bounded_work import count_calls

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "spec_corpus"
_EXPECT = re.compile(r"^# expect: (?P<path>\S+) @ (?P<line>\d+)(?::(?P<column>\d+))?$", re.MULTILINE)

# Every class of defect the corpus must keep covering (file name prefix -> at least this many specs).
CLASSES = {"attention_": 3, "nonfinite_": 8, "yaml_": 15, "tiers_": 6, "context_": 2, "dp_attention_": 1,
           "kv_pool_": 1, "type_": 8, "file_": 10, "config_": 8,
           "draft_": 2}
# Function calls one refusal may make. The largest, the bounded alias expansions, take about 350 000; an
# unbounded one (a billion values, a 10^18-request coverage proof) would take billions.
MAX_CALLS = 1_000_000


@dataclass(frozen=True)
class Expectation:
    spec: Path
    path: str
    line: int
    column: int | None

    @property
    def located(self) -> re.Pattern[str]:
        column = str(self.column) if self.column is not None else r"\d+"
        return re.compile(re.escape(f"{display_path(self.spec)}:{self.line}:") + column
                          + re.escape(f": {self.path}: "))


def expectation(spec: Path) -> Expectation:
    header = spec.read_bytes()[:400].decode("ascii", errors="replace")  # a corpus spec may not be UTF-8
    found = _EXPECT.search(header)
    assert found, f"{spec.name} has no `# expect: FIELD @ LINE` header"
    column = found["column"]
    return Expectation(spec, found["path"], int(found["line"]), int(column) if column else None)


SPECS = sorted(CORPUS.glob("*.yaml"))


@pytest.fixture(autouse=True)
def _digest_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def warm() -> None:
    """Import and build the validators once, so each counted run measures the spec, not start-up."""
    with contextlib.redirect_stderr(io.StringIO()):
        main(["build", str(SPECS[0]), "-o", "/nonexistent/never-written"])


def test_the_corpus_covers_every_class():
    assert len(SPECS) >= 40
    for prefix, least in CLASSES.items():
        assert len([s for s in SPECS if s.name.startswith(prefix)]) >= least, prefix


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.stem)
def test_bad_spec_is_refused_with_a_located_report(spec, tmp_path, warm, capsys):
    expected = expectation(spec)
    out = tmp_path / "out"
    status, calls = count_calls(lambda: main(["build", str(spec), "-o", str(out / "pkg")]))
    err = capsys.readouterr().err
    assert status == 2, err
    assert expected.located.search(err), f"expected {expected.path} at line {expected.line}:\n{err}"
    assert "hint: " in err
    assert "Traceback" not in err
    assert not out.exists()
    assert calls < MAX_CALLS, f"{spec.name} took {calls} function calls"


@pytest.mark.parametrize("name", ["yaml_billion_laughs", "yaml_tag_python", "nonfinite_cost_file_nan",
                                  "file_not_utf8_spec", "tiers_compact_unreachable"])
def test_bad_spec_is_refused_by_the_installed_command(name, tmp_path):
    spec = CORPUS / f"{name}.yaml"
    expected = expectation(spec)
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "dspark.cli.compile", "build", str(spec), "-o", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={"DSPARK_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2, result.stderr
    assert expected.located.search(result.stderr), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not out.exists()


@pytest.mark.parametrize("command", [["check", "--specs", "SPECDIR"], ["diff", "SPEC", "SPEC"],
                                     ["export-sglang", "SPEC"], ["graph", "SPEC"],
                                     ["explain", "SPEC", "deployment.py"]], ids=lambda c: c[0])
def test_every_command_refuses_a_bad_spec_the_same_way(command, tmp_path, warm, capsys, monkeypatch):
    spec = CORPUS / "nonfinite_inline_table.yaml"
    specs_dir = tmp_path / "specs"
    specs_dir.mkdir()
    (specs_dir / spec.name).write_bytes(spec.read_bytes())
    monkeypatch.chdir(tmp_path)
    argv = [str(spec) if arg == "SPEC" else str(specs_dir) if arg == "SPECDIR" else arg for arg in command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cost_model.sample_steps_per_sec[1]: " in err and "Traceback" not in err
    assert {p.name for p in tmp_path.iterdir()} <= {"cache", "specs"}  # no generated/ or package
