"""The inputs of `dspark report`, read and validated before anything is written.

Run directories (`dspark run --record`), an STS calibration file, a `dspark profile` result with
tables to compare against it, and `benchmarks/bench_modes.py --json` outputs. Each file is read
through its format module (`dspark.formats`), so an error names the file (and line) and field the
same way the command that wrote it would.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dspark.formats.json_io import FormatError, int_field, number_field, read_json_file, typed_field
from dspark.formats.profile import ProfileResult
from dspark.formats.run_info import RunInfo, read_run_info
from dspark.formats.step_records import StepRecord, read_steps
from dspark.formats.sts_calibration import CalibrationFileContents, read_calibration
from dspark.formats.sts_shards import SHARD_SUFFIX, read_shards, read_sts_meta
from dspark.modes import VerifyMode
from dspark.runtime.planner.cost_models import CostModel, load_cost_model

PathLike = str | os.PathLike[str]


class ReportError(ValueError):
    """A report input is missing or malformed; the message names the file (and line) and what to do."""


def unique_labels(paths: Sequence[Path]) -> list[str]:
    """Short names (`sps_1d`, `runs/a`): the stem or dir name, widened with parents where it collides."""
    for depth in range(1, 1 + max((len(p.parts) for p in paths), default=1)):
        labels = ["/".join(p.with_suffix("").parts[-depth:]) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


@dataclass(frozen=True)
class StsSamples:
    """`(logits, prefix_mask)` rows a run recorded for STS, all shards concatenated in file-name order."""

    logits: np.ndarray  # [n, gamma] float64
    prefix_mask: np.ndarray  # [n, gamma] bool
    policy: str
    skipped_requests: int
    skip_reason: str | None


@dataclass(frozen=True)
class RunData:
    """A recorded run directory: `run.json`, `steps.jsonl` and, when recorded, the `sts/` shards."""

    path: Path
    deployment: str
    verify_mode: VerifyMode
    backend: str
    device: str
    gamma: int
    lag_steps: int
    policy: str
    tiers: tuple[int, ...]
    target_only: bool
    stats: Mapping[str, Any]  # empty when the run did not finish
    steps: tuple[StepRecord, ...]
    sts: StsSamples | None

    @property
    def mode(self) -> str:
        return "target-only" if self.target_only else self.verify_mode


def _load_sts(sts_dir: Path, gamma: int, run_policy: str) -> StsSamples | None:
    meta = read_sts_meta(sts_dir)
    if not any(p.suffix == SHARD_SUFFIX for p in sts_dir.iterdir()):
        return None
    data = read_shards([sts_dir])
    if data.gamma != gamma:
        raise ReportError(f"{sts_dir}: the shards have gamma={data.gamma} but run.json says {gamma}")
    policy = (meta.policy if meta is not None else None) or run_policy
    return StsSamples(data.logits, data.prefix_mask, policy, meta.skipped_requests if meta else 0,
                      meta.skip_reason if meta else None)


def load_run(path: PathLike) -> RunData:
    """Read and validate a run directory; errors name the file (and line, for `steps.jsonl`)."""
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"{path}: not a run directory; pass a directory written by `dspark run --record`")
    try:
        info: RunInfo = read_run_info(path)
        steps = read_steps(path / "steps.jsonl", info.gamma)
        sts = _load_sts(path / "sts", info.gamma, info.policy) if (path / "sts").is_dir() else None
    except FormatError as err:
        raise ReportError(str(err)) from None
    return RunData(path=path, deployment=info.deployment, verify_mode=info.verify_mode,
                   backend=info.backend or "?", device=info.device or "?", gamma=info.gamma,
                   lag_steps=info.lag_steps, policy=info.policy, tiers=tuple(sorted(info.tiers)),
                   target_only=info.target_only, stats=info.stats or {}, steps=steps, sts=sts)


_BENCH_KEYS = ("package", "mode", "tokens_per_s", "mean_commit_len", "rows_per_request_step",
               "padding_rows_per_request_step", "planned_rows_per_request_step", "predicted_tau_per_step",
               "committed_per_step", "lossless", "ratio_to_first")


@dataclass(frozen=True)
class BenchFile:
    """`benchmarks/bench_modes.py --json` output; `results` keep the script's keys."""

    path: Path
    prompts: int
    max_new_tokens: int
    max_running_requests: int | None
    results: tuple[Mapping[str, Any], ...]


def load_bench(path: PathLike) -> BenchFile:
    path = Path(path)
    hint = "pass the output of `benchmarks/bench_modes.py ... --json`"
    where = str(path)
    try:
        data = read_json_file(path, "bench result", hint)
        if not isinstance(data, dict):
            raise ReportError(f"{where}: must be a JSON object; {hint}")
        results = typed_field(data, "results", (list,), where)
        if not results:
            raise ReportError(f"{where}: results is empty; {hint}")
        for i, row in enumerate(results):
            at = f"{where}: results[{i}]"
            if not isinstance(row, dict):
                raise ReportError(f"{at}: must be a JSON object")
            missing = [key for key in _BENCH_KEYS if key not in row]
            if missing:
                raise ReportError(f"{at}: missing {missing}; re-run the bench with this dspark version")
            number_field(row, "tokens_per_s", at)
        return BenchFile(path, int_field(data, "prompts", where), int_field(data, "max_new_tokens", where),
                         int_field(data, "max_running_requests", where, nullable=True), tuple(results))
    except FormatError as err:
        raise ReportError(str(err)) from None


@dataclass(frozen=True)
class ReportInputs:
    """Everything the report reads; every input is optional."""

    runs: tuple[RunData, ...] = ()
    calibration: CalibrationFileContents | None = None
    calibration_path: Path | None = None
    profile: ProfileResult | None = None
    profile_path: Path | None = None
    tables: tuple[tuple[str, CostModel], ...] = ()  # (name, cost model)
    bench: tuple[BenchFile, ...] = ()

    @property
    def tiers(self) -> tuple[int, ...]:
        """The graph tiers of the profile when it records them, else every tier any run used."""
        if self.profile is not None and self.profile.tiers:
            return self.profile.tiers
        return tuple(sorted({t for run in self.runs for t in run.tiers}))


def load_inputs(run_dirs: Sequence[PathLike] = (), calibration: PathLike | None = None,
                profile: PathLike | None = None, tables: Sequence[PathLike] = (),
                bench: Sequence[PathLike] = ()) -> ReportInputs:
    """Load and validate every input before anything is written."""
    try:
        profile_result = None if profile is None else ProfileResult.load(profile)
        paths = [Path(t) for t in tables]
        models = tuple((name, load_cost_model(path)) for path, name in zip(paths, unique_labels(paths),
                                                                              strict=True))
        cal = None if calibration is None else read_calibration(calibration)
    except FormatError as err:
        raise ReportError(str(err)) from None
    return ReportInputs(
        runs=tuple(load_run(d) for d in run_dirs), calibration=cal,
        calibration_path=None if calibration is None else Path(calibration),
        profile=profile_result, profile_path=None if profile is None else Path(profile),
        tables=models, bench=tuple(load_bench(b) for b in bench))
