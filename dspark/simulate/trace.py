"""The trace a simulation replays: every request-step of a recording in which every row ran.

A recording (`dspark run --record DIR`) holds per request-step the draft's raw confidence logits and
`raw_correct_len`, the uncapped number of matching drafts. Where every request ran all N rows
(static and cap-accept recordings) that number is exact, so any verify_len's outcome follows from it:
`correct_len = min(raw_correct_len, verify_len - 1)`. A compact recording ran only the planned rows
and knows nothing past them; it is refused.

The recorded `survival` is the recording deployment's (a static build is usually uncalibrated), not
the one the simulated deployment would plan with, so the trace keeps the raw logits and the
simulation computes survival with the simulated package's own temperatures.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark.formats.json_io import FormatError
from dspark.formats.run_info import RUN_FILE, RunInfo, read_run_info
from dspark.formats.step_records import StepRecord, read_steps
from dspark.measure.recording import STEPS_FILE
from dspark.modes import VerifyMode, num_draft_tokens


class TraceError(ValueError):
    """A recording cannot be replayed; the message names the file and the field."""


@dataclass(frozen=True)
class Trace:
    """Request-steps of a recording, one row each, in recorded order.

    `request` numbers each request lifetime (one (slot, generation) pair); `offset` is the tokens that
    request had committed before the step, so a replay can find the request-step at a position.
    """

    source: str
    gamma: int
    policy: str  # the sampling policy the labels belong to
    mode: VerifyMode
    confidence: np.ndarray  # float32 [n, gamma]: raw confidence logits
    raw_correct_len: np.ndarray  # int64 [n], 0..gamma
    step: np.ndarray  # int64 [n]: the recorded decode step
    request: np.ndarray  # int64 [n]
    offset: np.ndarray  # int64 [n]
    commit_len: np.ndarray  # int64 [n]: what the recorded step committed
    # float32 [n, gamma]: each draft's acceptance probability given its prefix (min(1, p/q) sampled,
    # 0/1 greedy), where every request-step recorded it (recordings made before the field: None)
    accept_prob: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = self.raw_correct_len.shape[0]
        if n == 0:
            raise TraceError(f"{self.source}: the recording holds no request-steps to replay")
        if self.confidence.shape != (n, self.gamma):
            raise TraceError(f"{self.source}: confidence has shape {self.confidence.shape}, expected "
                             f"({n}, gamma={self.gamma})")
        for name in ("step", "request", "offset", "commit_len"):
            if getattr(self, name).shape != (n,):
                raise TraceError(f"{self.source}: {name} has {getattr(self, name).shape[0]} entries for "
                                 f"{n} request-steps")
        if self.accept_prob is not None and self.accept_prob.shape != (n, self.gamma):
            raise TraceError(f"{self.source}: accept_prob has shape {self.accept_prob.shape}, expected "
                             f"({n}, gamma={self.gamma})")
        if int(self.raw_correct_len.min()) < 0 or int(self.raw_correct_len.max()) > self.gamma:
            raise TraceError(f"{self.source}: raw_correct_len must be in [0, gamma={self.gamma}]")

    @property
    def size(self) -> int:
        return int(self.raw_correct_len.shape[0])

    @property
    def sampled(self) -> bool:
        """The drafts were sampled: the planner's budget then reads each request's previous step
        (`AdaptiveVerifyPlan.plan_step`)."""
        return self.policy != "greedy"

    def budget_lag(self, lag_steps: int) -> int:
        """How many steps back the adaptive budget reads: the plan's lag, or 1 for sampled drafts."""
        return lag_steps or int(self.sampled)

    @property
    def num_draft_tokens(self) -> int:
        return num_draft_tokens(self.gamma)

    def lag_source(self, lag_steps: int) -> np.ndarray:
        """For each request-step, the row of the same request `lag_steps` recorded steps earlier, or -1
        (the request had not started): what an overlapped scheduler's budget would have read."""
        if lag_steps == 0:
            return np.arange(self.size)
        index = {(int(s), int(r)): i for i, (s, r) in enumerate(zip(self.step, self.request, strict=True))}
        return np.array([index.get((int(s) - lag_steps, int(r)), -1)
                         for s, r in zip(self.step, self.request, strict=True)], dtype=np.int64)


