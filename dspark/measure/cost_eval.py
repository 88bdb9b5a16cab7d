"""How good is each cost model for the planner, judged against the measured profile (docs/planner.md).

A cost model only matters through the budget it makes the planner choose, so it is scored the way it is
used: for every profiled batch size B, batches of B requests are drawn from recorded survival; for each
draw the planner's `tau(b)` is divided by the MEASURED step time of `M(b)` rows, the measured-optimal
budget is found, and each model's choice (`choose_budget` on the same survival) is charged its regret

    regret% = 100 · (1 − objective_meas(model's budget) / objective_meas(optimal budget)).

Measured step time of (B, M): the profile's median at a measured M; between measured M values of the same
B, linear interpolation, but only between two measurements in the same graph tier (when the profile's
meta records its tiers): one step of M rows costs what its tier costs, so interpolating across a tier
boundary would invent the smoothing under test. Budgets stop at the first M that cannot be read this
way, for the optimum and for every model alike.

Fit quality on the profile samples (`dspark.measure.residuals`) is reported next to the regret, with the
mean error split into samples within `TIER_RADIUS` rows of a tier boundary and the rest: where an additive
fit misprices a cliff.

Draft terms are left out on both sides: the profile measures the verify step only, so a model's draft
term would tilt its choice by a cost the measured objective cannot see.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dspark.formats.profile import ProfileResult
from dspark.measure.cost_fit import fit_tier_table
from dspark.measure.profiler import fit_profile
from dspark.measure.residuals import FitQuality, model_fit_quality
from dspark.measure.tiers import TIER_RADIUS
from dspark.runtime.planner.budget import (
    TIE_RTOL,
    ScheduleConfig,
    check_survival,
    choose_budget,
    rank_candidates,
)
from dspark.runtime.planner.cost_models import AdditiveCostTable, CostModel, SpsTable, TierCostTable


def fit_all_models(result: ProfileResult, m_bin: int | None = None) -> dict[str, CostModel]:
    """The sps-1d, additive and (when the profile records its tiers) tier tables fitted from one profile.

    `m_bin` is the additive fit's M bin width (the plan's when None). Keys are the table kinds.
    """
    sps, additive = fit_profile(result, m_bin)
    models: dict[str, CostModel] = {SpsTable.kind: sps, AdditiveCostTable.kind: additive.table}
    if result.tiers:
        models[TierCostTable.kind] = fit_tier_table(result, result.tiers).table
    return models


@dataclass(frozen=True)
class MeasuredSteps:
    """The profile's step seconds of one batch size, read as the evaluation reads them (module doc)."""

    num_reqs: int
    rows: tuple[int, ...]  # measured M, strictly increasing
    seconds: tuple[float, ...]  # median of the sample medians at each M
    tiers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.seconds):
            raise ValueError(f"B={self.num_reqs}: rows and seconds must be non-empty and of equal length, "
                             f"got {len(self.rows)} and {len(self.seconds)}")
        if any(b <= a for a, b in zip(self.rows, self.rows[1:], strict=False)):
            raise ValueError(f"B={self.num_reqs}: measured rows must be strictly increasing, got "
                             f"{self.rows}")
        if any(not np.isfinite(s) or s <= 0 for s in self.seconds):
            raise ValueError(f"B={self.num_reqs}: measured seconds must be finite and > 0, got "
                             f"{self.seconds}")

    def _segment(self, rows: np.ndarray) -> np.ndarray:
        # Without tiers the whole range is one segment; above the last tier is a segment of its own.
        if not self.tiers:
            return np.zeros(rows.shape, dtype=np.int64)
        return np.searchsorted(np.array(self.tiers), rows, side="left")

    def seconds_at(self, num_rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """Measured seconds at each M; NaN where M is neither measured nor between two measurements of
        its own tier."""
        rows = np.asarray(num_rows, dtype=np.int64)
        measured = np.array(self.rows, dtype=np.int64)
        values = np.array(self.seconds, dtype=np.float64)
        hi = np.searchsorted(measured, rows, side="left")
        out = np.full(rows.shape, np.nan)
        exact = (hi < measured.size) & (measured[np.minimum(hi, measured.size - 1)] == rows)
        out[exact] = values[hi[exact]]
        inner = ~exact & (hi > 0) & (hi < measured.size)
        lo_i, hi_i = hi[inner] - 1, hi[inner]
        seg = self._segment(rows[inner])
        same = (self._segment(measured[lo_i]) == seg) & (self._segment(measured[hi_i]) == seg)
        weight = (rows[inner] - measured[lo_i]) / (measured[hi_i] - measured[lo_i])
        blended = (1.0 - weight) * values[lo_i] + weight * values[hi_i]
        out[np.flatnonzero(inner)[same]] = blended[same]
        return out


def measured_steps(result: ProfileResult, tiers: Sequence[int] = ()) -> dict[int, MeasuredSteps]:
    """Every profiled batch size's measured step seconds; a (B, M) measured twice is pooled by median."""
    pooled: dict[tuple[int, int], list[float]] = {}
    for num_reqs, num_rows, seconds in result.fit_samples():
        pooled.setdefault((num_reqs, num_rows), []).append(seconds)
    out = {}
    for num_reqs in sorted({b for b, _ in pooled}):
        rows = sorted(m for b, m in pooled if b == num_reqs)
        out[num_reqs] = MeasuredSteps(num_reqs, tuple(rows),
                                      tuple(float(np.median(pooled[(num_reqs, m)])) for m in rows),
                                      tuple(tiers))
    return out


@dataclass(frozen=True)
class RegretStats:
    """Regret percentages of one model over some draws."""

    count: int
    mean: float
    p50: float
    p90: float
    max: float

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"RegretStats needs at least one draw, got count={self.count}")
        if not 0.0 <= self.p50 <= self.p90 <= self.max <= 100.0 or not 0.0 <= self.mean <= self.max:
            raise ValueError(f"regret percentages must satisfy 0 <= p50 <= p90 <= max <= 100 and mean <= "
                             f"max, got mean={self.mean} p50={self.p50} p90={self.p90} max={self.max}")

    @classmethod
    def of(cls, values: Sequence[float]) -> RegretStats:
        array = np.asarray(values, dtype=np.float64)
        top = float(array.max())
        # Rounding in the mean and the percentile blend may overshoot equal values by an ulp.
        return cls(int(array.size), min(float(array.mean()), top), min(float(np.percentile(array, 50)), top),
                   min(float(np.percentile(array, 90)), top), top)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BatchEval:
    """One model at one batch size: its regret and the mean rows M it chose."""

    num_reqs: int
    regret: RegretStats
    mean_rows: float

    def to_json(self) -> dict[str, Any]:
        return {"num_reqs": self.num_reqs, "regret": self.regret.to_json(), "mean_rows": self.mean_rows}


