"""In CI (`CI=true`) a missing test dependency fails the run instead of skipping the tests that need it.

Locally a test that needs `transformers`, `openai` or `triton` may skip when the package is absent; in CI
such a skip would hide that the independent references never ran. So under `CI`:

- the session starts by importing every package of pyproject.toml's `test` extra and stops, naming the
  missing ones, when one does not import;
- a test or a module that skips fails instead, unless its reason names hardware the machine lacks: a GPU
  (CUDA), an NPU (Ascend, torch_npu) or an emulator (QEMU). An expected failure (xfail) is left alone.

`tests/conftest.py` installs these hooks for the suite; `tests/test_ci_strict.py` runs them on small test
files in a subprocess.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# A skip for want of hardware (CUDA GPU, Ascend NPU, an emulator) is the only skip CI allows.
HARDWARE = re.compile(r"\b(cuda|gpus?|npus?|torch_npu|ascend|qemu|emulators?)\b", re.IGNORECASE)
_TRUE = {"1", "true", "yes", "on"}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in _TRUE


def extra_requirements(pyproject: Path = PYPROJECT) -> list[str]:
    """The requirement strings of pyproject.toml's `[project.optional-dependencies] test`."""
    text = pyproject.read_text(encoding="utf-8")
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the one line the extra is written on
        found = re.search(r"^test\s*=\s*\[(.*?)\]", text, re.MULTILINE | re.DOTALL)
        assert found, f"{pyproject} has no `test` extra"
        return re.findall(r"\"([^\"]+)\"", found[1])
    return list(tomllib.loads(text)["project"]["optional-dependencies"]["test"])


def module_of(requirement: str) -> str:
    """The module a requirement installs, for the test extra's packages (`triton==3.7.1` → `triton`)."""
    found = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
    assert found, f"not a requirement: {requirement!r}"
    return found[0].lower().replace("-", "_")


def missing_modules(modules: Iterable[str]) -> list[str]:
    """Those of `modules` that do not import, each with why."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an ImportError, or a broken install failing on import
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
    return missing


def pytest_sessionstart(session: pytest.Session) -> None:
    if not in_ci():
        return
    missing = missing_modules(module_of(r) for r in extra_requirements())
    if missing:
        pytest.exit(f"CI is set and test dependencies do not import: {'; '.join(missing)}. Install the "
                    "test extra (pip install -e '.[test]'); in CI a missing test dependency fails the run "
                    "instead of skipping tests", returncode=pytest.ExitCode.USAGE_ERROR)


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fail_disallowed_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not (in_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if HARDWARE.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped in CI ({reason}); with CI set only a test that needs a GPU, an NPU or an "
                       "emulator may skip: install the missing test dependency")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    outcome = yield
    _fail_disallowed_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[Any]:
    """A module-level `pytest.importorskip` skips the module's collection, not a test."""
    outcome = yield
    _fail_disallowed_skip(outcome.get_result())
