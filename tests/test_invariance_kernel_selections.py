"""The row-invariance checks (tests/invariance_checks.py) under other CPU kernels than this process
runs: other ATen vector capabilities, MKL and oneDNN instruction sets, thread counts, and, where
Debian's qemu-user is installed, emulated CPU models. A construction that leaned on one kernel's
behaviour at some row counts would pass on the developer's machine and fail on another; here one run
sees several."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECKS = ["linear_rows", "lanewise", "paged_attention_rows", "block_draft_rows"]

# Each a separate process: the libraries read these once, when they load.
SELECTIONS = {
    "aten-default-1-thread": {"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"},
    "avx2-everywhere-2-threads": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                                  "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "2"},
    "sse4-blas-1-thread": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41",
                           "OMP_NUM_THREADS": "1"},
    "3-threads": {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"},
}


# ATen honours a capability the CPU lacks and dies of an illegal instruction, so AVX-512 is selected
# only where the CPU has it.
if "avx512f" in Path("/proc/cpuinfo").read_text(errors="replace").split():
    SELECTIONS["avx512-2-threads"] = {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
                                      "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "OMP_NUM_THREADS": "2"}


def _start(prefix: list[str], env: dict[str, str], checks: list[str]) -> subprocess.Popen[str]:
    full_env = {**os.environ, **env, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([*prefix, sys.executable, str(REPO / "tests" / "invariance_checks.py"), *checks],
                            cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str], env: dict[str, str], timeout: int) -> str:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, f"{env}: {out}{err[-3000:]}"
    return out


def _run(prefix: list[str], env: dict[str, str], checks: list[str], timeout: int) -> str:
    return _finish(_start(prefix, env, checks), env, timeout)


@pytest.mark.slow
def test_rows_are_invariant_under_other_kernel_selections() -> None:
    # The one-thread selections run side by side (two cores); the others one at a time.
    single = [name for name, env in SELECTIONS.items() if env.get("OMP_NUM_THREADS") == "1"]
    batches = [single, *([name] for name in SELECTIONS if name not in single)]
    seen = {}
    for batch in batches:
        procs = {name: _start([], SELECTIONS[name], CHECKS) for name in batch}
        for name, proc in procs.items():
            out = _finish(proc, SELECTIONS[name], timeout=600)
            seen[name] = out.splitlines()[0]
            assert all(f"ok {c}" in out for c in CHECKS), (name, out)
    # The selections took effect: ATen ran without vector code in one process and with AVX2 in another.
    assert seen["aten-default-1-thread"].startswith("cpu capability DEFAULT, 1 threads"), seen
    assert seen["avx2-everywhere-2-threads"].startswith("cpu capability AVX2, 2 threads"), seen


# CPU models of other makes and generations than the host's, as qemu emulates them (TCG: AVX2, no AVX-512).
EMULATED_CPUS = ("Haswell", "Skylake-Client", "EPYC")


@pytest.mark.slow
@pytest.mark.parametrize("cpu", EMULATED_CPUS)
def test_rows_are_invariant_on_an_emulated_cpu(cpu: str) -> None:
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        pytest.skip("needs the qemu-x86_64 emulator (Debian: apt-get install qemu-user)")
    out = _run([qemu, "-cpu", cpu], {"OMP_NUM_THREADS": "2"}, ["linear_rows", "paged_attention_rows"],
               timeout=1800)
    assert "ok paged_attention_rows" in out, out
