"""DP attention, the dispatch: rank 0's server requests spread over the DP ranks' engines.

Every DP rank runs a `Runtime` over its own requests; each step the engines agree on the rows they all
run (`dp_sync`, below the step). Rank 0 also owns the HTTP server and the dispatch (`DPDispatch`, above
its `Runtime`): a request goes to the DP rank with the fewest unfinished requests, and each step rank 0
scatters every engine's new requests and aborts (`EngineCommand`), every engine runs the step, and the
engines' new tokens come back to rank 0 (`EngineReply`), where the server's requests stand for them. The
other engines loop in `serve_engine`, driving their `Runtime` through its methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dspark.formats.step_records import StepRecord
from dspark.runtime.config import DeploymentConfig
from dspark.runtime.distributed.launch import Ranks
from dspark.runtime.distributed.tensor_parallel import COMM_CLOCK, TPGroup
from dspark.runtime.engine.requests import Request
from dspark.runtime.engine.scheduler import Scheduler
from dspark.runtime.engine.speculative import StepRecorder
from dspark.runtime.engine.stats import RunStats, StepInfo
from dspark.runtime.engine.step_forward import (
    ExtendForward,
    LogitsForward,
    StepCommand,
    StepForwards,
    VerifyForward,
    on_host,
    run_forward,
)
from dspark.runtime.layout import ExtendLayout, VerifyLayout
from dspark.runtime.package import VerifyRunner
from dspark.runtime.sampling import SamplingParams

STEP, STATS, MIRROR, STOP = "step", "stats", "mirror", "stop"


class DPEngine(Protocol):
    """What the dispatch and `serve_engine` drive of a DP rank's `Runtime` (the engine below them)."""

    ranks: Ranks
    deployment: DeploymentConfig
    scheduler: Scheduler
    forward: StepForwards
    stats: RunStats
    target_only: bool
    last_step: StepInfo | None
    recorder: StepRecorder | None

    def start_run(self, target_only: bool, reset_stats: bool) -> None: ...

    def adopt(self, spec: RequestSpec) -> Request: ...

    def step_local(self) -> list[Request]: ...


# -- rank 0's dispatch and the other engines -------------------------------------------------------------
@dataclass(frozen=True)
class RequestSpec:
    """A request rank 0 validated, as a DP rank's engine rebuilds it."""

    rid: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    ignore_eos: bool
    seed: int | None

    @classmethod
    def of(cls, r: Request) -> RequestSpec:
        return cls(r.rid, tuple(r.prompt), r.max_new_tokens, r.sampling, r.ignore_eos, r.seed)


@dataclass(frozen=True)
class EngineCommand:
    """What one DP rank's engine does next: a step (after admitting `new` and dropping `aborts`), a report
    of its run's counters, rank 0's next forward (profiling), or stop."""

    kind: str
    target_only: bool = False
    new: tuple[RequestSpec, ...] = ()
    aborts: tuple[int, ...] = ()  # rids
    reset_stats: bool = False  # a new `generate` run starts: zero the counters first
    forward: StepCommand | None = None  # MIRROR: the forward rank 0 runs next, to run alongside it
    recording: bool = False  # rank 0 records the run (`dspark run --record`): relay what this engine records
    record_features: bool = False  # ... with the confidence head's inputs


@dataclass(frozen=True)
class RequestUpdate:
    rid: int
    tokens: tuple[int, ...]  # committed since the last update
    done: bool
    finish_reason: str | None
    decode_steps: int


@dataclass(frozen=True)
class EngineReply:
    updates: tuple[RequestUpdate, ...] = ()
    pool: dict[str, int] = field(default_factory=dict)
    step: StepInfo | None = None
    stats: RunStats | None = None
    sts: tuple[StsRows, ...] = ()  # what this engine recorded this step, for rank 0's recorder
    steps: tuple[StepRecord, ...] = ()


# A step's calibration rows as `StsSink.add` takes them: logits, correct_len, fully_verified, features.
StsRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


