"""Joining a deployment's process group: the launch torchrun describes in the environment, checked against
what the spec compiled.

`torchrun --nproc-per-node K -m generated.<name> run|serve …` starts K processes and sets `RANK`,
`WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` in each; a plain `python -m generated.<name>`
is one process of rank 0. The deployment's `parallelism` says how many it needs (`ParallelPlan.world_size`:
tp x dp, or tp with DP attention); a launch that differs is refused with the command that fits. The
process group runs over torch.distributed: gloo on the CPU, NCCL on CUDA, HCCL on Ascend.

Built: tensor parallelism of the dense families and of dsv4, rank 0 leading (`dspark.runtime.distributed.
lockstep`; each rank captures and replays its own graphs), and DP attention over the dense families and
dsv4 (`dspark.runtime.distributed.dp_sync` and `dp_engine`; the model half, `dp_attention`). Refused here
with what to compile instead: data parallelism without DP attention (independent replicas, which one
process group does not need).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from dspark.runtime.config import DeploymentConfig, ParallelPlan
from dspark.runtime.distributed.dp_attention import DPAttentionGroups
from dspark.runtime.distributed.tensor_parallel import TPGroup

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
    if parallel.dp > 1 and not parallel.dp_attention:
        raise LaunchError(f"{name} is compiled with dp {parallel.dp} without DP attention: data-parallel "
                          "replicas share nothing, so run one build with parallelism.dp: 1 per replica "
                          "behind a load balancer, or set parallelism.dp_attention: true")
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


@dataclass(frozen=True)
class Ranks:
    """This process's places in the deployment's process group.

    `world` is every process: the tensor parallelism of the MLP, the embedding and the LM head (and of
    everything without DP attention). `lockstep` is the processes that run the same rows as this one, led
    by its rank 0, which runs an engine (scheduler, draft, planner) while the others follow its step
    commands: the world, or under DP attention this DP rank's `tp / dp` attention ranks. `dp` holds the
    DP attention groups (None without DP attention, or with one DP rank).
    """

    launch: Launch
    world: TPGroup
    dp: DPAttentionGroups | None = None

    @classmethod
    def single(cls) -> Ranks:
        return cls(Launch(0, 1, 0), TPGroup.single())

    @property
    def lockstep(self) -> TPGroup:
        return self.world if self.dp is None else self.dp.attention

    @property
    def runs_engine(self) -> bool:
        return self.lockstep.rank == 0

    @property
    def dp_rank(self) -> int:
        return 0 if self.dp is None else self.dp.dp_rank

    @property
    def engines(self) -> TPGroup:
        """The DP ranks' engines (the lockstep leaders; one rank without DP attention), for an engine rank:
        its `dp` group, whose rank is the DP rank."""
        if self.dp is None:
            return TPGroup.single()
        if not self.runs_engine:
            raise ValueError(f"rank {self.launch.rank} follows its DP rank's engine; it is in no engine "
                             "group")
        return self.dp.dp

    @property
    def shards(self) -> TPGroup | DPAttentionGroups:
        """What the target is split over: the world, or the DP attention groups."""
        return self.world if self.dp is None else self.dp


_joined: Ranks | None = None  # this process's places once it joined (a process joins once, until it leaves)


def join(deployment: DeploymentConfig, env: Mapping[str, str] = os.environ) -> Ranks:
    """This process's places, its launch checked against the deployment; the process group (and under DP
    attention its subgroups, which every rank creates in the same order) is initialised here when there is
    more than one process. A second call (the CLI asks `follows`, then builds its `Runtime`) returns the
    places of the first: creating the subgroups again would wait for ranks that do not."""
    global _joined
    launch = Launch.from_env(env)
    check_launch(launch, deployment)
    if launch.world_size == 1:
        return Ranks.single()
    if _joined is not None and _joined.launch == launch:
        return _joined
    import torch.distributed as dist

    if not dist.is_initialized():
        # env:// reads MASTER_ADDR and MASTER_PORT, which torchrun sets
        dist.init_process_group(PROCESS_GROUP_BACKENDS[deployment.backend], rank=launch.rank,
                                world_size=launch.world_size, timeout=COLLECTIVE_TIMEOUT)
    world = TPGroup(launch.rank, launch.world_size, dist.group.WORLD)
    parallel = deployment.parallel
    groups = DPAttentionGroups.build(parallel.tp, parallel.dp) if parallel.dp > 1 else None
    _joined = Ranks(launch, world, groups)
    return _joined


def leave(ranks: Ranks, together: bool = True) -> None:
    """Tear the process group down (a no-op for one process). `together`: first wait until every rank is
    leaving, so that none tears its connections down while gloo still delivers the last command another
    sent (a process that exits with such work pending aborts); False once a rank failed, as nothing more
    can be waited for then."""
    global _joined
    _joined = None
    if ranks.world.size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            if together:
                dist.barrier()
            dist.destroy_process_group()
