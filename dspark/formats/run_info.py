"""`run.json`: the one definition of what a recording says about its run, with reader and writer.

`dspark run --record DIR` writes it when the run ends (also when it is stopped): the deployment, its
verify mode, backend and device, gamma, lag, the sampling policy the run decoded with, the graph tiers,
whether it decoded target-only, the deployment's fingerprint, the run's counters (`stats`, free-form:
the runtime's `RunStats.to_json`, null when the run failed before finishing) and how many steps the
ring kept. The report reads it through `read_run_info` (docs/formats.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.formats.json_io import (
    FormatError,
    errors_as,
    int_field,
    int_list,
    read_json_file,
    reject_unknown,
    require_object,
    typed_field,
    write_json_file,
)
from dspark.formats.step_records import verify_mode
from dspark.modes import VerifyMode

RUN_FORMAT = "dspark-run"
RUN_VERSION = 1
RUN_FILE = "run.json"


class RunInfoError(FormatError):
    """A run.json is unreadable or malformed; the message names the file and field."""


_KEYS = ("format", "version", "deployment", "verify_mode", "backend", "device", "gamma", "lag_steps",
         "policy", "tiers", "target_only", "fingerprint", "stats", "recorded_steps", "total_steps")


@dataclass(frozen=True)
class RunInfo:
    """A recorded run's description (`run.json`)."""

    deployment: str
    verify_mode: VerifyMode
    gamma: int
    lag_steps: int
    policy: str  # the sampling policy the run decoded with: what its labels describe
    tiers: tuple[int, ...]
    target_only: bool
    backend: str | None = None
    device: str | None = None
    fingerprint: Mapping[str, Any] | None = None
    stats: Mapping[str, Any] | None = None  # the run's counters; None when the run did not finish
    recorded_steps: int | None = None  # steps in steps.jsonl (the ring keeps the last ones)
    total_steps: int | None = None  # decode steps the run took

    def to_json(self) -> dict[str, Any]:
        return {"format": RUN_FORMAT, "version": RUN_VERSION, "deployment": self.deployment,
                "verify_mode": self.verify_mode, "backend": self.backend, "device": self.device,
                "gamma": self.gamma, "lag_steps": self.lag_steps, "policy": self.policy,
                "tiers": list(self.tiers), "target_only": self.target_only,
                "fingerprint": None if self.fingerprint is None else dict(self.fingerprint),
                "stats": None if self.stats is None else dict(self.stats),
                "recorded_steps": self.recorded_steps, "total_steps": self.total_steps}

    @classmethod
    @errors_as(RunInfoError)
    def from_json(cls, data: Any, where: str) -> RunInfo:
        data = require_object(data, where, "run.json")
        if data.get("format") != RUN_FORMAT:
            raise FormatError(f"{where}: not a dspark run (format must be {RUN_FORMAT!r})")
        if data.get("version") != RUN_VERSION:
            raise FormatError(f"{where}: run format version {data.get('version')!r} is not supported (this "
                              f"dspark reads version {RUN_VERSION}); re-record the run")
        reject_unknown(data, _KEYS, where)
        return cls(
            deployment=typed_field(data, "deployment", (str,), where),
            verify_mode=verify_mode(data, where, "verify_mode"),
            gamma=int_field(data, "gamma", where, minimum=1), lag_steps=int_field(data, "lag_steps", where),
            policy=typed_field(data, "policy", (str,), where),
            tiers=int_list(data, "tiers", where, minimum=1),
            target_only=typed_field(data, "target_only", (bool,), where),
            backend=typed_field(data, "backend", (str,), where, nullable=True),
            device=typed_field(data, "device", (str,), where, nullable=True),
            fingerprint=typed_field(data, "fingerprint", (dict,), where, nullable=True),
            stats=typed_field(data, "stats", (dict,), where, nullable=True),
            recorded_steps=int_field(data, "recorded_steps", where, nullable=True),
            total_steps=int_field(data, "total_steps", where, nullable=True))


@errors_as(RunInfoError)
def read_run_info(directory: str | os.PathLike[str]) -> RunInfo:
    """The `run.json` of a recording directory, validated."""
    path = Path(directory) / RUN_FILE
    data = read_json_file(path, "run description", "record the run with `dspark run ... --record DIR`")
    return RunInfo.from_json(data, str(path))


def write_run_info(directory: str | os.PathLike[str], info: RunInfo) -> Path:
    """Write `run.json` into a recording directory, atomically."""
    return write_json_file(Path(directory) / RUN_FILE, info.to_json())
