"""Running Triton kernels' checks under the interpreter, shared by the kernel test modules.

`TRITON_INTERPRET` is read when `triton.jit` decorates a kernel, i.e. when a kernel module is first
imported, so each check script (`kernels_interp_checks.py`, `dsv4_kernel_interp_checks.py`) runs in a
fresh process started by `interpreter_results`, and prints one JSON object through `run_checks`:
check name -> "ok" or the failure's traceback. This module imports neither torch nor triton, so a
check script can import it before it sets the variable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _dot_in_k_order() -> None:
    """Under the interpreter `tl.dot` is numpy's matmul, whose BLAS may round a row of a tile by its
    place in it (seen on an AVX-512 AMD machine); a GPU's MMA computes every element of a tile alike.
    Sum each output in k order, every product and every add rounded once, so the checks test the
    kernels' tiling and not the host's BLAS."""
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        dtype = d.data.dtype
        x, y = a.data.astype(dtype), b.data.astype(dtype)
        # [.., M, K, N] products summed over K, a non-contiguous axis, which numpy adds in k order
        acc = (x[..., :, :, None] * y[..., None, :, :]).sum(axis=-2)
        return interpreter.TensorHandle(acc + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


SHARD = "DSPARK_INTERP_SHARD"  # "i/n": run the checks at positions i, i + n, … of the script's list


def run_checks(checks: dict[str, Callable[[], None]]) -> int:
    """Run every check (or this process's share, `SHARD`) and print the JSON result (a check
    script's `main`)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        _dot_in_k_order()
    index, count = (int(part) for part in os.environ.get(SHARD, "0/1").split("/"))
    results: dict[str, str] = {}
    for name, check in list(checks.items())[index::count]:
        try:
            check()
            results[name] = "ok"
        except Exception:  # report every check, not just the first failure
            results[name] = traceback.format_exc()
    print(json.dumps(results))
    return 0


def interpreter_results(script: str, processes: int = 2) -> dict[str, str]:
    """The results of `tests/<script>` run under `TRITON_INTERPRET=1` in fresh processes, its checks
    shared between `processes` of them that run at once (the interpreter is one core's work; CI has
    two)."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / script)], cwd=REPO,
                              env={**env, SHARD: f"{i}/{processes}"}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(processes)]
    results: dict[str, str] = {}
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, err[-4000:]
        results.update(json.loads(out.strip().splitlines()[-1]))
    return results
