"""Fit step-cost tables from measured verify step times (pure numpy, no model needed).

Three tables come out of one profile (docs/planner.md):

* the 1D SPS table, `steps/s` at `M = B·N` for each profiled batch size, looked up by floor, which
  reproduces the measured static sweep (a tier cliff included) wherever it does not dip: a larger
  step measured faster than a smaller one is pooled with it (isotonic regression);
* the additive table `T(B, M) = bias + alpha(B) + theta(M)`, fitted by non-negative least squares on
  binned `M` with alpha and theta built from non-negative increments (so neither ever decreases),
  and evaluated by the runtime with `theta` linearly interpolated at the *unbinned* `M`.
  The fit's residuals are therefore computed with the table's own `step_time`, which is what the
  planner will see, not with the binned design matrix;
* the tier table, `T(B, tier)` per profiled batch size and graph tier, the median of the samples whose
  `M` falls in `(previous tier, tier]`: the piecewise law of graph replay, cliffs kept exactly; a
  dip along the tiers is pooled (isotonic) and a dip along B lifted to the smaller B's cell.

Every table comes out monotone (docs/planner.md): more rows or more requests never cost less, which
the table files also require of any table they are given.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from dspark.formats.profile import DEFAULT_M_BIN, ProfileResult, Sample
from dspark.measure.monotone import cumulative_design
from dspark.measure.residuals import FitResidual, fit_quality
from dspark.runtime.planner.cost_models import AdditiveCostTable, SpsTable, TierCostTable
from dspark.runtime.planner.isotonic import isotonic


def nnls(a: np.ndarray, b: np.ndarray, *, tol: float | None = None,
         max_iter: int | None = None) -> np.ndarray:
    """Solve `min ||a x - b||_2` subject to `x >= 0` (Lawson–Hanson active set).

    `tol` is the gradient threshold below which no further variable is freed; the default scales with
    the problem like LAPACK-style rank tolerances do, so the caller need not know the units of `b`.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 1 or a.shape[0] != b.shape[0]:
        raise ValueError(f"nnls needs a (m, n) matrix and an (m,) vector, got {a.shape} and {b.shape}")
    m, n = a.shape
    if tol is None:
        col_norm = float(np.abs(a).sum(axis=0).max(initial=0.0))
        tol = 10.0 * np.finfo(np.float64).eps * max(m, n) * col_norm * float(np.abs(b).max(initial=0.0))
    if max_iter is None:
        max_iter = 3 * n + 10

    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    # Variables whose freeing the gradient asked for but the solve refused (a rounding artefact near
    # the optimum); excluded until x moves again, so the outer loop cannot cycle on them.
    refused = np.zeros(n, dtype=bool)
    gradient = a.T @ b
    iterations = 0
    while True:
        candidates = ~passive & ~refused
        if not candidates.any():
            break
        j = int(np.argmax(np.where(candidates, gradient, -np.inf)))
        if gradient[j] <= tol:
            break
        passive[j] = True
        trial = _solve_on(a, b, passive)
        if trial[j] <= 0.0:
            passive[j] = False
            refused[j] = True
            continue
        while np.any(trial[passive] <= 0.0):
            iterations += 1
            if iterations > max_iter:
                raise RuntimeError(f"nnls did not converge in {max_iter} iterations; the design matrix is "
                                   "probably badly conditioned (check for duplicated columns)")
            # Step from x towards the unconstrained solution only as far as feasibility allows and
            # drop the variable that reached zero; every iterate stays feasible.
            blocking = np.flatnonzero(passive & (trial <= 0.0))
            ratios = x[blocking] / (x[blocking] - trial[blocking])
            x = x + float(ratios.min()) * (trial - x)
            x[blocking[np.argmin(ratios)]] = 0.0
            passive &= x > 0.0
            x[~passive] = 0.0
            trial = _solve_on(a, b, passive)
        x = trial
        refused[:] = False
        gradient = a.T @ (b - a @ x)
    return x


