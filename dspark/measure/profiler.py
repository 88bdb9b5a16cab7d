"""Measure verify step times and fit the planner's cost tables (the fitting half of `dspark profile`).

The runtime half owns the model: it builds a `StepTimer` that runs one verify forward with `B`
requests and `M` rows, synchronises the device, and returns wall seconds. This module decides what to
measure (`ProfilePlan`), measures it (`run_profile`), keeps the raw samples (`ProfileResult`, JSON) so a
fit can be redone without the device, fits both tables (`dspark.measure.cost_fit`) and reports how well
the additive table reproduces the measurements, above all near graph tiers where it smooths cliffs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from dspark.atomic import atomic_write_text, staged_file
from dspark.measure.cost_fit import (
    DEFAULT_M_BIN,
    AdditiveFit,
    FitResidual,
    Sample,
    bin_rows,
    fit_additive,
    fit_sps_table,
    largest_residuals,
    nnls,
)
from dspark.runtime.planner.cost_models import AdditiveCostTable, SpsTable, TierCostTable, save_cost_model

__all__ = [
    "AdditiveFit", "FitResidual", "ProfilePlan", "ProfileResult", "ProfileSample", "Sample", "StepTimer",
    "bin_rows", "fit_additive", "fit_profile", "fit_sps_table", "format_fit_report", "nnls",
    "rows_around", "run_profile", "write_tables",
]

StepTimer = Callable[[int, int], float]
"""`timer(num_reqs, num_rows)`: run ONE verify forward with B requests and M rows in total, return its
wall seconds. The timer synchronises the device itself; the profiler only calls it and takes medians."""

PROFILE_FORMAT = "dspark-profile"
PROFILE_VERSION = 1
SPS_FILE = "sps_1d.json"
ADDITIVE_FILE = "additive.json"
TIER_FILE = "tier.json"
PROFILE_FILE = "profile.json"


@dataclass(frozen=True)
class ProfilePlan:
    """What to measure.

    Static sweep: `M = B·N` for each batch size (the 1D SPS table). Off-diagonal grid: for each `B`,
    `grid_density` row counts spaced evenly over `[B·f, B·N]` (the additive fit), plus every `extra_rows`
    value inside that range, e.g. `rows_around(tiers)` to measure densely where tier cliffs sit. Each
    point runs `warmup` unmeasured steps (first replay of a shape, allocator growth) and then `repeats`
    measured ones, whose median is the point's time. `max_rows` (e.g. the largest graph tier) drops any
    point with more rows; a batch size whose static point exceeds it keeps only its grid points.
    """

    batch_sizes: tuple[int, ...]
    num_draft_tokens: int
    min_verify_len: int = 1
    grid_density: int = 8
    repeats: int = 5
    warmup: int = 2
    m_bin: int = DEFAULT_M_BIN
    max_rows: int | None = None
    extra_rows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Accept lists from JSON or callers; the dataclass stays hashable and immutable.
        # Canonical form (sorted tuples) so equal plans compare equal and JSON round-trips exactly.
        given = [int(b) for b in self.batch_sizes]
        if not given:
            raise ValueError("ProfilePlan.batch_sizes is empty; list the batch sizes to profile, "
                             "e.g. (1, 2, 4, 8)")
        if any(b < 1 for b in given) or len(set(given)) != len(given):
            raise ValueError(f"ProfilePlan.batch_sizes must be distinct integers >= 1, got {tuple(given)}")
        object.__setattr__(self, "batch_sizes", tuple(sorted(given)))
        object.__setattr__(self, "extra_rows", tuple(sorted({int(m) for m in self.extra_rows})))
        bs = self.batch_sizes
        if self.num_draft_tokens < 1:
            raise ValueError(f"ProfilePlan.num_draft_tokens (N = gamma + 1) must be >= 1, got "
                             f"{self.num_draft_tokens}")
        if not 1 <= self.min_verify_len <= self.num_draft_tokens:
            raise ValueError(f"ProfilePlan.min_verify_len must be in [1, N={self.num_draft_tokens}], got "
                             f"{self.min_verify_len}")
        if self.grid_density < 2:
            raise ValueError(f"ProfilePlan.grid_density must be >= 2 (both ends of [B·f, B·N]), got "
                             f"{self.grid_density}")
        if self.repeats < 1:
            raise ValueError(f"ProfilePlan.repeats must be >= 1, got {self.repeats}")
        if self.warmup < 0:
            raise ValueError(f"ProfilePlan.warmup must be >= 0, got {self.warmup}")
        if self.m_bin < 1:
            raise ValueError(f"ProfilePlan.m_bin must be >= 1, got {self.m_bin}")
        if any(m < 1 for m in self.extra_rows):
            raise ValueError(f"ProfilePlan.extra_rows must be >= 1, got {self.extra_rows}")
        if self.max_rows is not None:
            too_big = [b for b in bs if b * self.min_verify_len > self.max_rows]
            if too_big:
                raise ValueError(f"batch sizes {too_big} need at least B·min_verify_len rows, more than "
                                 f"max_rows={self.max_rows}; drop them or raise max_rows")
            if not self.static_batch_sizes:
                raise ValueError(f"no batch size has B·N <= max_rows={self.max_rows}, so the static sweep "
                                 "would be empty; add a smaller batch size or raise max_rows")

    @property
    def static_batch_sizes(self) -> tuple[int, ...]:
        """Batch sizes whose full static step `B·N` fits under `max_rows`, ascending."""
        limit = self.max_rows
        return tuple(b for b in self.batch_sizes
                     if limit is None or b * self.num_draft_tokens <= limit)

    @property
    def max_batch_tokens(self) -> int:
        """The most rows a step may have: `max_rows`, or the largest static step when unset."""
        if self.max_rows is not None:
            return self.max_rows
        return max(self.batch_sizes) * self.num_draft_tokens

    def grid_rows(self, num_reqs: int) -> tuple[int, ...]:
        """Off-diagonal row counts for one batch size, ascending, without the static point `B·N`."""
        low = num_reqs * self.min_verify_len
        high = num_reqs * self.num_draft_tokens
        if self.max_rows is not None:
            high = min(high, self.max_rows)
        spaced = np.rint(np.linspace(low, high, self.grid_density)).astype(int).tolist()
        rows = set(spaced) | {m for m in self.extra_rows if low <= m <= high}
        rows.discard(num_reqs * self.num_draft_tokens)
        return tuple(sorted(rows))

    def points(self) -> list[tuple[str, int, int]]:
        """Every `(kind, B, M)` the profile measures: the static sweep first, then the grid."""
        static = [("static", b, b * self.num_draft_tokens) for b in self.static_batch_sizes]
        grid = [("grid", b, m) for b in self.batch_sizes for m in self.grid_rows(b)]
        return static + grid

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["batch_sizes"] = list(self.batch_sizes)
        out["extra_rows"] = list(self.extra_rows)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProfilePlan:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown ProfilePlan fields {sorted(unknown)}; expected a subset of "
                             f"{sorted(known)}")
        return cls(**data)


def rows_around(tiers: Iterable[int], radius: int = 2) -> tuple[int, ...]:
    """Row counts `tier - radius … tier + radius` for each graph tier (>= 1), for `ProfilePlan.extra_rows`.

    The additive table smooths tier cliffs, so its error is measured densely there (DESIGN §6).
    """
    if radius < 0:
        raise ValueError(f"radius must be >= 0, got {radius}")
    return tuple(sorted({m for t in tiers for m in range(t - radius, t + radius + 1) if m >= 1}))


@dataclass(frozen=True)
class ProfileSample:
    """Every measured repeat of one `(B, M)` point, in call order, warmup excluded."""

    num_reqs: int
    num_rows: int
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "seconds", tuple(float(s) for s in self.seconds))
        if not self.seconds:
            raise ValueError(f"sample (B={self.num_reqs}, M={self.num_rows}) has no measurements")
        bad = [s for s in self.seconds if not np.isfinite(s) or s <= 0.0]
        if bad:
            raise ValueError(f"sample (B={self.num_reqs}, M={self.num_rows}) has step times {bad}; the "
                             "timer must return the wall seconds of one synchronised forward (> 0)")

    @property
    def median_seconds(self) -> float:
        return float(np.median(self.seconds))

    def as_sample(self) -> Sample:
        return (self.num_reqs, self.num_rows, self.median_seconds)

    def to_json(self) -> dict[str, Any]:
        return {"num_reqs": self.num_reqs, "num_rows": self.num_rows, "seconds": list(self.seconds)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProfileSample:
        return cls(int(data["num_reqs"]), int(data["num_rows"]), tuple(data["seconds"]))


@dataclass(frozen=True)
class ProfileResult:
    """The raw measurements of one profile; `save`/`load` keep them so the fit can be redone offline."""

    plan: ProfilePlan
    static: tuple[ProfileSample, ...]
    grid: tuple[ProfileSample, ...]
    meta: Mapping[str, str] = field(default_factory=dict)

    @property
    def max_batch_tokens(self) -> int:
        return self.plan.max_batch_tokens

    def static_samples(self) -> list[Sample]:
        return [s.as_sample() for s in self.static]

    def fit_samples(self) -> list[Sample]:
        """Static and grid medians together: the additive fit uses every measured point."""
        return [s.as_sample() for s in (*self.static, *self.grid)]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "plan": self.plan.to_json(),
            "meta": dict(self.meta),
            "static": [s.to_json() for s in self.static],
            "grid": [s.to_json() for s in self.grid],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProfileResult:
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not a profile result (format={data.get('format')!r}, expected "
                             f"{PROFILE_FORMAT!r}); pass the profile.json that `dspark profile` wrote")
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile result version {data.get('version')!r} is not supported (this "
                             f"dspark reads version {PROFILE_VERSION}); re-run the profile")
        return cls(
            plan=ProfilePlan.from_json(data["plan"]),
            static=tuple(ProfileSample.from_json(s) for s in data["static"]),
            grid=tuple(ProfileSample.from_json(s) for s in data["grid"]),
            meta={str(k): str(v) for k, v in data.get("meta", {}).items()},
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        atomic_write_text(Path(path), json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ProfileResult:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc}); re-run the profile") from exc
        return cls.from_json(data)


def run_profile(timer: StepTimer, plan: ProfilePlan, progress: bool = True,
                meta: Mapping[str, str] | None = None) -> ProfileResult:
    """Measure every point of `plan` with `timer` (warmup, then `repeats` timed calls per point)."""
    points = plan.points()
    static: list[ProfileSample] = []
    grid: list[ProfileSample] = []
    # disable=None lets tqdm turn itself off when stderr is not a terminal (CI logs, pipes).
    with tqdm(points, desc="profile", unit="pt", disable=None if progress else True) as bar:
        for kind, num_reqs, num_rows in bar:
            bar.set_postfix_str(f"B={num_reqs} M={num_rows}", refresh=False)
            for _ in range(plan.warmup):
                timer(num_reqs, num_rows)
            seconds = tuple(float(timer(num_reqs, num_rows)) for _ in range(plan.repeats))
            (static if kind == "static" else grid).append(ProfileSample(num_reqs, num_rows, seconds))
    return ProfileResult(plan=plan, static=tuple(static), grid=tuple(grid), meta=dict(meta or {}))


def fit_profile(result: ProfileResult, m_bin: int | None = None) -> tuple[SpsTable, AdditiveFit]:
    """Both tables from one profile; `m_bin` overrides the plan's bin width when re-fitting offline."""
    sps = fit_sps_table(result.static_samples(), result.max_batch_tokens)
    fit = fit_additive(result.fit_samples(), m_bin=result.plan.m_bin if m_bin is None else m_bin)
    return sps, fit


