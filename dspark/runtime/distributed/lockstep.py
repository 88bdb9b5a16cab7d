"""Rank 0 leads, the other tensor-parallel ranks follow: every call of the target's forward is a step command.

The engine (scheduler, planner, draft, sampling, the HTTP server) runs on rank 0 only, unchanged: it sees
`LeaderTarget`, a `ServingTarget` over rank 0's shard. Each call the engine makes of the target
(`forward_paged_states` with the step's attention metadata, `compute_logits`) is first broadcast to the
other ranks as a command, then run; a follower (`follow`) runs the same call on its own shard and its own
KV cache, so every collective inside the sharded model (the row-parallel all-reduces, the vocab-parallel
gathers) meets its partners. What is broadcast is what the call takes: the input ids, positions and
attention metadata of the step (the engine planned them on rank 0: verify_lens, the budget and the
layout are decided once, there), or the rows whose logits are wanted.

The DSpark draft runs on rank 0 alone, unsharded: it is a few layers against the target's tens, it reads
the target states the sharded forward returns whole on every rank, and keeping it off the followers
keeps its KV cache and its small matmuls free of collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dspark.runtime.distributed.tensor_parallel import TPGroup

FORWARD, LOGITS, STOP = "forward", "logits", "stop"


def _broadcast(tp: TPGroup, command: tuple[Any, ...] | None, device: torch.device) -> tuple[Any, ...]:
    """Rank 0's `command` on every rank of the group (NCCL moves the pickled bytes through `device`)."""
    box = [command]
    dist.broadcast_object_list(box, src=0, group=tp.group, device=device if device.type == "cuda" else None)
    command = box[0]
    assert command is not None
    return command


class LeaderTarget:
    """Rank 0's view of a tensor-parallel target: each forward call is broadcast, then run on its shard."""

    def __init__(self, target: Any, tp: TPGroup) -> None:
        self.target = target
        self.tp = tp
        self.cfg = target.cfg
        self.lm_head = target.lm_head
        self.device = target.lm_head.weight.device

    def forward_paged_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any, meta: Any,
                             capture: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        _broadcast(self.tp, (FORWARD, input_ids, positions, meta, tuple(capture)), self.device)
        return self.target.forward_paged_states(input_ids, positions, attn, meta, capture)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        _broadcast(self.tp, (LOGITS, hidden), self.device)
        return self.target.compute_logits(hidden)

    def stop(self) -> None:
        """Release the followers (they return from `follow`)."""
        _broadcast(self.tp, (STOP,), self.device)


def follow(target: Any, attn: Any, tp: TPGroup) -> int:
    """Run rank 0's step commands on this rank's shard until it stops; returns the commands run."""
    device = target.lm_head.weight.device
    done = 0
    while True:
        command = _broadcast(tp, None, device)
        kind = command[0]
        if kind == STOP:
            return done
        if kind == FORWARD:
            _, input_ids, positions, meta, capture = command
            target.forward_paged_states(input_ids, positions, attn, meta, capture)
        elif kind == LOGITS:
            target.compute_logits(command[1])
        else:
            raise RuntimeError(f"rank {tp.rank}: unknown step command {kind!r} from rank 0")
        done += 1
