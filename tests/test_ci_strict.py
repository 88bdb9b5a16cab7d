"""In CI a missing test dependency fails the run (tests/ci_strict.py): small test files run by pytest in a
subprocess, with and without `CI=true`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from . import conftest
from .ci_strict import (
    extra_requirements,
    missing_modules,
    module_of,
    pytest_make_collect_report,
    pytest_runtest_makereport,
    pytest_sessionstart,
)

REPO = Path(__file__).resolve().parents[1]
SKIPS = '''
import pytest

def test_needs_a_gpu():
    pytest.skip("needs a CUDA GPU")

@pytest.mark.skipif(True, reason="needs an Ascend NPU (torch_npu)")
def test_needs_an_npu():
    pass

def test_needs_an_emulator():
    pytest.skip("needs qemu-aarch64")

def test_needs_triton():
    pytest.skip("Triton is not installed")

@pytest.mark.xfail(reason="a known failure, not a skip")
def test_expected_failure():
    raise AssertionError
'''
IMPORTORSKIP = '''
import pytest

pytest.importorskip("dspark_no_such_module")

def test_never_collected():
    pass
'''


def run_pytest(directory: Path, ci: bool) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CI": "true" if ci else "false", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.ci_strict", "-p", "no:cacheprovider",
                           "-rA", "--rootdir", str(directory), str(directory)],
                          cwd=directory, env=env, capture_output=True, text=True, timeout=300)


def test_the_suite_installs_the_hooks() -> None:
    assert conftest.pytest_sessionstart is pytest_sessionstart
    assert conftest.pytest_runtest_makereport is pytest_runtest_makereport
    assert conftest.pytest_make_collect_report is pytest_make_collect_report


def test_the_checked_modules_are_the_test_extra() -> None:
    modules = [module_of(r) for r in extra_requirements()]
    assert {"transformers", "openai", "triton", "hypothesis", "pytest"} <= set(modules)
    assert module_of("triton==3.7.1") == "triton" and module_of("flashinfer-python") == "flashinfer_python"
    (missing,) = missing_modules(["pytest", "dspark_no_such_module"])
    assert missing.startswith("dspark_no_such_module (ModuleNotFoundError")


def test_a_missing_module_skips_locally_and_fails_in_ci(tmp_path: Path) -> None:
    (tmp_path / "test_importorskip.py").write_text(IMPORTORSKIP)
    (tmp_path / "test_other.py").write_text("def test_passes():\n    pass\n")
    local = run_pytest(tmp_path, ci=False)
    assert local.returncode == 0, local.stdout
    assert "1 passed, 1 skipped" in local.stdout
    ci = run_pytest(tmp_path, ci=True)
    assert ci.returncode != 0, ci.stdout
    assert "skipped in CI" in ci.stdout and "dspark_no_such_module" in ci.stdout
    assert "1 error" in ci.stdout  # the module's collection failed


def test_in_ci_only_hardware_skips_stay_skips(tmp_path: Path) -> None:
    (tmp_path / "test_skips.py").write_text(SKIPS)
    local = run_pytest(tmp_path, ci=False)
    assert local.returncode == 0, local.stdout
    assert "4 skipped, 1 xfailed" in local.stdout
    ci = run_pytest(tmp_path, ci=True)
    assert ci.returncode == 1, ci.stdout
    assert "1 failed, 3 skipped, 1 xfailed" in ci.stdout
    assert "FAILED test_skips.py::test_needs_triton" in ci.stdout
    assert "Triton is not installed" in ci.stdout


def test_in_ci_a_test_dependency_that_does_not_import_stops_the_session(tmp_path: Path) -> None:
    # openai made unimportable for the run: a conftest that blocks it loads before the session starts
    (tmp_path / "conftest.py").write_text("import sys\nsys.modules['openai'] = None\n")
    (tmp_path / "test_nothing.py").write_text("def test_passes():\n    pass\n")
    assert run_pytest(tmp_path, ci=False).returncode == 0
    ci = run_pytest(tmp_path, ci=True)
    assert ci.returncode == 4, ci.stdout + ci.stderr
    out = ci.stdout + ci.stderr
    assert "test dependencies do not import: openai (" in out and "test_passes" not in out