def format_fit_report(result: ProfileResult, sps: SpsTable, fit: AdditiveFit, flag_top: int = 5) -> str:
    """Plain-text report: static sweep, additive coefficients and fit quality, per-sample residuals.

    The `flag_top` largest absolute residuals are marked `<<`; near graph tiers is where to expect them.
    """
    table = fit.table
    lines = [f"static sweep (N={result.plan.num_draft_tokens}; SPS table, floor lookup)",
             f"{'B':>6} {'M':>7} {'ms':>10} {'steps/s':>10} {'table':>10}"]
    for s in sorted(result.static, key=lambda s: s.num_rows):
        lines.append(f"{s.num_reqs:>6} {s.num_rows:>7} {s.median_seconds * 1e3:>10.4f} "
                     f"{1.0 / s.median_seconds:>10.2f} {sps.lookup(s.num_rows):>10.2f}")

    lines += ["", f"additive fit  T(B, M) = bias + alpha(B) + theta(M)   (M binned by {fit.m_bin})",
              f"  bias   {table.bias_seconds * 1e3:.4f} ms",
              "  alpha  " + _series("B", table.bs_probes, table.alpha_seconds),
              "  theta  " + _series("M", table.m_probes, table.theta_seconds),
              f"  RMS {fit.rms_seconds * 1e3:.4f} ms   R² {fit.r_squared:.5f}   "
              f"max |error| {fit.max_relative_error * 100:.2f}%   ({len(fit.residuals)} samples)"]

    flagged = {id(r) for r in largest_residuals(fit, flag_top)}
    lines += ["", "residuals (measured - predicted at unbinned M; << marks the largest)",
              f"{'B':>6} {'M':>7} {'meas ms':>10} {'pred ms':>10} {'resid ms':>10} {'%':>8}"]
    for r in sorted(fit.residuals, key=lambda r: (r.num_reqs, r.num_rows)):
        mark = "  <<" if id(r) in flagged else ""
        lines.append(f"{r.num_reqs:>6} {r.num_rows:>7} {r.measured_seconds * 1e3:>10.4f} "
                     f"{r.predicted_seconds * 1e3:>10.4f} {r.residual_seconds * 1e3:>+10.4f} "
                     f"{r.relative_error * 100:>+8.2f}{mark}")
    return "\n".join(lines) + "\n"


