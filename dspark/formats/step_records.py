"""Step records: the one definition of `steps.jsonl`, the bounded ring of a recording's decode steps.

Each line is one decode step as a JSON object (`StepRecord.to_json`); the engine builds the record
(`dspark.runtime.engine.step_record`), `StepRing` keeps the last `capacity` of them and numbers them,
and `read_steps` gives them back to the report with errors naming the file, line and field.

`tau`, `budget`, `decision_tau` and `predicted_step_seconds` are null where no planner ran (static
mode); a request's `confidence` is null when the draft has no confidence head, and its `survival`
when the step computed none (a static recording made before static runs computed survival).
`accept_prob` (absent in recordings made before it) is each draft's acceptance probability given the
drafts before it accepted: `min(1, p/q)` under rejection sampling, 0 or 1 greedy; `dspark simulate`
plans with it for the `informed` bound.
docs/formats.md lists the fields.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dspark.atomic import atomic_write_text
from dspark.formats.json_io import (
    FormatError,
    errors_as,
    int_field,
    number_field,
    number_list,
    reject_unknown,
    require_object,
    typed_field,
)
from dspark.modes import VerifyMode


class StepRecordError(FormatError):
    """A step record or a `steps.jsonl` line is malformed; the message names the file, line and field."""


VERIFY_MODES = tuple(mode.value for mode in VerifyMode)


def verify_mode(data: Mapping[str, Any], where: str, key: str = "mode") -> VerifyMode:
    """A verify-mode field: one of `VERIFY_MODES`."""
    mode = typed_field(data, key, (str,), where)
    if mode not in VERIFY_MODES:
        raise StepRecordError(f"{where}: {key} must be one of {list(VERIFY_MODES)}, got {mode!r}")
    return VerifyMode(mode)


_REQUEST_KEYS = ("slot", "generation", "verify_len", "correct_len", "raw_correct_len", "commit_len",
                 "confidence", "survival", "accept_prob")


@dataclass(frozen=True)
class RequestRecord:
    """One request of one decode step."""

    slot: int
    generation: int
    verify_len: int  # rows planned, root included (the cap on acceptance)
    correct_len: int  # drafts accepted
    raw_correct_len: int  # drafts the uncapped match (or the sampler) would have accepted
    commit_len: int  # tokens committed: correct_len + 1
    confidence: tuple[float, ...] | None  # raw confidence logits per draft position
    survival: tuple[float, ...] | None  # survival per draft position
    # P(draft k accepted | drafts before it accepted), per position: min(1, p/q) sampled, 0/1 greedy
    accept_prob: tuple[float, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"slot": self.slot, "generation": self.generation, "verify_len": self.verify_len,
               "correct_len": self.correct_len, "raw_correct_len": self.raw_correct_len,
               "commit_len": self.commit_len,
               "confidence": None if self.confidence is None else list(self.confidence),
               "survival": None if self.survival is None else list(self.survival)}
        if self.accept_prob is not None:
            out["accept_prob"] = list(self.accept_prob)
        return out

    @classmethod
    @errors_as(StepRecordError)
    def from_json(cls, data: Any, gamma: int, where: str) -> RequestRecord:
        data = require_object(data, where, "a request")
        reject_unknown(data, _REQUEST_KEYS, where)
        ints = {key: int_field(data, key, where) for key in _REQUEST_KEYS[:6]}
        if not 1 <= ints["verify_len"] <= gamma + 1:
            raise StepRecordError(f"{where}: verify_len {ints['verify_len']} is outside "
                                  f"[1, gamma+1={gamma + 1}]")
        accept_prob = None
        if "accept_prob" in data:
            accept_prob = number_list(data, "accept_prob", where, gamma, nullable=True)
            if accept_prob is not None and not all(0.0 <= a <= 1.0 for a in accept_prob):
                raise StepRecordError(f"{where}: accept_prob must hold probabilities in [0, 1], got "
                                      f"{list(accept_prob)}")
        return cls(**ints, confidence=number_list(data, "confidence", where, gamma, nullable=True),
                   survival=number_list(data, "survival", where, gamma, nullable=True),
                   accept_prob=accept_prob)


_STEP_KEYS = ("step", "num_reqs", "lag", "mode", "budget", "aligned_budget", "decision_tau", "planned_rows",
              "rows", "tier", "padding_rows", "tau", "committed", "predicted_step_seconds", "step_seconds",
              "requests", "probe", "off_steps", "off_seconds", "offset_seconds", "temperatures",
              "context_len", "offset_slope", "cost_refit")


@dataclass(frozen=True)
class StepRecord:
    """One decode step: the batch, the planner's decision and prediction, and what happened."""

    num_reqs: int
    lag: int  # the plan's lag_steps
    mode: VerifyMode
    budget: int | None  # extra rows the planner chose (None: no planner)
    aligned_budget: int | None  # the budget after graph-tier alignment, when it applied
    decision_tau: float | None  # tau of the chosen budget, on the survival it was chosen from
    planned_rows: int  # sum of verify_lens
    rows: int  # rows the target ran for the real requests
    tier: int  # rows the step ran, padding included
    padding_rows: int
    tau: float | None  # predicted committed tokens of the rows allocated
    committed: int  # tokens committed
    predicted_step_seconds: float | None  # the table's price of the rows that ran (offset included)
    step_seconds: float  # measured wall time of the step
    requests: tuple[RequestRecord, ...]
    step: int | None = None  # index among the run's decode steps, given by the ring that records it
    # The planner's off state: the step drafted while speculation was off (a probe), and the steps
    # decoded without speculation since the previous drafted step, with their seconds.
    probe: bool = False
    off_steps: int = 0
    off_seconds: float = 0.0
    # The measured step offset the planner added to every price it weighed (`predicted_step_seconds`
    # includes it); absent, 0, in recordings made before the planner measured it.
    offset_seconds: float = 0.0
    # The STS temperatures online calibration swapped into the plan before this step (absent: no swap).
    temperatures: tuple[float, ...] | None = None
    # The batch's mean cached tokens a request, the context the step was priced at (absent in recordings
    # made before the planner priced the context).
    context_len: float | None = None
    # The step offset's slope `a` (measured ~ a * priced, the fixed part already in the price): the
    # planner's whole prediction of the step's seconds is `offset_slope * predicted_step_seconds` (absent in
    # older recordings: 1).
    offset_slope: float = 1.0
    # The number (1, 2, ...) of the online cost refit whose table was swapped into the plan before this step
    # (absent: no swap since the previous drafted step).
    cost_refit: int | None = None

    def to_json(self) -> dict[str, Any]:
        if self.step is None:
            raise StepRecordError("a step record is written with its index; append it to a StepRing")
        return {"step": self.step, "num_reqs": self.num_reqs, "lag": self.lag, "mode": self.mode,
                "budget": self.budget, "aligned_budget": self.aligned_budget,
                "decision_tau": self.decision_tau,
                "planned_rows": self.planned_rows, "rows": self.rows, "tier": self.tier,
                "padding_rows": self.padding_rows, "tau": self.tau, "committed": self.committed,
                "predicted_step_seconds": self.predicted_step_seconds, "step_seconds": self.step_seconds,
                "requests": [r.to_json() for r in self.requests], "probe": self.probe,
                "off_steps": self.off_steps, "off_seconds": self.off_seconds,
                "offset_seconds": self.offset_seconds,
                **({} if self.context_len is None else {"context_len": self.context_len}),
                "offset_slope": self.offset_slope,
                **({} if self.temperatures is None else {"temperatures": list(self.temperatures)}),
                **({} if self.cost_refit is None else {"cost_refit": self.cost_refit})}

    @classmethod
    @errors_as(StepRecordError)
    def from_json(cls, data: Any, gamma: int, where: str) -> StepRecord:
        data = require_object(data, where, "a step")
        reject_unknown(data, _STEP_KEYS, where)
        raw_requests = typed_field(data, "requests", (list,), where)
        requests = tuple(RequestRecord.from_json(r, gamma, f"{where}: requests[{i}]")
                         for i, r in enumerate(raw_requests))
        num_reqs = int_field(data, "num_reqs", where, minimum=1)
        if len(requests) != num_reqs:
            raise StepRecordError(f"{where}: num_reqs is {num_reqs} but requests has {len(requests)} entries")
        step_seconds = number_field(data, "step_seconds", where)
        if step_seconds < 0:
            raise StepRecordError(f"{where}: step_seconds must be >= 0, got {step_seconds}")
        return cls(
            step=int_field(data, "step", where), num_reqs=num_reqs, lag=int_field(data, "lag", where),
            mode=verify_mode(data, where), budget=int_field(data, "budget", where, nullable=True),
            aligned_budget=int_field(data, "aligned_budget", where, nullable=True),
            decision_tau=number_field(data, "decision_tau", where, nullable=True),
            planned_rows=int_field(data, "planned_rows", where), rows=int_field(data, "rows", where),
            tier=int_field(data, "tier", where), padding_rows=int_field(data, "padding_rows", where),
            tau=number_field(data, "tau", where, nullable=True),
            committed=int_field(data, "committed", where),
            predicted_step_seconds=number_field(data, "predicted_step_seconds", where, nullable=True),
            step_seconds=step_seconds, requests=requests, **_off_state(data, where),
            offset_seconds=_optional_number(data, "offset_seconds", where, 0.0),
            temperatures=_temperatures(data, gamma, where),
            context_len=_optional_number(data, "context_len", where, None),
            offset_slope=_optional_number(data, "offset_slope", where, 1.0, positive=True),
            cost_refit=int_field(data, "cost_refit", where, minimum=1) if "cost_refit" in data else None)