@dataclass(frozen=True)
class ModelEval:
    """One model's regret (overall and per B; None where it could plan no draw) and fit quality."""

    name: str
    kind: str
    regret: RegretStats | None
    by_batch: tuple[BatchEval, ...]
    fit: FitQuality | None

    def batch(self, num_reqs: int) -> BatchEval:
        for entry in self.by_batch:
            if entry.num_reqs == num_reqs:
                return entry
        raise KeyError(f"model {self.name!r} has no evaluation at B={num_reqs}; evaluated B: "
                       f"{[e.num_reqs for e in self.by_batch]}")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind,
                "regret": None if self.regret is None else self.regret.to_json(),
                "by_batch": [b.to_json() for b in self.by_batch],
                "fit": None if self.fit is None else self.fit.to_json()}


@dataclass(frozen=True)
class BatchRange:
    """The rows the budgets of one batch size could use, and the mean rows of the measured optimum."""

    num_reqs: int
    min_rows: int
    max_rows: int
    optimal_mean_rows: float

    def __post_init__(self) -> None:
        if not 1 <= self.min_rows <= self.max_rows:
            raise ValueError(f"B={self.num_reqs}: need 1 <= min_rows <= max_rows, got {self.min_rows}, "
                             f"{self.max_rows}")


@dataclass(frozen=True)
class CostEvalReport:
    """Everything `evaluate_cost_models` found; `to_json` for machines, `format_cost_eval` for people."""

    draws_per_batch: int
    seed: int
    tiers: tuple[int, ...]
    batches: tuple[BatchRange, ...]
    models: tuple[ModelEval, ...]
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be distinct, got {names}")

    def model(self, name: str) -> ModelEval:
        for entry in self.models:
            if entry.name == name:
                return entry
        raise KeyError(f"no model named {name!r}; the report has {[m.name for m in self.models]}")

    def to_json(self) -> dict[str, Any]:
        return {"draws_per_batch": self.draws_per_batch, "seed": self.seed, "tiers": list(self.tiers),
                "batches": [dataclasses.asdict(b) for b in self.batches],
                "models": [m.to_json() for m in self.models], "notes": list(self.notes)}