class _RelaySts:
    def __init__(self, features: bool) -> None:
        self._features = features
        self.rows: list[StsRows] = []

    @property
    def features(self) -> bool:
        return self._features

    def add(self, logits: torch.Tensor, correct_len: torch.Tensor, fully_verified: torch.Tensor,
            features: torch.Tensor | None) -> None:
        self.rows.append((logits.cpu(), correct_len.cpu(), fully_verified.cpu(),
                          None if features is None else features.cpu()))


class _RelaySteps:
    def __init__(self, slot_offset: int) -> None:
        self.slot_offset = slot_offset
        self.records: list[StepRecord] = []

    def append(self, record: StepRecord) -> None:
        # slots numbered across DP ranks, so that slot and generation still name one request's history
        requests = tuple(replace(r, slot=r.slot + self.slot_offset) for r in record.requests)
        self.records.append(replace(record, requests=requests))


class RelayRecorder:
    """Another DP rank's engine's recorder: what it records (calibration rows and step records, slots
    offset by the DP rank) goes to rank 0's recorder with the step's reply, so a recording run under DP
    attention writes one recording of every DP rank's steps."""

    def __init__(self, features: bool, slot_offset: int) -> None:
        self.sts = _RelaySts(features)
        self.steps = _RelaySteps(slot_offset)

    def take(self) -> tuple[tuple[StsRows, ...], tuple[StepRecord, ...]]:
        rows, records = tuple(self.sts.rows), tuple(self.steps.records)
        self.sts.rows, self.steps.records = [], []
        return rows, records


def _scatter(engines: TPGroup, commands: list[EngineCommand] | None) -> EngineCommand:
    box: list[Any] = [None]
    with COMM_CLOCK.timed("command"):
        dist.scatter_object_list(box, commands, group=engines.group, group_src=0)
    return box[0]


def _gather(engines: TPGroup, reply: EngineReply) -> list[EngineReply] | None:
    replies: list[Any] | None = [None] * engines.size if engines.rank == 0 else None
    with COMM_CLOCK.timed("command"):
        dist.gather_object(reply, replies, group=engines.group, group_dst=0)
    return replies


class EngineOutbox:
    """The tokens of a DP rank's requests that rank 0 has not seen yet."""

    def __init__(self) -> None:
        self.sent: dict[int, int] = {}  # rid -> output tokens already reported

    def updates(self, touched: list[Request]) -> tuple[RequestUpdate, ...]:
        out = []
        for r in touched:
            sent = self.sent.get(r.rid, 0)
            out.append(RequestUpdate(r.rid, tuple(r.output[sent:]), r.done, r.finish_reason, r.decode_steps))
            if r.done:
                self.sent.pop(r.rid, None)
            else:
                self.sent[r.rid] = len(r.output)
        return tuple(out)


def serve_engine(runtime: DPEngine) -> None:
    """A DP rank's engine other than rank 0's: run rank 0's commands until it stops."""
    engines = runtime.ranks.engines
    requests: dict[int, Request] = {}  # rid -> this engine's request
    outbox = EngineOutbox()
    while True:
        command = _scatter(engines, None)
        if command.kind == STOP:
            return
        if command.kind == STATS:
            _gather(engines, EngineReply(stats=runtime.stats))
            continue
        if command.kind == MIRROR:
            assert command.forward is not None
            run_forward(runtime.forward, command.forward)
            continue
        runtime.start_run(command.target_only, command.reset_stats)
        if not command.recording:
            runtime.recorder = None
        elif runtime.recorder is None:
            offset = engines.rank * runtime.deployment.serving.max_running_requests
            runtime.recorder = RelayRecorder(command.record_features, offset)
        for rid in command.aborts:
            if (r := requests.pop(rid, None)) is not None:
                runtime.scheduler.abort(r)
                outbox.sent.pop(rid, None)
        for spec in command.new:
            requests[spec.rid] = r = runtime.adopt(spec)
            runtime.scheduler.enqueue(r)
        touched = runtime.step_local()
        for r in touched:
            if r.done:
                requests.pop(r.rid, None)
        recorded = runtime.recorder.take() if isinstance(runtime.recorder, RelayRecorder) else ((), ())
        reply = EngineReply(outbox.updates(touched), runtime.scheduler.pool_stats(), runtime.last_step,
                            sts=recorded[0], steps=recorded[1])
        _gather(engines, reply)


