"""Non-decreasing fits: verifying more rows, or more requests, never makes a step cheaper.

Step timings are noisy, and an unconstrained fit passes the noise on: a table whose theta dips at
96 rows tells the planner that 96 rows cost less than 80. These fits keep the physics instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def isotonic(values: Sequence[float], weights: Sequence[float] | None = None) -> np.ndarray:
    """The non-decreasing sequence closest to `values` in weighted least squares (pool adjacent
    violators): a run that dips is replaced by its weighted mean; values already in order are kept."""
    y = np.asarray(values, dtype=np.float64)
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=np.float64)
    if y.ndim != 1 or w.shape != y.shape or (w <= 0).any():
        raise ValueError("isotonic needs one positive weight per value")
    means: list[float] = []
    totals: list[float] = []
    counts: list[int] = []
    for value, weight in zip(y, w, strict=True):
        means.append(float(value))
        totals.append(float(weight))
        counts.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            weight = totals[-2] + totals[-1]
            means[-2] = (means[-2] * totals[-2] + means[-1] * totals[-1]) / weight
            totals[-2] = weight
            counts[-2] += counts[-1]
            del means[-1], totals[-1], counts[-1]
    return np.repeat(means, counts)


def cumulative_design(levels: Sequence[int], probes: Sequence[int]) -> np.ndarray:
    """Columns of a fit whose coefficient per probe is a sum of non-negative increments: column k
    (for `probes[k + 1]`) is 1 where the level is at or above that probe. Non-negative least squares
    on these columns fits a non-decreasing function of the level that is 0 at `probes[0]`."""
    level = np.asarray(levels)[:, None]
    return (level >= np.asarray(probes[1:])[None, :]).astype(np.float64)