def _check_request_steps(steps: Sequence[StepRecord], gamma: int, where: str) -> None:
    n = num_draft_tokens(gamma)
    for step in steps:
        at = f"{where}: step {step.step}"
        if step.mode.packs_rows:
            raise TraceError(f"{at}: mode is {step.mode}: a compact step ran only the planned rows, so "
                             "raw_correct_len past them is unknown; record a static build "
                             "(`dspark run generated/<name>_static --record DIR`)")
        for i, req in enumerate(step.requests):
            field = f"{at}, requests[{i}]"
            if req.confidence is None:
                raise TraceError(f"{field}: confidence is null; the adaptive planner needs the draft's "
                                 "confidence logits, so record with a draft that has a confidence head")
            if not 0 <= req.raw_correct_len <= gamma:
                raise TraceError(f"{field}: raw_correct_len {req.raw_correct_len} is outside "
                                 f"[0, gamma={gamma}]")
            if req.correct_len != min(req.raw_correct_len, req.verify_len - 1):
                raise TraceError(f"{field}: correct_len {req.correct_len} is not min(raw_correct_len="
                                 f"{req.raw_correct_len}, verify_len - 1 = {req.verify_len - 1}); the "
                                 "record is inconsistent")
            if req.commit_len != req.correct_len + 1:
                raise TraceError(f"{field}: commit_len {req.commit_len} is not correct_len + 1 = "
                                 f"{req.correct_len + 1}; the record is inconsistent")
            if step.mode is VerifyMode.STATIC and req.verify_len != n:
                raise TraceError(f"{field}: verify_len {req.verify_len} in a static step; a static step "
                                 f"verifies all N = {n} rows")


def trace_from_steps(steps: Sequence[StepRecord], gamma: int, policy: str, source: str) -> Trace:
    """The trace of validated step records (recorded order); `source` starts every error."""
    if not steps:
        raise TraceError(f"{source}: the recording holds no decode steps (a target-only run, or one "
                         "stopped before its first step); record a speculative run")
    _check_request_steps(steps, gamma, source)
    lifetimes: dict[tuple[int, int], int] = {}
    committed: dict[int, int] = {}
    confidence, raw, step_index, request, offset, commit = [], [], [], [], [], []
    accept: list[tuple[float, ...] | None] = []
    for step in steps:
        for req in step.requests:
            rid = lifetimes.setdefault((req.slot, req.generation), len(lifetimes))
            confidence.append(req.confidence)
            accept.append(req.accept_prob)
            raw.append(req.raw_correct_len)
            step_index.append(step.step)
            request.append(rid)
            offset.append(committed.get(rid, 0))
            commit.append(req.commit_len)
            committed[rid] = committed.get(rid, 0) + req.commit_len
    return Trace(source=source, gamma=gamma, policy=policy, mode=steps[0].mode,
                 confidence=np.array(confidence, dtype=np.float32),
                 raw_correct_len=np.array(raw, dtype=np.int64), step=np.array(step_index, dtype=np.int64),
                 request=np.array(request, dtype=np.int64), offset=np.array(offset, dtype=np.int64),
                 commit_len=np.array(commit, dtype=np.int64),
                 accept_prob=(np.array(accept, dtype=np.float32) if all(a is not None for a in accept)
                              else None))


def recording_dir(path: str | os.PathLike[str]) -> Path:
    """The recording directory of `path` (the directory itself, or its steps.jsonl / run.json)."""
    path = Path(path)
    return path.parent if path.name in (STEPS_FILE, RUN_FILE) and path.is_file() else path


def read_run(path: str | os.PathLike[str]) -> RunInfo:
    """The recording's run.json, refused unless every request of the run ran all rows."""
    directory = recording_dir(path)
    if not directory.is_dir():
        raise TraceError(f"{directory}: no such recording directory; record one with "
                         "`dspark run PACKAGE --prompts-file P --record DIR`")
    try:
        info = read_run_info(directory)
    except FormatError as err:
        raise TraceError(str(err)) from None
    where = directory / RUN_FILE
    if info.target_only:
        raise TraceError(f"{where}: target_only is true: a target-only run verifies no drafts; record a "
                         "speculative run")
    if info.verify_mode.packs_rows:
        raise TraceError(f"{where}: verify_mode is {info.verify_mode}: a compact run verified only the "
                         "planned rows, so what later drafts would have matched is unknown; record a static "
                         "build of the deployment")
    return info


def read_trace(path: str | os.PathLike[str], info: RunInfo | None = None) -> Trace:
    """The trace of a recording directory (`run.json` + `steps.jsonl`), with errors naming file and
    field for anything a replay cannot use. `info`: its run.json, when the caller has already read it
    with `read_run` (to check the recording against a package before reading its steps)."""
    directory = recording_dir(path)
    if info is None:
        info = read_run(directory)
    steps_path = directory / STEPS_FILE
    try:
        steps = read_steps(steps_path, info.gamma)
    except FormatError as err:
        raise TraceError(str(err)) from None
    if info.recorded_steps is not None and info.recorded_steps != len(steps):
        raise TraceError(f"{directory / RUN_FILE}: recorded_steps is {info.recorded_steps} but {steps_path} "
                         f"holds {len(steps)} steps; the recording is incomplete")
    return trace_from_steps(steps, info.gamma, info.policy, str(steps_path))