def _verify_only(model: CostModel) -> CostModel:
    if not model.draft_bs_probes:
        return model
    return dataclasses.replace(model, draft_bs_probes=(), draft_seconds=())


def _feasible_max(steps: MeasuredSteps, low: int, high: int) -> int | None:
    """The largest U such that every M in [low, U] has a measured step time; None if `low` has none."""
    readable = np.isfinite(steps.seconds_at(np.arange(low, high + 1)))
    if not readable[0]:
        return None
    gaps = np.flatnonzero(~readable)
    return high if gaps.size == 0 else low + int(gaps[0]) - 1


def _first_best(objective: np.ndarray) -> int:
    # The planner's tie rule, so a model equal to the measured law picks exactly the measured optimum.
    best = objective.max()
    return int(np.argmax(objective >= best - TIE_RTOL * best))


def evaluate_cost_models(result: ProfileResult, models: Mapping[str, CostModel],
                         survival: np.ndarray | torch.Tensor, cfg: ScheduleConfig,
                         draws_per_batch: int = 64, seed: int = 0) -> CostEvalReport:
    """Score each model by the regret of the budgets it makes the planner choose (module doc).

    `survival` is [n, gamma] rows to draw batches from (with replacement, seeded by `seed`);
    `cfg` the planner's floor, cap and survival_eps; `models` name → table.
    """
    if not models:
        raise ValueError("models is empty; pass at least one cost model (e.g. fit_all_models(result))")
    for name, model in models.items():
        if not isinstance(model, (SpsTable, AdditiveCostTable, TierCostTable)):
            raise TypeError(f"models[{name!r}] must be an SpsTable, AdditiveCostTable or TierCostTable, got "
                            f"{type(model).__name__}")
    if isinstance(draws_per_batch, bool) or not isinstance(draws_per_batch, int) or draws_per_batch < 1:
        raise ValueError(f"draws_per_batch must be an integer >= 1, got {draws_per_batch!r}")
    # torch cannot wrap a numpy view with negative strides (e.g. a reversed slice); copy those.
    if isinstance(survival, np.ndarray):
        survival = np.ascontiguousarray(survival)
    rows_of = torch.as_tensor(survival)
    if rows_of.dim() != 2 or rows_of.shape[0] < 1:
        raise ValueError(f"survival must be [n, gamma] with n >= 1 rows to draw from, got shape "
                         f"{tuple(rows_of.shape)}")
    pool = check_survival(rows_of, cfg)  # validates once, up front, instead of inside a random draw
    tiers = result.tiers
    steps_by_b = measured_steps(result, tiers)
    planners = {name: _verify_only(model) for name, model in models.items()}

    notes: list[str] = []
    if result.plan.num_draft_tokens != cfg.num_draft_tokens:
        notes.append(f"the profile measured N={result.plan.num_draft_tokens} rows per request but the "
                     f"survival has gamma={cfg.gamma} (N={cfg.num_draft_tokens}); budgets stay within the "
                     "measured rows")
    dropped = sorted(name for name, model in models.items() if model.draft_bs_probes)
    if dropped:
        notes.append(f"draft terms of {dropped} are left out: the profile measures the verify step only")

    rng = np.random.default_rng(seed)
    regrets: dict[str, dict[int, list[float]]] = {name: {} for name in models}
    chosen_rows: dict[str, dict[int, list[int]]] = {name: {} for name in models}
    batches: list[BatchRange] = []
    for num_reqs, steps in steps_by_b.items():
        low, high = num_reqs * cfg.floor, num_reqs * cfg.cap
        limit = _feasible_max(steps, low, high)
        if limit is None:
            notes.append(f"B={num_reqs}: skipped, the floor needs M={low} rows but the profile has no step "
                         f"time there (measured M {steps.rows[0]}..{steps.rows[-1]})")
            continue
        if limit < high and limit < steps.rows[-1]:
            notes.append(f"B={num_reqs}: budgets stop at M={limit}; M={limit + 1} has no measurement and no "
                         "two measurements of its tier around it")
        optimal_rows: list[int] = []
        for _ in range(draws_per_batch):
            batch = pool[torch.from_numpy(rng.integers(0, pool.shape[0], size=num_reqs))]
            cands = rank_candidates(batch, cfg)
            top = min(cands.values.size, limit - low)
            tau = num_reqs + cands.floor_sum + np.concatenate(([0.0], np.cumsum(cands.values[:top])))
            objective = tau / steps.seconds_at(low + np.arange(top + 1))
            best = _first_best(objective)
            optimal_rows.append(low + best)
            for name, model in planners.items():
                try:
                    decision = choose_budget(batch, model, cfg, max_rows=limit)
                except ValueError as error:
                    note = f"{name}: cannot plan B={num_reqs}: {error}"
                    if note not in notes:
                        notes.append(note)
                    continue
                regret = 100.0 * (1.0 - objective[decision.budget] / objective[best])
                regrets[name].setdefault(num_reqs, []).append(min(max(regret, 0.0), 100.0))
                chosen_rows[name].setdefault(num_reqs, []).append(decision.num_rows)
        batches.append(BatchRange(num_reqs, low, limit, float(np.mean(optimal_rows))))

    evaluations = []
    for name, model in models.items():
        by_batch = tuple(BatchEval(b, RegretStats.of(values), float(np.mean(chosen_rows[name][b])))
                         for b, values in sorted(regrets[name].items()))
        every = [v for values in regrets[name].values() for v in values]
        evaluations.append(ModelEval(name, model.kind, RegretStats.of(every) if every else None, by_batch,
                                     model_fit_quality(model, result.fit_samples(), tiers)))
    return CostEvalReport(draws_per_batch, seed, tiers, tuple(batches), tuple(evaluations), tuple(notes))


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.4f}"