def _optional_number(data: Mapping[str, Any], key: str, where: str, absent: float | None,
                     positive: bool = False) -> Any:
    """A number >= 0 (> 0 when `positive`) older recordings lack: `absent` there."""
    if key not in data:
        return absent
    value = number_field(data, key, where)
    if value < 0 or (positive and value == 0):
        raise StepRecordError(f"{where}: {key} must be {'> 0' if positive else '>= 0'}, got {value}")
    return value


def _temperatures(data: Mapping[str, Any], gamma: int, where: str) -> tuple[float, ...] | None:
    """A swap's temperatures (one per draft position, each > 0), where the record has one."""
    if "temperatures" not in data:
        return None
    values = number_list(data, "temperatures", where, gamma)
    assert values is not None
    if any(t <= 0 for t in values):
        raise StepRecordError(f"{where}: temperatures must all be > 0, got {list(values)}")
    return values


def _off_state(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The off-state fields, absent from recordings made before the planner could switch speculation off."""
    probe = data.get("probe", False)
    if not isinstance(probe, bool):
        raise StepRecordError(f"{where}: probe must be true or false, got {probe!r}")
    off_steps = int_field(data, "off_steps", where, minimum=0) if "off_steps" in data else 0
    return {"probe": probe, "off_steps": off_steps,
            "off_seconds": _optional_number(data, "off_seconds", where, 0.0)}


class StepRing:
    """The last `capacity` decode steps of a run, numbered in the order they were appended."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"record_steps must be >= 1 to record, got {capacity}")
        self.capacity = capacity
        self.records: deque[StepRecord] = deque(maxlen=capacity)
        self.total = 0

    def append(self, record: StepRecord) -> None:
        self.records.append(replace(record, step=self.total))
        self.total += 1

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write `steps.jsonl` (one compact JSON object per line) atomically."""
        lines = "".join(json.dumps(r.to_json(), separators=(",", ":"), allow_nan=False) + "\n"
                        for r in self.records)
        return atomic_write_text(path, lines)


@errors_as(StepRecordError)
def read_steps(path: str | os.PathLike[str], gamma: int) -> tuple[StepRecord, ...]:
    """Every step of a `steps.jsonl`; blank lines are skipped, errors name `file:line`."""
    path = Path(path)
    if not path.is_file():
        raise StepRecordError(f"{path}: steps file not found; record the run with "
                              "`dspark run ... --record DIR`")
    steps = []
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as err:
                raise StepRecordError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); each line "
                                      "must be one step object — a truncated last line means the run was "
                                      "interrupted, delete that line") from None
            steps.append(StepRecord.from_json(data, gamma, where))
    return tuple(steps)

