"""An engine's rank leads, the other ranks of its tensor-parallel group follow: every forward of a step is a
step command.

The engine (scheduler, planner, draft, sampling, the HTTP server) runs on the group's rank 0 only,
unchanged: it runs each forward through `LeaderForward`, which first broadcasts the step's command (an
`ExtendForward`, `VerifyForward` or `LogitsForward` of `dspark.runtime.engine.step_forward`: host values
and token ids) and then runs it. A follower (`follow`) runs the same command on its own shard, KV cache
and verify runner, so every collective inside the sharded model (the row-parallel all-reduces, the
vocab-parallel gathers) meets its partners; each rank plans its own layout and metadata from the host
values, and its own captured graphs replay its own buffers. The budget, `verify_lens` and the layout are
therefore decided once, by the engine.

With `DSPARK_TP_CHECK=1` in every rank's environment (a debug mode), each rank digests what it got from
every command (the residual stream and states, or the logits), the digests are all-gathered, and any
disagreement fails the step on every rank, naming the ranks.

The DSpark draft runs on the engine's rank alone, unsharded: it is a few layers against the target's tens, it
reads the target states the sharded forward returns whole on every rank, and keeping it off the followers
keeps its KV cache and its small matmuls free of collectives.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from dspark.runtime.distributed.tensor_parallel import COMM_CLOCK, TPGroup
from dspark.runtime.engine.step_forward import (
    ExtendForward,
    LogitsForward,
    StepCommand,
    StepForward,
    VerifyForward,
    on_host,
    run_forward,
)
from dspark.runtime.layout import ExtendLayout, VerifyLayout
from dspark.runtime.package import VerifyRunner

STOP = "stop"
CHECK_ENV = "DSPARK_TP_CHECK"


class RankDisagreement(RuntimeError):
    """Tensor-parallel ranks that ran a step differently (the check mode's finding)."""


def checking() -> bool:
    return os.environ.get(CHECK_ENV) == "1"


def _digest(*tensors: torch.Tensor | None) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_agreement(tp: TPGroup, what: str, *tensors: torch.Tensor | None,
                    ranks: str = "tensor-parallel ranks") -> None:
    """All-gather every rank's digest of `tensors`; raise RankDisagreement on every rank if they differ,
    naming the group's `ranks` that differ."""
    digests: list[str | None] = [None] * tp.size
    dist.all_gather_object(digests, _digest(*tensors), group=tp.group)
    if len(set(digests)) > 1:
        groups: dict[str | None, list[int]] = {}
        for rank, d in enumerate(digests):
            groups.setdefault(d, []).append(rank)
        raise RankDisagreement(f"{ranks} disagree on the {what}: ranks "
                               f"{' vs '.join(str(r) for r in groups.values())} computed different results")


def _broadcast(tp: TPGroup, command: Any, device: torch.device) -> Any:
    """The group's rank 0's `command` on every rank of the group."""
    box = [command]
    through = None if device.type == "cpu" else device  # NCCL and HCCL move bytes through the device
    with COMM_CLOCK.timed("command"):
        # group_src: rank 0 of the group (under DP attention a DP rank's engine, not the world's rank 0)
        dist.broadcast_object_list(box, group=tp.group, device=through, group_src=0)
    return box[0]


def _checked(forward: StepForward, tp: TPGroup, command: StepCommand) -> Any:
    """Run `command`; in the check mode, fail every rank of the group if any got another result. A verify
    step's digest also covers the plan each rank laid out (rows per slot, `verify_lens`, the tier)."""
    result = run_forward(forward, command)
    if checking():
        if isinstance(command, LogitsForward):
            check_agreement(tp, "logits", result)
        elif isinstance(command, ExtendForward):
            check_agreement(tp, "extend forward", *result[:2])  # hidden, states
        else:
            layout = result[0]  # the plan as this rank laid it out: rows, verify_lens, tier
            tier = torch.tensor([layout.tier], dtype=torch.int32, device=layout.verify_lens.device)
            check_agreement(tp, "verify plan and forward", layout.rows_per_slot, layout.verify_lens, tier,
                            *result[1:])  # hidden, states
    return result


class LeaderForward:
    """The engine's side of a tensor-parallel step: each command is broadcast, then run on its shard."""

    def __init__(self, forward: StepForward, tp: TPGroup) -> None:
        self.forward = forward
        self.tp = tp
        self.broken = False  # a collective failed (a rank died): nothing more can be sent

    @property
    def runner(self) -> VerifyRunner:
        return self.forward.runner

    def extend(self, step: ExtendForward) -> tuple[torch.Tensor, torch.Tensor | None, ExtendLayout]:
        return self._lead(step)  # type: ignore[no-any-return]

    def verify(self, step: VerifyForward) -> tuple[VerifyLayout, torch.Tensor, torch.Tensor | None]:
        return self._lead(step)  # type: ignore[no-any-return]

    def logits(self, step: LogitsForward) -> torch.Tensor:
        return self._lead(step)  # type: ignore[no-any-return]

    def stop(self) -> None:
        """Release the followers (they return from `follow`); nothing to release once a rank died."""
        if not self.broken:
            with self._guard():
                _broadcast(self.tp, STOP, self.forward.device)

    def _lead(self, step: StepCommand) -> Any:
        with self._guard():
            _broadcast(self.tp, on_host(step), self.forward.device)
            return _checked(self.forward, self.tp, step)

    @contextmanager
    def _guard(self) -> Iterator[None]:
        if self.broken:
            raise RuntimeError("a tensor-parallel rank failed earlier; the process group cannot run a step")
        try:
            yield
        except BaseException:
            self.broken = True
            raise


def follow(forward: StepForward, tp: TPGroup) -> None:
    """Run the group's rank 0's step commands on this rank's shard until it stops."""
    while True:
        command = _broadcast(tp, None, forward.device)
        if command == STOP:
            return
        if not isinstance(command, (ExtendForward, VerifyForward, LogitsForward)):
            raise RuntimeError(f"rank {tp.rank}: unknown step command {command!r} from its group's rank 0")
        _checked(forward, tp, command)
