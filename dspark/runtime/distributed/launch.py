"""Joining a deployment's process group: the launch torchrun describes in the environment, checked against
what the spec compiled.

`torchrun --nproc-per-node K -m generated.<name> run|serve …` starts K processes and sets `RANK`,
`WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` in each; a plain `python -m generated.<name>`
is one process of rank 0. The deployment's `parallelism` says how many it needs (`ParallelPlan.world_size`:
tp x dp, or tp with DP attention); a launch that differs is refused with the command that fits. The
process group runs over torch.distributed: gloo on the CPU, NCCL on CUDA, HCCL on Ascend.

Built so far: tensor parallelism of the dense families, rank 0 leading (`dspark.runtime.distributed.
lockstep`), without graph capture. Data parallelism and DP attention (dp > 1) and graphs under tensor
parallelism are refused here with what to compile instead; a dsv4 build's tp (its recipe's, recorded)
runs as one process until dsv4 has tensor parallelism.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from dspark.formats.dsv4_config import DSV4_FAMILY
from dspark.runtime.config import DeploymentConfig, ParallelPlan
from dspark.runtime.distributed.tensor_parallel import TPGroup

log = logging.getLogger(__name__)

PROCESS_GROUP_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "ascend": "hccl"}
# How long a rank waits in a collective before it gives up: long enough for a prefill chunk of a large model
# on a slow device, short enough that a rank that died does not leave the others hanging for torch's default
# half hour.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


class LaunchError(RuntimeError):
    """A launch that does not fit the compiled deployment; the message says how to launch it."""


@dataclass(frozen=True)
class Launch:
    """This process's place in the launch (torchrun's environment variables)."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Launch:
        """The launch torchrun set up, or one process of rank 0 when it did not."""
        def number(key: str, default: int) -> int:
            raw = env.get(key)
            if raw is None:
                return default
            try:
                return int(raw)
            except ValueError:
                raise LaunchError(f"{key}={raw!r} is not an integer; launch with torchrun, which sets "
                                  "RANK, WORLD_SIZE and LOCAL_RANK") from None

        launch = cls(number("RANK", 0), number("WORLD_SIZE", 1), number("LOCAL_RANK", 0))
        if not 0 <= launch.rank < launch.world_size:
            raise LaunchError(f"RANK {launch.rank} is outside WORLD_SIZE {launch.world_size}; launch with "
                              "torchrun, which sets both")
        return launch

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def check_launch(launch: Launch, deployment: DeploymentConfig) -> None:
    """Raise LaunchError unless `launch` runs what `deployment` was compiled for, saying how to launch it."""
    parallel, name = deployment.parallel, deployment.name
    if parallel.dp > 1:
        raise LaunchError(f"{name} is compiled with dp {parallel.dp}; data parallelism and DP attention are "
                          "not built yet: recompile with parallelism.dp: 1 (tensor parallelism runs)")
    if parallel.tp > 1 and deployment.model.family == DSV4_FAMILY:
        # Its tp is the recipe's, recorded: the build runs as one process until dsv4 has tensor parallelism.
        if launch.world_size == 1:
            log.warning("%s records tp %d; tensor parallelism does not cover %s yet, so it runs as one "
                        "process", name, parallel.tp, DSV4_FAMILY)
            return
        raise LaunchError(f"{name} is compiled with tp {parallel.tp}; tensor parallelism covers the dense "
                          f"families, not {DSV4_FAMILY} yet: run it as one process (without torchrun)")
    if parallel.tp > 1 and deployment.backend != "cpu" and deployment.token_tiers:
        raise LaunchError(f"{name} is compiled with tp {parallel.tp} and graph capture; capturing graphs "
                          "under tensor parallelism is not built yet: recompile with graph.enabled: false")
    want = parallel.world_size
    if launch.world_size == want:
        return
    if want == 1:
        raise LaunchError(f"{name} is compiled for one process (tp 1, dp 1), launched as "
                          f"{launch.world_size}: run `python -m generated.{name} …` without torchrun, or "
                          "recompile with the parallelism you launch")
    raise LaunchError(f"{name} is compiled for {want} processes ({_describe(parallel)}), launched as "
                      f"{launch.world_size}: run `torchrun --nproc-per-node {want} -m generated.{name} "
                      "run|serve …`")


def _describe(parallel: ParallelPlan) -> str:
    dp = f", dp {parallel.dp}" if parallel.dp > 1 else ""
    return f"tp {parallel.tp}{dp}{' with DP attention' if parallel.dp_attention else ''}"


def join(deployment: DeploymentConfig, env: Mapping[str, str] = os.environ) -> tuple[Launch, TPGroup]:
    """This process's launch, checked against the deployment, and its tensor-parallel group (the whole world,
    as dp is 1); the process group is initialised here when there is more than one process."""
    launch = Launch.from_env(env)
    check_launch(launch, deployment)
    if launch.world_size == 1:
        return launch, TPGroup.single()
    import torch.distributed as dist

    if not dist.is_initialized():
        # env:// reads MASTER_ADDR and MASTER_PORT, which torchrun sets
        dist.init_process_group(PROCESS_GROUP_BACKENDS[deployment.backend], rank=launch.rank,
                                world_size=launch.world_size, timeout=COLLECTIVE_TIMEOUT)
    return launch, TPGroup(launch.rank, launch.world_size, dist.group.WORLD)


def leave(tp: TPGroup) -> None:
    """Tear the process group down (a no-op for one process)."""
    if tp.size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
