"""Tensor parallelism launched with torchrun: the embedded pair's static and compact builds recompiled with
`parallelism.tp: 2`, started as `torchrun --nproc-per-node 2 -m generated.<name> run …` on the CPU (gloo over
127.0.0.1). Rank 0 runs the engine and leads; rank 1 follows its step commands on its shard. The greedy
output equals single-process target-only decoding, token for token, with the check mode comparing every
step's results across the ranks (and failing every rank loudly when they differ); a launch that does not fit
the build is refused with the command that does."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dspark.runtime.config import ParallelPlan
from dspark.runtime.distributed.launch import Launch, LaunchError, check_launch
from dspark.runtime.distributed.lockstep import RankDisagreement, check_agreement
from dspark.runtime.distributed.tensor_parallel import TPGroup

from .gloo_ranks import as_rank, free_port, spawn_ranks
from .parallel_builds import (
    NEW_TOKENS,
    PROMPTS,
    REPO,
    compile_parallel,
    http_json,
    reference,
    run,
    torchrun,
    wait_healthy,
)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["tiny_cpu_static", "dsv4_tiny_cpu_compact"])
def test_tp2_under_torchrun_decodes_as_one_process(spec: str, tmp_path: Path) -> None:
    """A dense and a dsv4 build recompiled with tp 2 under `torchrun --nproc-per-node 2`, the check mode on,
    decode what one process's target-only decoding of the repository's tp-1 build decodes. (Dense compact
    under TP runs in test_parallel_graphs.py and, inside each DP rank, in test_dp_attention_serving.py; dsv4
    static in test_dsv4_tensor_parallel.py's model-level tests.)"""
    name = compile_parallel(spec, tmp_path, tp=2)
    assert torchrun(name, 2, tmp_path, free_port()) == reference(spec)


def _disagree(rank: int, port: int, found: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        same = torch.arange(6.0)
        check_agreement(TPGroup(rank, 2, dist.group.WORLD), "forward", same)  # agrees: no error
        try:
            check_agreement(TPGroup(rank, 2, dist.group.WORLD), "forward", same + rank)
        except RankDisagreement as err:
            found[rank] = str(err)
    finally:
        dist.destroy_process_group()


def test_the_check_mode_fails_every_rank_loudly_on_a_disagreement() -> None:
    found = mp.Manager().dict()
    mp.spawn(_disagree, args=(free_port(), found), nprocs=2, join=True)
    assert dict(found) == {r: "tensor-parallel ranks disagree on the forward: ranks [0] vs [1] computed "
                              "different results" for r in (0, 1)}


def _plan_disagrees(rank: int, size: int, port: int, package_dir: str, out_dir: str) -> None:
    as_rank(rank, size, port, check=True)
    from dspark.runtime.engine.runtime import Runtime, follows
    from dspark.runtime.engine.step_forward import StepForward
    from dspark.runtime.package import load_package

    if rank == 1:  # this rank runs every verify step with another plan than rank 0 sent (same rows run)
        verify = StepForward.verify

        def other_plan(self: StepForward, step: Any) -> Any:
            return verify(self, dataclasses.replace(step, verify_lens=tuple(1 for _ in step.verify_lens)))

        StepForward.verify = other_plan  # type: ignore[method-assign]
    package = load_package(package_dir)
    found = ""
    try:
        if not follows(package):
            Runtime(package).generate([[1, 2, 3]], 8)
    except RankDisagreement as err:
        found = str(err)
    torch.save({"found": found}, Path(out_dir) / f"rank{rank}.pt")
    os._exit(0)  # the process group is mid-step: leave without tearing it down


@pytest.mark.slow
def test_the_check_mode_fails_every_rank_when_one_runs_another_plan(tmp_path: Path) -> None:
    """cap-accept runs every row whatever verify_lens say, so a rank with other verify_lens computes the same
    forward: only the plan differs, and the check mode's digest of it fails both ranks loudly."""
    name = compile_parallel("tiny_cpu_cap_accept", tmp_path, tp=2)
    ranks = spawn_ranks(_plan_disagrees, 2, (str(tmp_path / "generated" / name),), tmp_path, 300,
                        "tensor-parallel ranks")
    found = ("tensor-parallel ranks disagree on the verify plan and forward: ranks [0] vs [1] computed "
             "different results")
    assert [r["found"] for r in ranks] == [found, found]


@pytest.mark.parametrize("spec", ["tiny_cpu_static", "dsv4_tiny_cpu_static"])
def test_a_launch_that_does_not_fit_the_build_says_how_to_launch_it(spec: str, tmp_path: Path) -> None:
    name = compile_parallel(spec, tmp_path, tp=2)
    result = run([sys.executable, "-m", f"generated.{name}", "run", "--prompt", "hi"], tmp_path)
    assert result.returncode == 2
    assert (f"{name} is compiled for 2 processes (tp 2), launched as 1: run `torchrun --nproc-per-node 2 "
            f"-m generated.{name} run|serve …`") in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", [{"tp": 2}, {"tp": 2, "dp": 2, "dp_attention": True}],
                         ids=["tp2", "dp2-dp-attention"])
def test_a_dead_rank_makes_the_server_answer_503_and_exit(parallelism: dict[str, Any],
                                                          tmp_path: Path) -> None:
    """Rank 1 is killed; the next step fails in its first collective, the request waiting on it gets a 503,
    and rank 0's server shuts down and exits with an error instead of hanging. Under DP attention the
    request runs on DP rank 0, and rank 1 (idle) is killed."""
    name = compile_parallel("tiny_cpu_static", tmp_path, **parallelism)
    port, master = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1",
           "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master)}
    command = [sys.executable, "-m", f"generated.{name}", "serve", "--host", "127.0.0.1", "--port", str(port)]
    ranks = [subprocess.Popen(command, cwd=tmp_path, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, ranks[0])
        body = {"model": name, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
        assert http_json(f"{url}/v1/completions", body)[0] == 200  # both ranks serve
        ranks[1].kill()
        ranks[1].wait(timeout=30)
        status, answer = http_json(f"{url}/v1/completions", body)
        assert status == 503 and answer["error"]["code"] == "engine_stopped"
        _, err = ranks[0].communicate(timeout=120)  # exits, does not hang
        assert ranks[0].returncode == 2
        assert "a rank of the launch failed and the server shut down; restart the launch" in err
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
def test_dspark_serve_starts_the_ranks_a_build_needs(tmp_path: Path) -> None:
    """`dspark serve` on a TP=2 build launches two ranks itself; rank 0 serves what one process decodes, and
    an interrupt stops every rank."""
    name = compile_parallel("tiny_cpu_static", tmp_path, tp=2)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "dspark.cli.main", "serve", str(tmp_path / "generated" / name),
               "--port", str(port)]
    server = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, server)
        body = {"model": name, "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0}
        status, answer = http_json(f"{url}/v1/completions", body)
        one = run([sys.executable, "-m", "generated.tiny_cpu_static", "run", "--prompt", PROMPTS[0],
                   "--max-new-tokens", str(NEW_TOKENS), "--target-only", "--json"], REPO)
        assert one.returncode == 0, one.stderr[-8000:]
        want = json.loads(one.stdout)["completions"][0]["text"]
        assert status == 200 and answer["choices"][0]["text"] == want
        os.killpg(server.pid, signal.SIGINT)  # a terminal's Ctrl+C reaches the whole process group
        _, err = server.communicate(timeout=60)
        assert "starting them with torchrun (rank 0 serves on 127.0.0.1" in err
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.mark.parametrize(("parallel", "family", "tiers", "backend", "message"), [
    ({"dp": 2, "tp": 2}, "llama", (), "cpu",
     "compiled with dp 2 without DP attention: data-parallel replicas"),
    ({"dp": 2, "dp_attention": True, "tp": 4}, "dsv4", (), "cpu",
     "compiled for 4 processes (tp 4, dp 2 with DP attention), launched as 2: run `torchrun "
     "--nproc-per-node 4"),
    ({"dp": 2, "dp_attention": True, "tp": 4}, "llama", (), "cpu",
     "compiled for 4 processes (tp 4, dp 2 with DP attention), launched as 2"),
    ({"tp": 4}, "dsv4", (), "cpu",
     "compiled for 4 processes (tp 4), launched as 2: run `torchrun --nproc-per-node 4 -m generated.demo"),
    ({"tp": 1}, "llama", (), "cpu", "compiled for one process (tp 1, dp 1), launched as 2"),
])
def test_launches_that_are_not_built_or_do_not_fit_are_refused(parallel, family, tiers, backend, message):
    deployment = SimpleNamespace(name="demo", backend=backend, token_tiers=tiers,
                                 model=SimpleNamespace(family=family),
                                 parallel=ParallelPlan(**{"tp": 1, "dp": 1, "dp_attention": False, "ep": 1,
                                                          **parallel}))
    with pytest.raises(LaunchError, match=re.escape(message)):
        check_launch(Launch(0, 2, 0), deployment)  # type: ignore[arg-type]


def test_a_dsv4_build_runs_its_tp_as_that_many_processes() -> None:
    """Like the dense families': its tp's processes are accepted, one process is refused with the command."""
    deployment = SimpleNamespace(name="flash", backend="ascend", token_tiers=(8,),
                                 model=SimpleNamespace(family="dsv4"),
                                 parallel=ParallelPlan(tp=2, dp=1, dp_attention=False, ep=1))
    for rank in (0, 1):
        check_launch(Launch(rank, 2, rank), deployment)  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match=re.escape(
            "flash is compiled for 2 processes (tp 2), launched as 1: run `torchrun --nproc-per-node 2 -m "
            "generated.flash run|serve …`")):
        check_launch(Launch(0, 1, 0), deployment)  # type: ignore[arg-type]
