"""STS, the per-position temperature scaling of the draft's confidence logits: its temperature grid and its
fit, shared by `dspark calibrate` (offline, `dspark.measure.calibration`) and the server's online calibration
(`online_calibration`). numpy float64 only (the online refit runs in a thread beside the step).

`fit_temperatures` picks one `T_k` per draft position, left to right, each minimising the binned ECE of the
cumulative survival `s[:, k] = prod_{i<=k} sigmoid(z[:, i] / T_i)` against the label "the accepted prefix
reached draft k" over the rows whose label is known, keeping the temperatures already fitted for positions
< k: the survival the planner will compute is what was calibrated. Ties (within `ECE_TIE_TOLERANCE`) keep the
smaller T. A position with fewer than `min_known` known labels keeps its previous temperature.

`objective="nll"` minimises the log loss of the same survival instead (the online refit's): a proper score,
smooth in T. On a window of a few thousand request-steps whose later positions are labelled only where the
planner verified them (compact: the high scores), the binned ECE sees a few bins, and its minimum can sit at
the grid's edge (T 0.11: every score a near-certainty), which the log loss of the few misses among them
forbids. `dspark calibrate` fits what the ECE targets measure, on recordings of every row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from dspark.runtime.planner.calibration_metrics import binned_eces
from dspark.runtime.planner.survival_map import SurvivalMap

DEFAULT_GRID_POINTS = 41
DEFAULT_T_MIN = 0.1
DEFAULT_T_MAX = 10.0
# ECE values closer than this are the same number up to summation order; the smaller T wins such ties so
# that the fit does not depend on floating-point noise.
ECE_TIE_TOLERANCE = 1e-15
NLL_EPS = 1e-12  # the survival is clipped this far from 0 and 1 in the log loss: a certain miss costs 27.6


class CalibrationError(ValueError):
    """A calibration setting or fit result is unusable; the message says what to change."""


def default_grid(points: int = DEFAULT_GRID_POINTS, t_min: float = DEFAULT_T_MIN,
                 t_max: float = DEFAULT_T_MAX) -> np.ndarray:
    """`points` temperatures log-spaced from `t_min` to `t_max` (inclusive)."""
    if isinstance(points, bool) or not isinstance(points, int) or points < 1:
        raise CalibrationError(f"grid points must be a positive integer, got {points!r}")
    if not (math.isfinite(t_min) and math.isfinite(t_max) and 0 < t_min <= t_max):
        raise CalibrationError(f"temperature range must satisfy 0 < t_min <= t_max (finite), got "
                               f"t_min={t_min}, t_max={t_max}")
    if points == 1 and t_min != t_max:
        raise CalibrationError("a one-point grid needs t_min == t_max; give at least 2 grid points")
    return np.geomspace(t_min, t_max, points)


def check_grid(grid: Any) -> np.ndarray:
    """A grid as sorted unique float64 temperatures (the tie rule prefers the smaller T)."""
    g = np.unique(np.asarray(grid, dtype=np.float64))
    if g.ndim != 1 or g.shape[0] == 0:
        raise CalibrationError("the temperature grid is empty; give at least one temperature")
    if not (np.isfinite(g) & (g > 0)).all():
        raise CalibrationError(f"grid temperatures must be finite and > 0, got {g.tolist()}")
    return g


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x << 0: the sigmoid is then 0, exactly
        return 1.0 / (1.0 + np.exp(-x))


def cumulative_survival(logits: np.ndarray, temperatures: Sequence[float],
                        survival_map: SurvivalMap | None = None) -> np.ndarray:
    """The planner's survival `cumprod(sigmoid(z / T))` of `[n, k]` logits with `k` temperatures, float64
    (then the calibration's `survival_map`, where there is one).

    numpy, not the planner's torch function: the online refit runs it in a background thread, where torch's
    intra-op threads would compete with the step's own on every core."""
    z = np.asarray(logits, dtype=np.float64)
    survival = np.cumprod(sigmoid(z / np.asarray(temperatures, dtype=np.float64)[None, :]), axis=1)
    return survival if survival_map is None else survival_map.apply(survival)


def grid_nlls(prefix: np.ndarray | None, z: np.ndarray, y: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """The mean log loss of `prefix * sigmoid(z / T)` against `y` for every T of `grid`: `[G]`."""
    q = sigmoid(z[None, :] / grid[:, None])  # [G, n]
    s = np.clip(prefix[None, :] * q if prefix is not None else q, NLL_EPS, 1.0 - NLL_EPS)
    # one log a row, of the side its label took (the two logs and a select cost a third more)
    return -np.log(np.where(y[None, :], s, 1.0 - s)).mean(axis=1)


def grid_eces(prefix: np.ndarray | None, z: np.ndarray, y: np.ndarray, grid: np.ndarray,
              num_bins: int) -> np.ndarray:
    """The binned ECE of `prefix * sigmoid(z / T)` against `y` for every T of `grid`, in one pass: `[G]`.

    Each column is the bits `binned_ece(cumulative_survival(...)[:, k], y)` computes for that T (the same
    division, sigmoid, product and per-bin accumulation order): the fit does not depend on the vectorising."""
    q = sigmoid(z[None, :] / grid[:, None])  # [G, n]
    return binned_eces(prefix[None, :] * q if prefix is not None else q, y[None, :], num_bins)


def fit_temperatures(logits: np.ndarray, labels: np.ndarray, grid: np.ndarray, num_bins: int,
                     known: np.ndarray | None = None, previous: Sequence[float] | None = None,
                     min_known: int = 1, objective: Literal["ece", "nll"] = "ece") -> tuple[float, ...]:
    """Temperatures for `logits [n, gamma]` (finite) and `labels [n, gamma]` (bool: the prefix reached draft
    k), over the rows `known [n, gamma]` marks at each position (all when None), minimising `objective`; see
    the module docstring."""
    n, gamma = logits.shape
    temps: list[float] = []
    for k in range(gamma):
        rows = np.ones(n, dtype=bool) if known is None else known[:, k]
        if int(rows.sum()) < max(min_known, 1):
            temps.append(1.0 if previous is None else float(previous[k]))
            continue
        z = logits[rows, :k + 1]
        prefix = cumulative_survival(z[:, :k], temps)[:, k - 1] if k else None
        zk, yk = np.ascontiguousarray(z[:, k]), labels[rows, k]
        scores = grid_nlls(prefix, zk, yk, grid) if objective == "nll" else grid_eces(prefix, zk, yk, grid,
                                                                                      num_bins)
        temps.append(float(grid[int(np.flatnonzero(scores <= scores.min() + ECE_TIE_TOLERANCE)[0])]))
    return tuple(temps)