class DPDispatch:
    """Rank 0's side of DP attention: the server's requests, dispatched to the DP ranks' engines.

    Rank 0's own engine (DP rank 0) runs in this process on the server's request objects, which enter
    and leave its scheduler directly. Another DP rank's requests are stood for by the server's objects,
    which each step's replies update as that engine updated its own (new tokens, done, finish reason,
    decode steps).
    """

    def __init__(self, runtime: DPEngine) -> None:
        self.runtime = runtime
        self.engines = runtime.ranks.engines
        size = self.engines.size
        self.new: list[list[Request]] = [[] for _ in range(size)]  # to send with the next step
        self.aborts: list[list[int]] = [[] for _ in range(size)]
        self.remote: dict[int, tuple[int, Request]] = {}  # rid -> (DP rank, the server's request): unfinished
        self.pools: list[dict[str, int]] = [{} for _ in range(size)]  # as of each engine's last step
        self.reset_stats = False
        self.stopped = False
        self.broken = False  # a step failed (a rank died): nothing more can be sent
        self.last_step: StepInfo | None = None  # every engine's last decode step, merged

    @property
    def has_work(self) -> bool:
        return self.runtime.scheduler.has_work or bool(self.remote) or any(self.aborts)

    def unfinished(self, dp_rank: int) -> int:
        """Requests dispatched to `dp_rank` that have not finished."""
        if dp_rank == 0:
            s = self.runtime.scheduler
            return len(s.waiting) + len(s.prefilling) + len(s.running)
        return sum(1 for d, _ in self.remote.values() if d == dp_rank)

    def enqueue(self, request: Request) -> None:
        """To the DP rank with the fewest unfinished requests (the lowest of equals)."""
        dp_rank = min(range(self.engines.size), key=lambda d: (self.unfinished(d), d))
        if dp_rank == 0:
            self.runtime.scheduler.enqueue(request)
            return
        self.remote[request.rid] = (dp_rank, request)
        self.new[dp_rank].append(request)

    def abort(self, request: Request) -> None:
        where = self.remote.pop(request.rid, None)
        if where is None:
            self.runtime.scheduler.abort(request)
            return
        dp_rank = where[0]
        if request in self.new[dp_rank]:
            self.new[dp_rank].remove(request)  # never sent: nothing to tell its engine
        else:
            self.aborts[dp_rank].append(request.rid)
        request.done = True
        request.finish_reason = request.finish_reason or "abort"

    def step(self) -> list[Request]:
        """One step of every engine; the server's requests that got tokens or finished."""
        if self.broken:
            raise RuntimeError("a rank of the launch failed earlier; the process group cannot run a step")
        try:
            return self._step()
        except BaseException:
            self.broken = True
            raise

    def _step(self) -> list[Request]:
        runtime = self.runtime
        recorder = runtime.recorder  # what the other engines record comes back to it
        features = recorder is not None and recorder.sts.features
        commands = [EngineCommand(STEP, runtime.target_only, tuple(RequestSpec.of(r) for r in new),
                                  tuple(aborts), self.reset_stats, recording=recorder is not None,
                                  record_features=features)
                    for new, aborts in zip(self.new, self.aborts, strict=True)]
        _scatter(self.engines, commands)
        self.new = [[] for _ in commands]
        self.aborts = [[] for _ in commands]
        self.reset_stats = False
        touched = runtime.step_local()
        replies = _gather(self.engines, EngineReply(step=runtime.last_step))
        assert replies is not None
        for dp_rank, reply in enumerate(replies[1:], start=1):
            self.pools[dp_rank] = reply.pool
            if recorder is not None:
                for rows in reply.sts:
                    recorder.sts.add(*rows)
                for record in reply.steps:
                    recorder.steps.append(record)
            for u in reply.updates:
                where = self.remote.get(u.rid)
                if where is None:
                    continue  # aborted here since
                r = where[1]
                r.output.extend(u.tokens)
                r.decode_steps = u.decode_steps
                if u.done:
                    r.done, r.finish_reason = True, r.finish_reason or u.finish_reason
                    del self.remote[u.rid]
                touched.append(r)
        self.last_step = merge_steps([reply.step for reply in replies])
        return touched

    def pool_stats(self) -> dict[str, int]:
        """Every DP rank's KV pool together: rank 0's as of now, the others' as of their last step, and
        the requests not sent yet as waiting."""
        total = dict(self.runtime.scheduler.pool_stats())
        for pool in self.pools[1:]:
            for key, value in pool.items():
                total[key] += value
        total["waiting"] += sum(len(new) for new in self.new)
        return total

    def collect_stats(self) -> RunStats:
        """Every DP rank's counters of the run, merged (`merge_stats`)."""
        _scatter(self.engines, [EngineCommand(STATS)] * self.engines.size)
        replies = _gather(self.engines, EngineReply(stats=self.runtime.stats))
        assert replies is not None
        return merge_stats([reply.stats for reply in replies if reply.stats is not None])

    def mirror(self, step: StepCommand) -> None:
        """Have every other engine run `step` on its own caches alongside rank 0's (`MirroredForward`)."""
        _scatter(self.engines, [EngineCommand(MIRROR, forward=on_host(step))] * self.engines.size)

    def stop(self) -> None:
        """Release the other engines (they return from `serve_engine`)."""
        if not (self.stopped or self.broken):
            self.stopped = True
            _scatter(self.engines, [EngineCommand(STOP)] * self.engines.size)


