"""The weighted isotonic (non-decreasing) least-squares fit, numpy only: the cost tables' monotone fits
(`dspark refit-tables`, the online cost refit) and the survival map share it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def isotonic(values: Sequence[float] | np.ndarray, weights: Sequence[float] | np.ndarray | None = None
             ) -> np.ndarray:
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
