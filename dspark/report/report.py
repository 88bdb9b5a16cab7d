"""`dspark report`: one Markdown report, with PNG plots, of the measurements a deployment needs (DESIGN §6).

Inputs are files other commands wrote: run directories (`dspark run --record`), an STS calibration file, a
`dspark profile` result with the cost tables fitted from it, and `benchmarks/bench_modes.py --json` outputs.
Each section of the report appears only when its inputs exist:

- Runs: summary per run and, per draft position, accepted / verified drafts (the one measured acceptance
  figure; `tau` and `(AL-1)/gamma` are predictions or averages and are never reported as one).
- Calibration: reliability of the conditional confidence and of the cumulative survival, before and after STS.
- tau vs actual: bias of the planner's predicted committed tokens by batch size, lag, policy and tier.
- Cost model vs measurement: profiled step times against each table, error near graph tiers.
- Throughput: bench results, and the fewest verify rows that would have committed the same tokens.

Loading validates and names the file (and line) at fault; the table functions are pure; plotting lives in
`report_plots` and only draws what is computed here.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dspark.atomic import atomic_write_text
from dspark.measure import calibration as cal

__all__ = [
    "BenchFile", "BiasRow", "CalibrationGroup", "CostPanel", "OracleRow", "Reliability", "ReportError",
    "ReportInputs", "RequestRecord", "ResidualRow", "RunData", "RunSummary", "StepRecord", "StsCalibration",
    "StsSamples", "bias_by_batch_and_lag", "bias_tables", "calibration_groups",
    "cost_panels", "load_bench", "load_calibration", "load_inputs", "load_run", "oracle_rows",
    "predict_seconds", "reliability", "render_report", "residual_table", "run_summaries",
    "write_report",
]

RUN_FORMAT = "dspark-run"
RUN_VERSION = 1
VERIFY_MODES = ("static", "cap-accept", "compact")
NUM_BINS = 15
TIER_RADIUS = 2
REPORT_FILE = "report.md"


class ReportError(ValueError):
    """A report input is missing or malformed; the message names the file (and line) and what to do."""


# --------------------------------------------------------------------------------------------- loading


def _field(data: Mapping[str, Any], key: str, types: tuple[type, ...], where: str, *,
           nullable: bool = False) -> Any:
    """`data[key]` checked against `types`; a nullable field may also be missing."""
    if key not in data:
        if nullable:
            return None
        raise ReportError(f"{where}: missing field {key!r}")
    value = data[key]
    if value is None and nullable:
        return None
    # JSON `true` is a bool, which Python also counts as an int; a count that is `true` is a writer bug.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = " or ".join(t.__name__ for t in types) + (" or null" if nullable else "")
        raise ReportError(f"{where}: field {key!r} must be {names}, got {repr(value)[:60]}")
    return float(value) if float in types and not isinstance(value, bool) else value


def _int(data: Mapping[str, Any], key: str, where: str, *, nullable: bool = False,
         minimum: int | None = 0) -> int | None:
    value = _field(data, key, (int,), where, nullable=nullable)
    if value is not None and minimum is not None and value < minimum:
        raise ReportError(f"{where}: field {key!r} must be >= {minimum}, got {value}")
    return value


def _num(data: Mapping[str, Any], key: str, where: str, *, nullable: bool = False) -> float | None:
    value = _field(data, key, (int, float), where, nullable=nullable)
    if value is not None and not math.isfinite(value):
        raise ReportError(f"{where}: field {key!r} must be a finite number, got {value}")
    return value


def _floats(data: Mapping[str, Any], key: str, where: str, length: int | None = None) -> tuple[float, ...]:
    values = _field(data, key, (list,), where)
    if length is not None and len(values) != length:
        raise ReportError(f"{where}: field {key!r} has {len(values)} values, expected gamma={length}")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad:
        raise ReportError(f"{where}: field {key!r} must hold numbers, got {repr(bad[0])[:40]}")
    return tuple(float(v) for v in values)


def _read_json(path: Path, what: str, hint: str) -> Any:
    if not path.is_file():
        raise ReportError(f"{path}: {what} not found; {hint}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ReportError(f"{path}:{err.lineno}: not valid JSON ({err.msg}); {hint}") from None


@dataclass(frozen=True)
class RequestRecord:
    """One request of one decode step, as `steps.jsonl` records it."""

    slot: int
    generation: int
    verify_len: int
    correct_len: int
    raw_correct_len: int
    commit_len: int
    confidence: tuple[float, ...]
    survival: tuple[float, ...]


@dataclass(frozen=True)
class StepRecord:
    """One decode step (a line of `steps.jsonl`). `tau` and `predicted_step_seconds` are None when static."""

    step: int
    num_reqs: int
    lag: int
    mode: str
    budget: int | None
    aligned_budget: int | None
    decision_tau: float | None
    planned_rows: int
    rows: int
    tier: int
    padding_rows: int
    tau: float | None
    committed: int
    predicted_step_seconds: float | None
    step_seconds: float
    requests: tuple[RequestRecord, ...]


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
    verify_mode: str
    backend: str
    device: str
    gamma: int
    lag_steps: int
    policy: str
    tiers: tuple[int, ...]
    target_only: bool
    stats: Mapping[str, Any]
    steps: tuple[StepRecord, ...]
    sts: StsSamples | None

    @property
    def mode(self) -> str:
        return "target-only" if self.target_only else self.verify_mode


def _parse_request(obj: Any, gamma: int, where: str) -> RequestRecord:
    if not isinstance(obj, dict):
        raise ReportError(f"{where}: must be a JSON object, got {type(obj).__name__}")
    ints = {key: _int(obj, key, where) for key in ("slot", "generation", "verify_len", "correct_len",
                                                   "raw_correct_len", "commit_len")}
    if not 1 <= ints["verify_len"] <= gamma + 1:
        raise ReportError(f"{where}: verify_len {ints['verify_len']} is outside [1, gamma+1={gamma + 1}]")
    return RequestRecord(**ints, confidence=_floats(obj, "confidence", where, gamma),
                         survival=_floats(obj, "survival", where, gamma))


def _parse_step(obj: Any, gamma: int, where: str) -> StepRecord:
    if not isinstance(obj, dict):
        raise ReportError(f"{where}: a step must be a JSON object, got {type(obj).__name__}")
    raw_requests = _field(obj, "requests", (list,), where)
    requests = tuple(_parse_request(r, gamma, f"{where}: requests[{i}]") for i, r in enumerate(raw_requests))
    num_reqs = _int(obj, "num_reqs", where, minimum=1)
    if len(requests) != num_reqs:
        raise ReportError(f"{where}: num_reqs is {num_reqs} but requests has {len(requests)} entries")
    step_seconds = _num(obj, "step_seconds", where)
    if step_seconds < 0:
        raise ReportError(f"{where}: step_seconds must be >= 0, got {step_seconds}")
    return StepRecord(
        step=_int(obj, "step", where), num_reqs=num_reqs, lag=_int(obj, "lag", where),
        mode=_field(obj, "mode", (str,), where), budget=_int(obj, "budget", where, nullable=True),
        aligned_budget=_int(obj, "aligned_budget", where, nullable=True),
        decision_tau=_num(obj, "decision_tau", where, nullable=True),
        planned_rows=_int(obj, "planned_rows", where), rows=_int(obj, "rows", where),
        tier=_int(obj, "tier", where), padding_rows=_int(obj, "padding_rows", where),
        tau=_num(obj, "tau", where, nullable=True), committed=_int(obj, "committed", where),
        predicted_step_seconds=_num(obj, "predicted_step_seconds", where, nullable=True),
        step_seconds=step_seconds, requests=requests)


def _load_steps(path: Path, gamma: int) -> tuple[StepRecord, ...]:
    if not path.is_file():
        raise ReportError(f"{path}: steps file not found; record the run with `dspark run ... --record DIR`")
    steps = []
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ReportError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); each line "
                                  "must be one step object — a truncated last line means the run was "
                                  "interrupted, delete that line") from None
            steps.append(_parse_step(obj, gamma, where))
    return tuple(steps)


def _load_sts(sts_dir: Path, gamma: int, run_policy: str) -> StsSamples | None:
    shards = sorted(sts_dir.glob("*.pt"))
    meta_path = sts_dir / "meta.json"
    meta: Mapping[str, Any] = {}
    if meta_path.exists():
        meta = _read_json(meta_path, "STS meta", "re-record the run")
        if not isinstance(meta, dict):
            raise ReportError(f"{meta_path}: must be a JSON object")
    if not shards:
        return None
    try:
        data = cal.load_shards([sts_dir])
    except cal.CalibrationError as err:
        raise ReportError(str(err)) from None
    if data.gamma != gamma:
        raise ReportError(f"{sts_dir}: the shards have gamma={data.gamma} but run.json says {gamma}")
    where = str(meta_path)
    policy = _field(meta, "policy", (str,), where, nullable=True) or run_policy
    skipped = _int(meta, "skipped_requests", where, nullable=True) or 0
    reason = _field(meta, "skip_reason", (str,), where, nullable=True)
    return StsSamples(data.logits, data.prefix_mask, policy, skipped, reason)


def load_run(path: str | os.PathLike[str]) -> RunData:
    """Read and validate a run directory; errors name the file (and line, for `steps.jsonl`)."""
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"{path}: not a run directory; pass a directory written by `dspark run --record`")
    run_json = path / "run.json"
    data = _read_json(run_json, "run description", "record the run with `dspark run ... --record DIR`")
    where = str(run_json)
    if not isinstance(data, dict) or data.get("format") != RUN_FORMAT:
        raise ReportError(f"{where}: not a dspark run (format must be {RUN_FORMAT!r})")
    if data.get("version") != RUN_VERSION:
        raise ReportError(f"{where}: run format version {data.get('version')!r} is not supported (this "
                          f"report reads version {RUN_VERSION}); re-record the run")
    mode = _field(data, "verify_mode", (str,), where)
    if mode not in VERIFY_MODES:
        raise ReportError(f"{where}: verify_mode must be one of {list(VERIFY_MODES)}, got {mode!r}")
    gamma = _int(data, "gamma", where, minimum=1)
    tiers = _field(data, "tiers", (list,), where)
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tiers):
        raise ReportError(f"{where}: tiers must be a list of row counts >= 1, got {tiers!r}")
    policy = _field(data, "policy", (str,), where)
    sts_dir = path / "sts"
    return RunData(
        path=path, deployment=_field(data, "deployment", (str,), where), verify_mode=mode,
        backend=_field(data, "backend", (str,), where, nullable=True) or "?",
        device=_field(data, "device", (str,), where, nullable=True) or "?", gamma=gamma,
        lag_steps=_int(data, "lag_steps", where), policy=policy, tiers=tuple(sorted(tiers)),
        target_only=_field(data, "target_only", (bool,), where), stats=_field(data, "stats", (dict,), where),
        steps=_load_steps(path / "steps.jsonl", gamma),
        sts=_load_sts(sts_dir, gamma, policy) if sts_dir.is_dir() else None)


@dataclass(frozen=True)
class StsCalibration:
    """An STS calibration file: per-position temperatures and the ECE the fit itself reported."""

    path: Path
    temperatures: tuple[float, ...]
    dataset: str | None
    num_samples: int | None
    ece_before: tuple[float, ...] | None
    ece_after: tuple[float, ...] | None


def load_calibration(path: str | os.PathLike[str]) -> StsCalibration:
    path = Path(path)
    data = _read_json(path, "STS calibration", "pass the JSON file the STS fit wrote")
    where = str(path)
    if not isinstance(data, dict):
        raise ReportError(f"{where}: an STS calibration must be a JSON object with 'temperatures'")
    temps = _floats(data, "temperatures", where)
    if not temps or any(not math.isfinite(t) or t <= 0 for t in temps):
        raise ReportError(f"{where}: temperatures must be a non-empty list of finite numbers > 0, got "
                          f"{list(temps)}")
    ece = {key: _floats(data, key, where) if data.get(key) is not None else None
           for key in ("ece_before", "ece_after")}
    return StsCalibration(path, temps, _field(data, "dataset", (str,), where, nullable=True),
                          _int(data, "num_samples", where, nullable=True), **ece)


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


def load_bench(path: str | os.PathLike[str]) -> BenchFile:
    path = Path(path)
    hint = "pass the output of `benchmarks/bench_modes.py ... --json`"
    data = _read_json(path, "bench result", hint)
    where = str(path)
    if not isinstance(data, dict):
        raise ReportError(f"{where}: must be a JSON object; {hint}")
    results = _field(data, "results", (list,), where)
    if not results:
        raise ReportError(f"{where}: results is empty; {hint}")
    for i, row in enumerate(results):
        at = f"{where}: results[{i}]"
        if not isinstance(row, dict):
            raise ReportError(f"{at}: must be a JSON object")
        missing = [key for key in _BENCH_KEYS if key not in row]
        if missing:
            raise ReportError(f"{at}: missing {missing}; re-run the bench with this dspark version")
        _num(row, "tokens_per_s", at)
    return BenchFile(path, _int(data, "prompts", where), _int(data, "max_new_tokens", where),
                     _int(data, "max_running_requests", where, nullable=True), tuple(results))


@dataclass(frozen=True)
class ReportInputs:
    """Everything the report reads; every input is optional."""

    runs: tuple[RunData, ...] = ()
    calibration: StsCalibration | None = None
    profile: Any = None  # dspark.measure.profiler.ProfileResult
    profile_path: Path | None = None
    tables: tuple[tuple[str, Any], ...] = ()  # (name, cost model): anything with step_time or lookup
    bench: tuple[BenchFile, ...] = ()


PathLike = str | os.PathLike[str]


def load_inputs(run_dirs: Sequence[PathLike] = (), calibration: PathLike | None = None,
                profile: PathLike | None = None, tables: Sequence[PathLike] = (),
                bench: Sequence[PathLike] = ()) -> ReportInputs:
    """Load and validate every input before anything is written."""
    profile_result = None
    if profile is not None:
        from dspark.measure.profiler import ProfileResult

        if not Path(profile).is_file():
            raise ReportError(f"{profile}: profile not found; pass the profile.json `dspark profile` wrote")
        try:
            profile_result = ProfileResult.load(profile)
        except (KeyError, TypeError, ValueError) as err:
            raise ReportError(f"{profile}: {err}") from None
    models = []
    if tables:
        from dspark.runtime.planner.cost_models import load_cost_model

        paths = [Path(t) for t in tables]
        for path, name in zip(paths, _unique_labels(paths), strict=True):
            model = load_cost_model(path)  # its errors already name the file
            if not (hasattr(model, "step_time") or hasattr(model, "lookup")):
                raise ReportError(f"{path}: a {type(model).__name__} has neither step_time nor lookup")
            models.append((name, model))
    return ReportInputs(
        runs=tuple(load_run(d) for d in run_dirs),
        calibration=None if calibration is None else load_calibration(calibration),
        profile=profile_result, profile_path=None if profile is None else Path(profile),
        tables=tuple(models), bench=tuple(load_bench(b) for b in bench))


def _unique_labels(paths: Sequence[Path]) -> list[str]:
    """Short names (`sps_1d`, `runs/a`): the stem or dir name, widened with parents where it collides."""
    for depth in range(1, 1 + max((len(p.parts) for p in paths), default=1)):
        labels = ["/".join(p.with_suffix("").parts[-depth:]) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


# ------------------------------------------------------------------------------------------ run summary


@dataclass(frozen=True)
class RunSummary:
    run: str
    deployment: str
    mode: str
    policy: str
    lag_steps: int
    batch_range: tuple[int, int] | None
    steps: int
    tokens_per_second: float | None
    mean_commit_len: float | None
    verified: tuple[int, ...]  # drafts the target verified, per position
    accepted: tuple[int, ...]  # drafts accepted, per position

    @property
    def accepted_over_verified(self) -> tuple[float | None, ...]:
        return tuple(a / v if v else None for a, v in zip(self.accepted, self.verified, strict=True))


def _counts_from_steps(run: RunData) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # Draft k (0-based) is verified when the request verifies the root plus k + 1 drafts.
    verified, accepted = [0] * run.gamma, [0] * run.gamma
    for step in run.steps:
        for req in step.requests:
            for k in range(run.gamma):
                verified[k] += req.verify_len >= k + 2
                accepted[k] += req.correct_len > k
    return tuple(verified), tuple(accepted)


def run_summaries(runs: Sequence[RunData], labels: Sequence[str] | None = None) -> list[RunSummary]:
    """One row per run; draft counts from the run's stats, or counted from its steps when absent."""
    labels = labels or _unique_labels([r.path for r in runs])
    out = []
    for run, label in zip(runs, labels, strict=True):
        verified = run.stats.get("drafts_verified_by_position")
        accepted = run.stats.get("drafts_accepted_by_position")
        if not (isinstance(verified, list) and isinstance(accepted, list)
                and len(verified) == len(accepted) == run.gamma):
            verified, accepted = _counts_from_steps(run)
        sizes = [s.num_reqs for s in run.steps]
        out.append(RunSummary(
            run=label, deployment=run.deployment, mode=run.mode, policy=run.policy, lag_steps=run.lag_steps,
            batch_range=(min(sizes), max(sizes)) if sizes else None,
            steps=steps if isinstance(steps := run.stats.get("steps"), int) else len(run.steps),
            tokens_per_second=_opt_float(run.stats.get("tokens_per_second")),
            mean_commit_len=_opt_float(run.stats.get("mean_commit_len")),
            verified=tuple(int(v) for v in verified), accepted=tuple(int(a) for a in accepted)))
    return out