class MirroredForward:
    """Rank 0's forwards, each first sent to every other DP rank's engine to run alongside on its own
    caches: what a timed step of `dspark profile` runs under DP attention, where every DP rank runs the
    same step (the world-parallel layers gather every DP rank's rows), so the time is a step at that load."""

    def __init__(self, forward: StepForwards, dispatch: DPDispatch) -> None:
        self.forward = forward
        self.dispatch = dispatch

    @property
    def runner(self) -> VerifyRunner:
        return self.forward.runner

    def extend(self, step: ExtendForward) -> tuple[torch.Tensor, torch.Tensor | None, ExtendLayout]:
        self.dispatch.mirror(step)
        return self.forward.extend(step)

    def verify(self, step: VerifyForward) -> tuple[VerifyLayout, torch.Tensor, torch.Tensor | None]:
        self.dispatch.mirror(step)
        return self.forward.verify(step)

    def logits(self, step: LogitsForward) -> torch.Tensor:
        self.dispatch.mirror(step)
        return self.forward.logits(step)


def merge_stats(stats: list[RunStats]) -> RunStats:
    """The DP ranks' counters as one run's: counts summed; the steps and seconds are those of the step
    loop, which every DP rank runs together, so the most of any."""
    total = RunStats(gamma=stats[0].gamma)
    for s in stats:
        for name in ("requests", "request_steps", "generated_tokens", "committed_tokens", "verify_rows",
                     "padding_rows", "planned_rows", "predicted_tau", "planned_committed"):
            setattr(total, name, getattr(total, name) + getattr(s, name))
        total.drafts_verified = [a + b for a, b in zip(total.drafts_verified, s.drafts_verified, strict=True)]
        total.drafts_accepted = [a + b for a, b in zip(total.drafts_accepted, s.drafts_accepted, strict=True)]
    # the step loop's own counts: every DP rank runs each step, in the same (global) speculation state
    for name in ("steps", "planned_steps", "off_steps", "switches", "prefill_seconds", "decode_seconds",
                 "off_seconds", "on_seconds"):
        setattr(total, name, max(getattr(s, name) for s in stats))
    return total


def merge_steps(steps: list[StepInfo | None]) -> StepInfo | None:
    """The DP ranks' last decode steps as one: counts summed, the (global) tier, the slowest time."""
    real = [s for s in steps if s is not None]
    if not real:
        return None
    budgets = [s.budget for s in real]
    taus = [s.tau for s in real]
    return StepInfo(
        num_reqs=sum(s.num_reqs for s in real), committed=sum(s.committed for s in real),
        rows=sum(s.rows for s in real), planned_rows=sum(s.planned_rows for s in real),
        padding_rows=sum(s.padding_rows for s in real), tier=max(s.tier for s in real),
        budget=None if None in budgets else sum(b for b in budgets if b is not None),
        tau=None if None in taus else sum(t for t in taus if t is not None),
        seconds=max(s.seconds for s in real))