def _series(name: str, probes: tuple[int, ...], seconds: tuple[float, ...]) -> str:
    return "  ".join(f"{name}={p}:{s * 1e3:.4f}" for p, s in zip(probes, seconds, strict=True)) + "  (ms)"


def write_tables(out_dir: str | os.PathLike[str], sps: SpsTable, fit: AdditiveFit | AdditiveCostTable,
                 result: ProfileResult | None = None, tier: TierCostTable | None = None,
                 fingerprint: Mapping[str, Any] | None = None) -> dict[str, Path]:
    """Write `sps_1d.json`, `additive.json`, (given one) `tier.json` and (given the result)
    `profile.json` into `out_dir`; every table carries `fingerprint` when one is given.

    Every file is first written in full under a temporary name in `out_dir` and then renamed over its
    target, so an interrupted run never leaves a truncated table for a deployment to load.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    additive = fit.table if isinstance(fit, AdditiveFit) else fit
    staged: dict[str, Path] = {}
    try:
        staged[SPS_FILE] = staged_file(out, lambda p: save_cost_model(sps, p, fingerprint))
        staged[ADDITIVE_FILE] = staged_file(out, lambda p: save_cost_model(additive, p, fingerprint))
        if tier is not None:
            staged[TIER_FILE] = staged_file(out, lambda p: save_cost_model(tier, p, fingerprint))
        if result is not None:
            staged[PROFILE_FILE] = staged_file(out, result.save)
    except BaseException:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
        raise
    # Renames last: all tables are complete on disk before any of them replaces an older one.
    written = {}
    for name, tmp in staged.items():
        os.replace(tmp, out / name)
        written[name] = out / name
    return written