def _opt_float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# ---------------------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class Reliability:
    """A reliability diagram over equal-width confidence bins, with ECE, Brier score and AUROC."""

    counts: np.ndarray
    mean_confidence: np.ndarray  # NaN in empty bins
    event_rate: np.ndarray  # NaN in empty bins
    ece: float
    brier: float
    auroc: float

    @property
    def num_samples(self) -> int:
        return int(self.counts.sum())


def reliability(confidence: np.ndarray, event: np.ndarray, num_bins: int = NUM_BINS) -> Reliability:
    """Bin `confidence` in [0, 1] into `num_bins` equal-width bins (1.0 in the last) against the 0/1 `event`.

    ECE = sum over bins of (bin count / n) · |mean confidence − event rate|; NaN without samples.
    """
    conf = np.asarray(confidence, dtype=np.float64).ravel()
    hit = np.asarray(event, dtype=bool).ravel()
    if conf.shape != hit.shape:
        raise ValueError(f"confidence has {conf.size} values but event has {hit.size}")
    index = np.minimum((conf * num_bins).astype(np.int64), num_bins - 1)
    counts = np.bincount(index, minlength=num_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.bincount(index, weights=conf, minlength=num_bins) / counts
        rate = np.bincount(index, weights=hit.astype(np.float64), minlength=num_bins) / counts
    if conf.size == 0:
        return Reliability(counts, mean_conf, rate, math.nan, math.nan, math.nan)
    auroc = cal.roc_auc(conf, hit)
    return Reliability(counts, mean_conf, rate, cal.ece(conf, hit, num_bins), cal.brier(conf, hit),
                       math.nan if auroc is None else auroc)


@dataclass(frozen=True)
class CalibrationGroup:
    """STS rows of every run with one policy and gamma, scored before (T=1) and, given a file, after STS.

    `conditional[k]`: sigmoid(z_k / T_k) against "draft k accepted", over rows whose prefix reached k.
    `cumulative[k]`: survival cumprod(sigmoid(z / T))[k] against prefix_mask[k], over every row.
    Each maps "before" / "after" to one `Reliability` per position.
    """

    policy: str
    gamma: int
    runs: tuple[str, ...]
    num_samples: int
    skipped_requests: int
    temperatures: tuple[float, ...] | None
    conditional: Mapping[str, tuple[Reliability, ...]]
    cumulative: Mapping[str, tuple[Reliability, ...]]


def _score(logits: np.ndarray, mask: np.ndarray, temps: np.ndarray) -> tuple[tuple[Reliability, ...], ...]:
    cond_conf = cal.confidence(logits, temps)
    survival = np.cumprod(cond_conf, axis=1)
    conditional, cumulative = [], []
    for k in range(logits.shape[1]):
        reached = np.ones(len(mask), dtype=bool) if k == 0 else mask[:, k - 1]
        conditional.append(reliability(cond_conf[reached, k], mask[reached, k]))
        cumulative.append(reliability(survival[:, k], mask[:, k]))
    return tuple(conditional), tuple(cumulative)


def calibration_groups(runs: Sequence[RunData], calibration: StsCalibration | None,
                       labels: Sequence[str] | None = None) -> list[CalibrationGroup]:
    """Pool the runs' STS rows per (policy, gamma): greedy labels do not carry over to sampling."""
    labels = labels or _unique_labels([r.path for r in runs])
    pooled: dict[tuple[str, int], list[tuple[str, StsSamples]]] = defaultdict(list)
    for run, label in zip(runs, labels, strict=True):
        if run.sts is not None and len(run.sts.logits):
            pooled[(run.sts.policy, run.gamma)].append((label, run.sts))
    groups = []
    for (policy, gamma), members in sorted(pooled.items()):
        logits = np.concatenate([s.logits for _, s in members])
        mask = np.concatenate([s.prefix_mask for _, s in members])
        scored = {"before": _score(logits, mask, np.ones(gamma))}
        temps = None
        if calibration is not None:
            if len(calibration.temperatures) != gamma:
                raise ReportError(f"{calibration.path}: has {len(calibration.temperatures)} temperatures but "
                                  f"the runs {[m for m, _ in members]} have gamma={gamma}; pass the "
                                  "calibration fitted for this deployment")
            temps = calibration.temperatures
            scored["after"] = _score(logits, mask, np.array(temps))
        groups.append(CalibrationGroup(
            policy=policy, gamma=gamma, runs=tuple(m for m, _ in members), num_samples=len(logits),
            skipped_requests=sum(s.skipped_requests for _, s in members), temperatures=temps,
            conditional={when: pair[0] for when, pair in scored.items()},
            cumulative={when: pair[1] for when, pair in scored.items()}))
    return groups


# -------------------------------------------------------------------------------------- tau vs actual


@dataclass(frozen=True)
class BiasRow:
    """`actual − tau` over the steps of one group. std is the sample std (ddof=1; NaN for one step)."""

    group: str
    count: int
    mean_bias: float
    std: float
    mean_abs: float
    relative_bias: float  # mean(actual − tau) / mean(actual)


def _bias_row(group: str, tau: Sequence[float], actual: Sequence[float]) -> BiasRow:
    t, a = np.asarray(tau, np.float64), np.asarray(actual, np.float64)
    bias = a - t
    mean_actual = float(a.mean())
    return BiasRow(group, int(bias.size), float(bias.mean()),
                   float(bias.std(ddof=1)) if bias.size > 1 else math.nan, float(np.abs(bias).mean()),
                   float(bias.mean()) / mean_actual if mean_actual else math.nan)


GroupKey = Callable[[RunData, StepRecord], Hashable | None]


def _grouped_bias(runs: Sequence[RunData], key: GroupKey) -> list[BiasRow]:
    taus: dict[Any, list[float]] = defaultdict(list)
    actual: dict[Any, list[float]] = defaultdict(list)
    for run in runs:
        for step in run.steps:
            group = key(run, step)
            if step.tau is None or group is None:
                continue
            taus[group].append(step.tau)
            actual[group].append(step.committed)
    # Sort numbers numerically and strings alphabetically, numbers first.
    order = sorted(taus, key=lambda g: (isinstance(g, str), g))
    return [_bias_row(str(g), taus[g], actual[g]) for g in order]


def bias_tables(runs: Sequence[RunData], labels: Sequence[str] | None = None) -> dict[str, list[BiasRow]]:
    """Bias tables of the steps that have a predicted tau (not static ones), keyed by the grouping.

    Lag is the run's configured `lag_steps`; tier groups only runs that replay graph tiers (otherwise the
    tier equals the row count and says nothing new).
    """
    labels = labels or _unique_labels([r.path for r in runs])
    name = {id(run): label for run, label in zip(runs, labels, strict=True)}
    tables = {
        "all": _grouped_bias(runs, lambda run, step: "all steps"),
        "run": _grouped_bias(runs, lambda run, step: name[id(run)]),
        "batch size B": _grouped_bias(runs, lambda run, step: step.num_reqs),
        "lag_steps": _grouped_bias(runs, lambda run, step: run.lag_steps),
        "policy": _grouped_bias(runs, lambda run, step: run.policy),
        "tier": _grouped_bias(runs, lambda run, step: step.tier if run.tiers else None),
    }
    return {key: rows for key, rows in tables.items() if rows}


def bias_by_batch_and_lag(runs: Sequence[RunData]) -> dict[int, dict[int, np.ndarray]]:
    """`{lag_steps: {B: actual − tau per step}}`, both keys ascending: the data of the bias plot."""
    data: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        for step in run.steps:
            if step.tau is not None:
                data[run.lag_steps][step.num_reqs].append(step.committed - step.tau)
    return {lag: {b: np.array(v) for b, v in sorted(per_b.items())} for lag, per_b in sorted(data.items())}


# ------------------------------------------------------------------------------------------ cost models


def predict_seconds(model: Any, num_reqs: int, num_rows: int) -> float | None:
    """Step seconds a cost model predicts, or None outside its range.

    Anything with `step_time(B, M)` is a step-time model; anything with `lookup(M)` is an SPS table
    (steps/s, so seconds are its reciprocal).
    """
    try:
        if hasattr(model, "step_time"):
            return float(model.step_time(num_reqs, num_rows))
        if hasattr(model, "lookup"):
            return 1.0 / float(model.lookup(num_rows))
    except ValueError:  # CostModelError: M beyond what the table was profiled for
        return None
    raise ReportError(f"cost model {type(model).__name__} has neither step_time(B, M) nor lookup(M)")


def profile_tiers(inputs: ReportInputs) -> tuple[int, ...]:
    """Graph tiers from the profile's meta ("8,16,…"), else every tier any run used."""
    if inputs.profile is not None:
        text = inputs.profile.meta.get("tiers", "")
        try:
            tiers = {int(t) for t in text.split(",") if t.strip()}
        except ValueError:
            raise ReportError(f"{inputs.profile_path}: meta.tiers must be comma-separated integers, got "
                              f"{text!r}") from None
        if tiers:
            return tuple(sorted(tiers))
    return tuple(sorted({t for run in inputs.runs for t in run.tiers}))


@dataclass(frozen=True)
class ResidualRow:
    """How well one table reproduces the profiled medians (measured − predicted)."""

    model: str
    count: int
    out_of_range: int  # samples the table cannot predict (beyond an SPS table's max_batch_tokens)
    rms_seconds: float
    r_squared: float
    near_tier_mean_abs: float  # within ±TIER_RADIUS rows of a tier
    near_tier_count: int
    elsewhere_mean_abs: float
    elsewhere_count: int
    max_relative_error: float


def residual_table(samples: Sequence[tuple[int, int, float]], models: Sequence[tuple[str, Any]],
                   tiers: Sequence[int], radius: int = TIER_RADIUS) -> list[ResidualRow]:
    """One row per model over `samples` = `(B, M, median seconds)`."""
    rows = []
    tier_arr = np.array(sorted(tiers), dtype=np.int64)
    for name, model in models:
        kept, predicted = [], []
        for b, m, s in samples:
            p = predict_seconds(model, b, m)
            if p is not None:
                kept.append((m, s))
                predicted.append(p)
        if not kept:
            rows.append(ResidualRow(name, 0, len(samples), *([math.nan] * 3), 0, math.nan, 0, math.nan))
            continue
        m_arr = np.array([m for m, _ in kept])
        meas = np.array([s for _, s in kept])
        err = meas - np.array(predicted)
        near = (np.abs(m_arr[:, None] - tier_arr[None, :]) <= radius).any(axis=1) if tier_arr.size else \
            np.zeros(m_arr.size, dtype=bool)
        total = float(np.sum((meas - meas.mean()) ** 2))
        rows.append(ResidualRow(
            model=name, count=len(kept), out_of_range=len(samples) - len(kept),
            rms_seconds=float(np.sqrt(np.mean(err ** 2))),
            r_squared=1.0 - float(np.sum(err ** 2)) / total if total > 0 else math.nan,
            near_tier_mean_abs=float(np.abs(err[near]).mean()) if near.any() else math.nan,
            near_tier_count=int(near.sum()),
            elsewhere_mean_abs=float(np.abs(err[~near]).mean()) if (~near).any() else math.nan,
            elsewhere_count=int((~near).sum()), max_relative_error=float(np.max(np.abs(err) / meas))))
    return rows


@dataclass(frozen=True)
class CostPanel:
    """Measured medians of one batch size and each model's prediction over every M in their range."""

    num_reqs: int
    rows: np.ndarray
    seconds: np.ndarray
    model_rows: np.ndarray
    predictions: Mapping[str, np.ndarray]  # NaN where a model cannot predict


def cost_panels(samples: Sequence[tuple[int, int, float]], models: Sequence[tuple[str, Any]],
                max_panels: int = 4) -> list[CostPanel]:
    """Panels for up to `max_panels` batch sizes spread over the profiled ones (smallest and largest kept)."""
    sizes = sorted({b for b, _, _ in samples})
    if len(sizes) > max_panels:
        picks = np.unique(np.rint(np.linspace(0, len(sizes) - 1, max_panels)).astype(int))
        sizes = [sizes[i] for i in picks]
    panels = []
    for b in sizes:
        points = sorted((m, s) for bb, m, s in samples if bb == b)
        grid = np.arange(points[0][0], points[-1][0] + 1)
        predictions = {}
        for name, model in models:
            values = [predict_seconds(model, b, int(m)) for m in grid]
            predictions[name] = np.array([math.nan if v is None else v for v in values])
        panels.append(CostPanel(b, np.array([m for m, _ in points]), np.array([s for _, s in points]),
                                grid, predictions))
    return panels


# ------------------------------------------------------------------------------------------- throughput


@dataclass(frozen=True)
class OracleRow:
    """Mean verify rows per step: the oracle's, the planner's, the target's and the padded tier's."""

    run: str
    mode: str
    steps: int
    oracle_rows: float
    planned_rows: float
    rows: float
    tier_rows: float


def oracle_rows(runs: Sequence[RunData], labels: Sequence[str] | None = None) -> list[OracleRow]:
    """For cap-accept and compact runs: per step, sum over requests of min(raw_correct_len + 1, N).

    That is the fewest rows that commit the same tokens if the matching prefix were known in advance; it
    bounds how far a better budget could cut the rows, with no timing attached.
    """
    labels = labels or _unique_labels([r.path for r in runs])
    out = []
    for run, label in zip(runs, labels, strict=True):
        if run.target_only or run.verify_mode == "static" or not run.steps:
            continue
        n = run.gamma + 1
        oracle = [sum(min(r.raw_correct_len + 1, n) for r in step.requests) for step in run.steps]
        out.append(OracleRow(label, run.verify_mode, len(run.steps), float(np.mean(oracle)),
                             float(np.mean([s.planned_rows for s in run.steps])),
                             float(np.mean([s.rows for s in run.steps])),
                             float(np.mean([s.tier for s in run.steps]))))
    return out


# ------------------------------------------------------------------------------------------- markdown


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    def cell(v: Any) -> str:
        return (v if isinstance(v, str) else _fmt(v)).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return lines + [""]


def _series(values: Sequence[Any], digits: int = 2) -> str:
    return " ".join(_fmt(v, digits) for v in values)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "policy"


TERMINOLOGY = ("The only measured acceptance figure in this report is **accepted / verified drafts**: drafts "
               "accepted at a position divided by drafts the target verified there. `tau` (the planner's "
               "predicted committed tokens of a step) and `(AL-1)/gamma` are a prediction and an average; "
               "neither is reported as a measured acceptance figure.")


class _Renderer:
    """Builds the Markdown section by section and draws each plot into `out_dir` as it goes."""

    def __init__(self, inputs: ReportInputs, out_dir: Path) -> None:
        from dspark.report import plots as report_plots  # matplotlib only when a report is actually drawn

        self.inputs = inputs
        self.out_dir = out_dir
        self.plots = report_plots
        self.labels = _unique_labels([r.path for r in inputs.runs])

    def render(self) -> str:
        parts = [self.header(), self.runs(), self.calibration(), self.tau(), self.cost(), self.throughput()]
        return "\n".join(line for part in parts for line in part).rstrip() + "\n"

    def image(self, file_name: str, alt: str) -> str:
        return f"![{alt}]({file_name})"

    def header(self) -> list[str]:
        inp = self.inputs
        lines = ["# dspark report", "", "Inputs:", ""]
        lines += [f"- run: `{r.path}` ({r.deployment}, {r.mode}, {r.backend}/{r.device})" for r in inp.runs]
        if inp.calibration is not None:
            lines.append(f"- STS calibration: `{inp.calibration.path}`")
        if inp.profile is not None:
            lines.append(f"- profile: `{inp.profile_path}`")
        lines += [f"- cost table `{name}`: {type(model).__name__}" for name, model in inp.tables]
        lines += [f"- bench: `{b.path}`" for b in inp.bench]
        return lines + ["", "> " + TERMINOLOGY, ""]

    def runs(self) -> list[str]:
        if not self.inputs.runs:
            return []
        summaries = run_summaries(self.inputs.runs, self.labels)
        lines = ["## Runs", ""]
        lines += _table(
            ["run", "deployment", "mode", "policy", "lag_steps", "B range", "steps", "tokens/s",
             "mean commit_len"],
            [[s.run, s.deployment, s.mode, s.policy, s.lag_steps,
              "-" if s.batch_range is None else f"{s.batch_range[0]}–{s.batch_range[1]}", s.steps,
              _fmt(s.tokens_per_second, 1), s.mean_commit_len] for s in summaries])
        lines += ["Per draft position 1…gamma: drafts the target verified, drafts accepted, and accepted / "
                  "verified drafts.", ""]
        lines += _table(["run", "verified drafts", "accepted drafts", "accepted / verified drafts"],
                        [[s.run, _series(s.verified), _series(s.accepted), _series(s.accepted_over_verified)]
                         for s in summaries])
        return lines

    def calibration(self) -> list[str]:
        cal = self.inputs.calibration
        groups = calibration_groups(self.inputs.runs, cal, self.labels)
        if not groups and cal is None:
            return []
        lines = ["## Calibration", ""]
        if cal is not None:
            lines += [f"STS file `{cal.path}`: dataset {cal.dataset or '?'}, {_fmt(cal.num_samples)} "
                      f"samples, temperatures {_series(cal.temperatures)}.", ""]
            if cal.ece_before is not None or cal.ece_after is not None:
                lines += ["ECE the fit reported: before " + _series(cal.ece_before or (), 4) + "; after "
                          + _series(cal.ece_after or (), 4) + ".", ""]
        if not groups:
            lines += ["No run recorded STS samples (`sts/`), so the reliability diagrams are omitted.", ""]
            return lines
        lines += [f"Reliability over {NUM_BINS} equal-width bins. *Conditional*: sigmoid(z_k/T_k) against "
                  "\"draft k accepted\", only rows whose accepted prefix reached k. *Cumulative*: survival "
                  "against prefix_mask[k] (k < correct_len), every row. Before = T 1; after = the STS file's "
                  "temperatures. AUROC ranks the survival.", ""]
        used: set[str] = set()
        for group in groups:
            slug = _slug(group.policy) + f"-g{group.gamma}"
            while slug in used:
                slug += "-x"
            used.add(slug)
            skipped = f", {group.skipped_requests} requests skipped" if group.skipped_requests else ""
            lines += [f"### policy {group.policy} (gamma {group.gamma})", "",
                      f"{group.num_samples} samples from {', '.join(group.runs)}{skipped}.", ""]
            whens = list(group.conditional)
            headers = ["position"]
            for kind in ("conditional", "cumulative"):
                headers += [f"{kind} n"] + [f"{kind} ECE {w}" for w in whens]
            headers += [f"cumulative Brier {w}" for w in whens] + [f"AUROC {w}" for w in whens]
            rows = []
            for k in range(group.gamma):
                row: list[Any] = [k + 1]
                for table in (group.conditional, group.cumulative):
                    row += [table["before"][k].num_samples] + [_fmt(table[w][k].ece, 4) for w in whens]
                row += [_fmt(group.cumulative[w][k].brier, 4) for w in whens]
                row += [group.cumulative[w][k].auroc for w in whens]
                rows.append(row)
            lines += _table(headers, rows)
            for kind, table in (("conditional", group.conditional), ("cumulative", group.cumulative)):
                name = f"calibration_{kind}_{slug}.png"
                self.plots.plot_reliability(
                    {when: table[when] for when in whens},
                    f"{kind} calibration · policy {group.policy}", self.out_dir / name)
                lines += [self.image(name, f"{kind} reliability, policy {group.policy}"), ""]
        return lines

    def tau(self) -> list[str]:
        tables = bias_tables(self.inputs.runs, self.labels)
        if not tables:
            return []
        static = sum(len(r.steps) for r in self.inputs.runs if all(s.tau is None for s in r.steps))
        lines = ["## Predicted tau vs actual committed tokens", "",
                 "Per step, bias = actual − tau, where actual is the committed tokens and tau = B + the "
                 "survival of the verified drafts. Positive bias: the planner under-predicts. relative = "
                 "mean(actual − tau) / mean(actual); std is the sample standard deviation.", ""]
        if static:
            lines += [f"{static} steps of static runs have no tau and are left out.", ""]
        for group, rows in tables.items():
            lines += ["Overall:" if group == "all" else f"By {group}:", ""]
            lines += _table([group, "steps", "mean bias", "std", "mean |bias|", "relative bias"],
                            [[r.group, r.count, r.mean_bias, r.std, r.mean_abs, r.relative_bias]
                             for r in rows])
        name = "tau_bias_by_batch.png"
        self.plots.plot_bias_by_batch(bias_by_batch_and_lag(self.inputs.runs), self.out_dir / name)
        return lines + [self.image(name, "actual - tau by batch size and lag"), ""]

    def cost(self) -> list[str]:
        profile = self.inputs.profile
        if profile is None:
            return []
        samples = profile.fit_samples()
        tiers = profile_tiers(self.inputs)
        models = list(self.inputs.tables)
        lines = ["## Cost model vs measurement", "",
                 f"{len(samples)} profiled (B, M) medians of the verify step; graph tiers: "
                 f"{', '.join(map(str, tiers)) or 'none'}.", ""]
        if models:
            lines += [f"Residual = measured − predicted. Near tier: M within ±{TIER_RADIUS} rows of a tier.",
                      ""]
            lines += _table(
                ["model", "samples", "out of range", "RMS ms", "R²", "mean abs err near tier ms (n)",
                 "mean abs err elsewhere ms (n)", "max rel err"],
                [[r.model, r.count, r.out_of_range, _fmt(r.rms_seconds * 1e3, 4), _fmt(r.r_squared, 4),
                  f"{_fmt(r.near_tier_mean_abs * 1e3, 4)} ({r.near_tier_count})",
                  f"{_fmt(r.elsewhere_mean_abs * 1e3, 4)} ({r.elsewhere_count})",
                  f"{_fmt(r.max_relative_error * 100, 1)}%"]
                 for r in residual_table(samples, models, tiers)])
        else:
            lines += ["No cost tables given (`--tables`): measured points only.", ""]
        name = "cost_model_vs_measured.png"
        self.plots.plot_cost_models(cost_panels(samples, models), tiers, self.out_dir / name)
        return lines + [self.image(name, "step time vs M: measured and predicted"), ""]

    def throughput(self) -> list[str]:
        oracle = oracle_rows(self.inputs.runs, self.labels)
        if not self.inputs.bench and not oracle:
            return []
        lines = ["## Throughput", ""]
        for bench in self.inputs.bench:
            lines += [f"`{bench.path}`: {bench.prompts} prompts × {bench.max_new_tokens} tokens, "
                      f"max_running_requests {_fmt(bench.max_running_requests)}.", ""]
            lines += _table(
                ["package", "mode", "tokens/s", "ratio to first", "mean commit_len", "rows / request-step",
                 "padding / request-step", "planned / request-step", "predicted tau / step",
                 "committed / step", "lossless"],
                [[r["package"], r["mode"], _fmt(r["tokens_per_s"], 1), r["ratio_to_first"],
                  r["mean_commit_len"], r["rows_per_request_step"], r["padding_rows_per_request_step"],
                  r["planned_rows_per_request_step"], r["predicted_tau_per_step"], r["committed_per_step"],
                  r["lossless"]] for r in bench.results])
        if self.inputs.bench:
            name = "throughput.png"
            titles = _unique_labels([b.path for b in self.inputs.bench])
            self.plots.plot_throughput(
                [(title, [(f"{r['package']} ({r['mode']})", float(r["tokens_per_s"])) for r in b.results])
                 for title, b in zip(titles, self.inputs.bench, strict=True)], self.out_dir / name)
            lines += [self.image(name, "tokens/s by package and mode"), ""]
        if oracle:
            lines += ["Verify rows per step: the oracle's (sum over requests of min(raw_correct_len + 1, N), "
                      "the fewest rows that commit the same tokens had each matching prefix been known), the "
                      "planner's, those the target ran, and the tier they were padded to. No timing is "
                      "attached to the oracle.", ""]
            lines += _table(["run", "mode", "steps", "oracle rows / step", "planned rows / step",
                             "rows run / step", "tier rows / step", "planned / oracle"],
                            [[o.run, o.mode, o.steps, o.oracle_rows, o.planned_rows, o.rows, o.tier_rows,
                              o.planned_rows / o.oracle_rows if o.oracle_rows else None] for o in oracle])
        return lines


def render_report(inputs: ReportInputs, out_dir: str | os.PathLike[str]) -> str:
    """Draw the plots into `out_dir` and return the report's Markdown (not yet written)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return _Renderer(inputs, out).render()


def write_report(inputs: ReportInputs, out_dir: str | os.PathLike[str]) -> Path:
    """Render and write `out_dir/report.md`. The Markdown is renamed into place last, so a failure at any
    point leaves the previous report.md (or none), never a partial one."""
    out = Path(out_dir)
    text = render_report(inputs, out)
    return atomic_write_text(out / REPORT_FILE, text)


# ------------------------------------------------------------------------------------------------- CLI
