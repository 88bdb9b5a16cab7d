"""Rank 0 leads, the other tensor-parallel ranks follow: every call of the target's forward is a step command.

The engine (scheduler, planner, draft, sampling, the HTTP server) runs on rank 0 only, unchanged: it sees
`LeaderTarget`, a `ServingTarget` over rank 0's shard. Each call the engine makes of the target
(`forward_paged_states` with the step's attention metadata, `compute_logits`) is first broadcast to the
other ranks as a command, then run; a follower (`follow`) runs the same call on its own shard and its own
KV cache, so every collective inside the sharded model (the row-parallel all-reduces, the vocab-parallel
gathers) meets its partners. What is broadcast is what the call takes: the input ids, positions and
attention metadata of the step (the engine planned them on rank 0: verify_lens, the budget and the
layout are decided once, there), or the rows whose logits are wanted.

With `DSPARK_TP_CHECK=1` in every rank's environment (a debug mode), each rank digests what it ran (the
step's input ids and positions) and what it got (the residual stream and states, or the logits) after every
command, the digests are all-gathered, and any disagreement fails the step on every rank, naming the ranks.

The DSpark draft runs on rank 0 alone, unsharded: it is a few layers against the target's tens, it reads
the target states the sharded forward returns whole on every rank, and keeping it off the followers
keeps its KV cache and its small matmuls free of collectives.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from dspark.runtime.distributed.tensor_parallel import COMM_CLOCK, TPGroup

FORWARD, LOGITS, STOP = "forward", "logits", "stop"
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


def _broadcast(tp: TPGroup, command: tuple[Any, ...] | None, device: torch.device) -> tuple[Any, ...]:
    """Rank 0's `command` on every rank of the group (NCCL moves the pickled bytes through `device`)."""
    box = [command]
    through = device if device.type == "cuda" else None
    with COMM_CLOCK.timed("command"):
        # group_src: rank 0 of the group (under DP attention a DP rank's engine, not the world's rank 0)
        dist.broadcast_object_list(box, group=tp.group, device=through, group_src=0)
    command = box[0]
    assert command is not None
    return command


class LeaderTarget:
    """Rank 0's view of a tensor-parallel target: each forward call is broadcast, then run on its shard."""

    def __init__(self, target: Any, tp: TPGroup) -> None:
        self.target = target
        self.tp = tp
        self.broken = False  # a collective failed (a rank died): nothing more can be sent
        self.cfg = target.cfg
        self.lm_head = target.lm_head
        self.device = target.lm_head.weight.device

    def forward_paged_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any, meta: Any,
                             capture: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self._guard():
            _broadcast(self.tp, (FORWARD, input_ids, positions, meta, tuple(capture)), self.device)
            return _forward(self.target, self.tp, input_ids, positions, attn, meta, capture)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._guard():
            _broadcast(self.tp, (LOGITS, hidden), self.device)
            return _logits(self.target, self.tp, hidden)

    def stop(self) -> None:
        """Release the followers (they return from `follow`); nothing to release once a rank died."""
        if not self.broken:
            with self._guard():
                _broadcast(self.tp, (STOP,), self.device)

    @contextmanager
    def _guard(self) -> Iterator[None]:
        if self.broken:
            raise RuntimeError("a tensor-parallel rank failed earlier; the process group cannot run a step")
        try:
            yield
        except BaseException:
            self.broken = True
            raise


def _forward(target: Any, tp: TPGroup, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any, meta: Any,
             capture: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden, states = target.forward_paged_states(input_ids, positions, attn, meta, capture)
    if checking():
        check_agreement(tp, "forward", input_ids, positions, hidden, states)
    return hidden, states


def _logits(target: Any, tp: TPGroup, hidden: torch.Tensor) -> torch.Tensor:
    logits = target.compute_logits(hidden)
    if checking():
        check_agreement(tp, "logits", hidden, logits)
    return logits


def follow(target: Any, attn: Any, tp: TPGroup) -> None:
    """Run rank 0's step commands on this rank's shard until it stops."""
    device = target.lm_head.weight.device
    while True:
        command = _broadcast(tp, None, device)
        kind = command[0]
        if kind == STOP:
            return
        if kind == FORWARD:
            _, input_ids, positions, meta, capture = command
            _forward(target, tp, input_ids, positions, attn, meta, capture)
        elif kind == LOGITS:
            _logits(target, tp, command[1])
        else:
            raise RuntimeError(f"rank {tp.rank}: unknown step command {kind!r} from rank 0")