def _solve_on(a: np.ndarray, b: np.ndarray, passive: np.ndarray) -> np.ndarray:
    """Unconstrained least squares on the passive columns, zero elsewhere."""
    out = np.zeros(a.shape[1])
    if passive.any():
        out[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
    return out


def bin_rows(num_rows: int, m_bin: int = DEFAULT_M_BIN) -> int:
    """Bin a row count for the additive fit: `round(M / m_bin) · m_bin`, halves rounded up, at least 1.

    Halves round up (not Python's round-half-even) so that equal-width bins are centred on their
    probe for every bin. The zero bin (`M < m_bin / 2`) is placed at `M = 1`, the smallest legal row
    count: the table needs probes >= 1, and a fixed placement keeps the bin a pure function of `M`
    (placing it at the smallest measured `M` would make the probes depend on the sampled grid).
    """
    if m_bin < 1:
        raise ValueError(f"m_bin must be >= 1, got {m_bin}")
    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}")
    return max(((2 * num_rows + m_bin) // (2 * m_bin)) * m_bin, 1)


def _check_samples(samples: Iterable[Sample]) -> list[Sample]:
    out = []
    for num_reqs, num_rows, seconds in samples:
        if num_reqs < 1 or num_rows < num_reqs:
            raise ValueError(f"sample (B={num_reqs}, M={num_rows}) is impossible: need 1 <= B <= M")
        if not np.isfinite(seconds) or seconds <= 0.0:
            raise ValueError(f"sample (B={num_reqs}, M={num_rows}) has step time {seconds!r}; "
                             "step times must be finite and > 0 seconds")
        out.append((int(num_reqs), int(num_rows), float(seconds)))
    if not out:
        raise ValueError("no samples to fit; run the profile first")
    return out


def fit_draft_seconds(seconds: Iterable[float]) -> tuple[float, ...]:
    """Per-B step times (the draft's, a target-only decode step's) made non-decreasing in B (isotonic):
    more requests never take less time, whatever one noisy median says."""
    return tuple(float(s) for s in isotonic(list(seconds)))


def fit_sps_table(static_samples: Iterable[Sample], max_batch_tokens: int) -> SpsTable:
    """The 1D SPS table from static-sweep samples `(B, M = B·N, seconds)`: steps/s = 1 / seconds.

    Samples that share `M` are pooled by their median, so the probes come out strictly increasing; the
    medians are then made non-decreasing in `M` (isotonic, weighted by sample count), so no larger
    step is priced faster than a smaller one.
    """
    by_rows: dict[int, list[float]] = defaultdict(list)
    for _, num_rows, seconds in _check_samples(static_samples):
        by_rows[num_rows].append(seconds)
    rows = tuple(sorted(by_rows))
    seconds = isotonic([float(np.median(by_rows[m])) for m in rows], [len(by_rows[m]) for m in rows])
    sps = tuple(1.0 / float(s) for s in seconds)
    return SpsTable(sample_batch_tokens=rows, sample_steps_per_sec=sps, max_batch_tokens=max_batch_tokens)


@dataclass(frozen=True)
class AdditiveFit:
    """The fitted additive table and how well it reproduces the samples it was fitted on."""

    table: AdditiveCostTable
    m_bin: int
    residuals: tuple[FitResidual, ...]
    rms_seconds: float
    r_squared: float
    max_relative_error: float


def fit_additive(samples: Iterable[Sample], m_bin: int = DEFAULT_M_BIN) -> AdditiveFit:
    """Fit `seconds ≈ bias + alpha[B] + theta[bin(M)]` by non-negative least squares.

    Identifiability: alpha at the smallest `B` and theta at the smallest bin are pinned to 0, so `bias`
    is the step time at the cheapest measured corner. alpha and theta are sums of non-negative
    increments (column k of each is 1 from its k-th probe on), which encodes the physical law that
    more requests or more rows never make a step cheaper; measurement noise that says otherwise is
    clamped rather than written into the table.
    The bias is also kept at or above half the fastest measured step: with noisy timings the
    least-squares optimum can otherwise move all of the cost into alpha and theta and leave a table
    that prices the cheapest corner at zero seconds (which the table rightly rejects).
    """
    checked = _check_samples(samples)
    batch_sizes = sorted({b for b, _, _ in checked})
    bins = sorted({bin_rows(m, m_bin) for _, m, _ in checked})
    design = np.hstack((np.ones((len(checked), 1)),
                        cumulative_design([b for b, _, _ in checked], batch_sizes),
                        cumulative_design([bin_rows(m, m_bin) for _, m, _ in checked], bins)))
    measured = np.array([s for _, _, s in checked])

    # Solve in units of the largest measurement so the tolerance does not depend on seconds vs ms.
    scale = float(measured.max())
    bias_floor = 0.5 * float(measured.min())
    coef = nnls(design, (measured - bias_floor) / scale) * scale
    alpha_steps, theta_steps = np.split(coef[1:], [len(batch_sizes) - 1])
    table = AdditiveCostTable(
        bias_seconds=float(coef[0] + bias_floor),
        bs_probes=tuple(batch_sizes),
        alpha_seconds=(0.0, *(float(x) for x in np.cumsum(alpha_steps))),
        m_probes=tuple(bins),
        theta_seconds=(0.0, *(float(x) for x in np.cumsum(theta_steps))),
    )

    residuals = tuple(FitResidual(b, m, s, float(table.step_time(b, m))) for b, m, s in checked)
    rms, r_squared, max_relative = fit_quality(residuals)
    return AdditiveFit(table=table, m_bin=m_bin, residuals=residuals, rms_seconds=rms,
                       r_squared=r_squared, max_relative_error=max_relative)


def largest_residuals(fit: AdditiveFit, count: int) -> list[FitResidual]:
    """The `count` samples the additive table reproduces worst, largest absolute residual first."""
    return sorted(fit.residuals, key=lambda r: abs(r.residual_seconds), reverse=True)[:count]


@dataclass(frozen=True)
class TierFit:
    """The fitted tier table and how well it reproduces the samples it was fitted on.

    `filled` lists the cells no sample measured, as `(B, tier, B copied from)`; `notes` says the same
    in words, plus any samples above the last tier (outside the table, so not in `residuals`).
    """

    table: TierCostTable
    residuals: tuple[FitResidual, ...]
    rms_seconds: float
    r_squared: float
    max_relative_error: float
    filled: tuple[tuple[int, int, int], ...] = ()
    notes: tuple[str, ...] = ()


def _check_tiers(tiers: Iterable[int]) -> tuple[int, ...]:
    out = tuple(tiers)
    if not out:
        raise ValueError("tiers is empty; give the graph tiers (token counts) the steps are padded to")
    for i, tier in enumerate(out):
        if isinstance(tier, bool) or not isinstance(tier, (int, np.integer)) or tier < 1:
            raise ValueError(f"tiers item {i} is {tier!r}; tiers are token counts >= 1")
        if i and tier <= out[i - 1]:
            raise ValueError(f"tiers must be strictly increasing: item {i} ({tier}) follows {out[i - 1]}; "
                             "sort them and remove duplicates")
    return tuple(int(t) for t in out)


def fit_tier_table(result: ProfileResult, tiers: Iterable[int]) -> TierFit:
    """The tier table of one profile: per profiled B and tier, the median of the sample medians
    (static and grid) whose M lies in `(previous tier, tier]`.

    A cell no sample measured is copied from the nearest measured B of the same tier (the smaller B
    on a tie), never from a neighbouring tier: that would put back the smoothing the table avoids.
    A tier with no sample at any B cannot be filled and is an error naming it.
    """
    tier_list = _check_tiers(tiers)
    last = tier_list[-1]
    checked = _check_samples(result.fit_samples())
    inside = [sample for sample in checked if sample[1] <= last]
    above = sorted({(b, m) for b, m, _ in checked if m > last})
    if not inside:
        raise ValueError(f"every sample has M above the last tier {last}; the tiers do not match this "
                         "profile (check result.meta['tiers'])")

    cells: dict[tuple[int, int], list[float]] = defaultdict(list)
    for num_reqs, num_rows, seconds in inside:
        cells[(num_reqs, bisect_left(tier_list, num_rows))].append(seconds)
    batch_sizes = sorted({b for b, _, _ in inside})
    measured_in = {j: [b for b in batch_sizes if (b, j) in cells] for j in range(len(tier_list))}
    empty = [j for j, found in measured_in.items() if not found]
    if empty:
        bounds = ", ".join(f"{tier_list[j]} (M in ({tier_list[j - 1] if j else 0}, {tier_list[j]}])"
                           for j in empty)
        raise ValueError(f"tiers {bounds} have no profiled sample at any batch size, so their step time is "
                         "unknown; profile rows in them (ProfilePlan.extra_rows=rows_around(tiers)) or drop "
                         "them from the tiers")

    grid = np.zeros((len(batch_sizes), len(tier_list)))
    counts = np.zeros_like(grid)
    filled: list[tuple[int, int, int]] = []
    for i, num_reqs in enumerate(batch_sizes):
        for j in range(len(tier_list)):
            source = num_reqs
            if (num_reqs, j) not in cells:
                source = min(measured_in[j], key=lambda b: (abs(b - num_reqs), b))
                filled.append((num_reqs, tier_list[j], source))
            grid[i, j] = float(np.median(cells[(source, j)]))
            counts[i, j] = len(cells[(source, j)])
    # A larger tier never costs less (pooled along each B's tiers), nor do more requests (each cell at
    # least the cell of the next smaller B; the running maximum of non-decreasing rows stays so).
    grid = np.maximum.accumulate(np.array([isotonic(row, n) for row, n in zip(grid, counts, strict=True)]),
                                 axis=0)
    table = TierCostTable(tiers=tier_list, bs_probes=tuple(batch_sizes),
                          step_seconds=tuple(tuple(float(x) for x in row) for row in grid))

    notes = []
    by_tier: dict[tuple[int, int], list[int]] = defaultdict(list)
    for num_reqs, tier, source in filled:
        by_tier[(tier, source)].append(num_reqs)
    for (tier, source), targets in sorted(by_tier.items()):
        notes.append(f"tier {tier}: no sample at B={', '.join(map(str, targets))}; copied from B={source}")
    if above:
        example = f"B={above[0][0]} M={above[0][1]}"
        notes.append(f"{len(above)} samples above the last tier {last} (e.g. {example}) are outside the "
                     "table and not in the residuals")
    residuals = tuple(FitResidual(b, m, s, float(table.step_time(b, m))) for b, m, s in inside)
    rms, r_squared, max_relative = fit_quality(residuals)
    return TierFit(table=table, residuals=residuals, rms_seconds=rms, r_squared=r_squared,
                   max_relative_error=max_relative, filled=tuple(filled), notes=tuple(notes))
