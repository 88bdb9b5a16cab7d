"""Spawning gloo ranks over 127.0.0.1 for the multi-process tests, bounded so a hang fails the test."""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

# Ranks fork from one server process that has imported torch and the runtime once, instead of each
# spawned rank importing them anew (seconds per rank). The server itself runs nothing: no thread pool
# is forked.
multiprocessing.set_forkserver_preload(["torch", "dspark.runtime.engine.runtime", "dspark.runtime.package",
                                        "dspark.runtime.distributed.tensor_parallel", "tests.gloo_ranks"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(main: Callable[..., None], size: int, args: tuple[Any, ...], out_dir: Path, timeout_s: float,
                what: str) -> list[dict[str, Any]]:
    """Run `main(rank, size, port, *args, out_dir)` on `size` processes and load each rank's
    `out_dir/rank<r>.pt`; a rank that raises, or a run past `timeout_s`, fails the test."""
    context = mp.start_processes(main, args=(size, free_port(), *args, str(out_dir)), nprocs=size, join=False,
                                 start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):  # raises ProcessRaisedException / ProcessExitedException
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"{size} {what} did not finish in {timeout_s} s")
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(size)]


def as_rank(rank: int, size: int, port: int, check: bool = False) -> None:
    """Make this spawned process rank `rank` of `size`, as torchrun would (its environment), on one thread;
    `check`: the check mode on."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DSPARK_TP_CHECK="1" if check else "0")
    torch.set_num_threads(1)


def generate_as_rank(package_dir: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """This rank's part of a greedy run of the package: rank 0 generates and returns its outputs, the
    steps it took and the tiers its runner captured graphs for (if any); the other ranks return {}."""
    from dspark.runtime.engine.runtime import Runtime, follows
    from dspark.runtime.package import load_package

    package = load_package(package_dir)
    if follows(package):
        return {}
    runtime = Runtime(package)
    try:
        graphs = sorted(getattr(runtime.verify_runner, "graphs", {}))
        outputs, stats = runtime.generate(prompts, new_tokens)
    finally:
        runtime.close()
    return {"graphs": graphs, "outputs": outputs, "steps": stats.steps}