def format_cost_eval(report: CostEvalReport) -> str:
    """Plain-text report: regret per model overall and per B, then fit quality at and away from tiers."""
    tiers = ",".join(map(str, report.tiers)) if report.tiers else "none recorded"
    lines = [f"cost models for the planner: {report.draws_per_batch} survival draws per batch size "
             f"(seed {report.seed}); tiers {tiers}",
             "regret % = 100 * (1 - measured tokens/s of the model's budget / that of the measured-optimal "
             "budget)",
             "",
             f"{'model':<12} {'kind':<9} {'draws':>6} {'mean':>7} {'p50':>7} {'p90':>7} {'max':>7}"]
    for m in report.models:
        r = m.regret
        stats = (f"{r.count:>6} {r.mean:>7.2f} {r.p50:>7.2f} {r.p90:>7.2f} {r.max:>7.2f}" if r
                 else f"{0:>6} {'-':>7} {'-':>7} {'-':>7} {'-':>7}")
        lines.append(f"{m.name:<12} {m.kind:<9} {stats}")

    lines += ["", "per batch size: mean regret % (mean rows chosen); 'optimum' is the measured-optimal rows",
              f"{'B':>5} {'rows':>9} {'optimum':>8} " + " ".join(f"{m.name:>18}" for m in report.models)]
    for b in report.batches:
        cells = []
        for m in report.models:
            entry = next((e for e in m.by_batch if e.num_reqs == b.num_reqs), None)
            cells.append(f"{'-':>18}" if entry is None
                         else f"{f'{entry.regret.mean:.2f} ({entry.mean_rows:.1f})':>18}")
        lines.append(f"{b.num_reqs:>5} {f'{b.min_rows}..{b.max_rows}':>9} {b.optimal_mean_rows:>8.1f} "
                     + " ".join(cells))

    lines += ["", f"fit on the profile samples (verify step; boundary = within ±{TIER_RADIUS} rows of a "
              "tier)",
              f"{'model':<12} {'samples':>7} {'RMS ms':>9} {'R²':>8} {'max|err|%':>10} "
              f"{'boundary ms (n)':>17} {'elsewhere ms (n)':>17}"]
    for m in report.models:
        f = m.fit
        if f is None:
            lines.append(f"{m.name:<12} {'0':>7}  (the model predicts none of the samples)")
            continue
        lines.append(f"{m.name:<12} {f.num_samples:>7} {f.rms_seconds * 1e3:>9.4f} {f.r_squared:>8.4f} "
                     f"{f.max_relative_error * 100:>10.2f} "
                     f"{f'{_ms(f.boundary_mean_abs_error_seconds)} ({f.num_boundary})':>17} "
                     f"{f'{_ms(f.elsewhere_mean_abs_error_seconds)} ({f.num_elsewhere})':>17}")
    if report.notes:
        lines += ["", "notes:"] + [f"  - {note}" for note in report.notes]
    return "\n".join(lines) + "\n"


# --- `dspark cost-eval` ---------------------------------------------------------------------------------
