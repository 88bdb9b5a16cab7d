"""Measure verify step times and fit the planner's cost tables (the fitting half of `dspark profile`).

The runtime half owns the model: it builds a `StepTimer` that runs one verify forward with `B`
requests and `M` rows, synchronises the device, and returns wall seconds. This module decides what to
measure (`ProfilePlan`), measures it (`run_profile`), keeps the raw samples (`ProfileResult`, the
`profile.json` of `dspark.formats.profile`) so a fit can be redone without the device, fits the tables
(`dspark.measure.cost_fit`) and reports how well the additive table reproduces the measurements, above
all near graph tiers where it smooths cliffs. A static or cap-accept build runs `B·N` rows in every
step, so its plan (`min_verify_len == num_draft_tokens`) has no grid: its profile is the static sweep
and the 1D table only (`format_sweep_report`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dspark.atomic import staged_file
from dspark.formats.cost_tables import write_cost_table
from dspark.formats.profile import ProfilePlan, ProfileResult, ProfileSample, Sample
from dspark.measure.cost_fit import (
    AdditiveFit,
    bin_rows,
    fit_additive,
    fit_sps_table,
    largest_residuals,
    nnls,
)
from dspark.measure.residuals import FitResidual
from dspark.measure.tiers import rows_around
from dspark.runtime.planner.cost_models import AdditiveCostTable, SpsTable, TierCostTable

__all__ = [
    "AdditiveFit", "FitResidual", "ProfilePlan", "ProfileResult", "ProfileSample", "Sample", "StepTimer",
    "bin_rows", "fit_additive", "fit_profile", "fit_sps_table", "format_fit_report", "format_sweep_report",
    "leftover_tables", "no_grid_note", "nnls", "rows_around", "run_profile", "write_tables",
]

StepTimer = Callable[[int, int], float]
"""`timer(num_reqs, num_rows)`: run ONE verify forward with B requests and M rows in total, return its
wall seconds. The timer synchronises the device itself; the profiler only calls it and takes medians."""

SPS_FILE = "sps_1d.json"
ADDITIVE_FILE = "additive.json"
TIER_FILE = "tier.json"
PROFILE_FILE = "profile.json"


def context_profile_file(context_len: int) -> str:
    """The raw samples of a further context `dspark profile --context-len` measured (profile.json holds the
    first), kept so that `dspark refit-tables` refits the additive table's context term too."""
    return f"profile_context_{context_len}.json"


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
    lines = _sweep_lines(result, sps)
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


def format_sweep_report(result: ProfileResult, sps: SpsTable) -> str:
    """Plain-text report of a profile without a `(B, M)` grid (a static or cap-accept build): the
    static sweep and why no additive or tier table comes with it."""
    return "\n".join([*_sweep_lines(result, sps), "", no_grid_note(result)]) + "\n"


def no_grid_note(result: ProfileResult) -> str:
    """Why a profile without a grid fits only the 1D table, and where the grid comes from."""
    mode = result.meta.get("verify_mode", "this")
    return (f"no additive or tier table: a {mode} build runs all N={result.plan.num_draft_tokens} rows of "
            "every request, so only the static sweep M = B·N was measured and there is no ragged (B, M) "
            "grid to fit. Profile a compact build of the same deployment for those tables; "
            "benchmarks/compare_profiles.py compares the two profiles point by point.")


def _sweep_lines(result: ProfileResult, sps: SpsTable) -> list[str]:
    lines = [f"static sweep (N={result.plan.num_draft_tokens}; SPS table, floor lookup)",
             f"{'B':>6} {'M':>7} {'ms':>10} {'steps/s':>10} {'table':>10}"]
    for s in sorted(result.static, key=lambda s: s.num_rows):
        lines.append(f"{s.num_reqs:>6} {s.num_rows:>7} {s.median_seconds * 1e3:>10.4f} "
                     f"{1.0 / s.median_seconds:>10.2f} {sps.lookup(s.num_rows):>10.2f}")
    return lines


def _series(name: str, probes: tuple[int, ...], seconds: tuple[float, ...]) -> str:
    return "  ".join(f"{name}={p}:{s * 1e3:.4f}" for p, s in zip(probes, seconds, strict=True)) + "  (ms)"


def write_tables(out_dir: str | os.PathLike[str], sps: SpsTable, fit: AdditiveFit | AdditiveCostTable | None,
                 result: ProfileResult | None = None, tier: TierCostTable | None = None,
                 fingerprint: Mapping[str, Any] | None = None) -> dict[str, Path]:
    """Write `sps_1d.json`, (given one) `additive.json` and `tier.json`, and (given the result)
    `profile.json` into `out_dir`; every table carries `fingerprint` when one is given. A profile
    without a `(B, M)` grid (a static build's) has no additive fit: pass `fit=None`.

    Every file is first written in full under a temporary name in `out_dir` and then renamed over its
    target, so an interrupted run never leaves a truncated table for a deployment to load.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    additive = fit.table if isinstance(fit, AdditiveFit) else fit
    staged: dict[str, Path] = {}
    try:
        tables = {SPS_FILE: sps, **({ADDITIVE_FILE: additive} if additive is not None else {}),
                  **({TIER_FILE: tier} if tier is not None else {})}
        for name, table in tables.items():
            staged[name] = staged_file(out, lambda p, t=table: write_cost_table(p, t.to_format(),
                                                                                fingerprint))
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


def leftover_tables(out_dir: str | os.PathLike[str], written: Mapping[str, Path]) -> list[Path]:
    """Tables in `out_dir` that this profile did not write (an earlier profile's additive or tier
    table beside a static profile): they do not describe the new profile.json, and the user should know."""
    out = Path(out_dir)
    return [out / name for name in (SPS_FILE, ADDITIVE_FILE, TIER_FILE)
            if name not in written and (out / name).is_file()]
