"""Calibration metrics of predicted probabilities against 0/1 outcomes: ECE, Brier score, ROC AUC.

numpy float64. `dspark calibrate`, `dspark fit-confidence` and the report's reliability diagrams all
score with these, so a figure means the same wherever it is printed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

DEFAULT_NUM_BINS = 15


def labels_as_bool(labels: Any, what: str, n: int) -> np.ndarray:
    """0/1 (or bool) labels of `n` scores as a bool array; anything else is a ValueError naming `what`."""
    y = np.asarray(labels)
    if y.ndim != 1 or y.shape[0] != n:
        raise ValueError(f"{what}: labels must be a 1-D array of the same length as the scores ({n}), "
                         f"got shape {y.shape}")
    if y.dtype == np.bool_:
        return y
    if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
        raise ValueError(f"{what}: labels must be bool or 0/1 numbers, got dtype {y.dtype}")
    exact = (y == 0) | (y == 1)
    if not exact.all():
        bad = int(np.flatnonzero(~exact)[0])
        raise ValueError(f"{what}: labels must be 0 or 1, label[{bad}] is {y[bad]!r}")
    return y == 1


def _scores(values: Any, what: str, *, probabilities: bool) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.shape[0] == 0:
        raise ValueError(f"{what}: expected a non-empty 1-D array of scores, got shape {x.shape}")
    if not np.isfinite(x).all():
        bad = int(np.flatnonzero(~np.isfinite(x))[0])
        raise ValueError(f"{what}: score[{bad}] is {x[bad]}; scores must be finite")
    if probabilities and ((x < 0.0) | (x > 1.0)).any():
        bad = int(np.flatnonzero((x < 0.0) | (x > 1.0))[0])
        raise ValueError(f"{what}: probability[{bad}] is {x[bad]}; probabilities must lie in [0, 1]")
    return x


def bin_index(p: np.ndarray, num_bins: int) -> np.ndarray:
    """The equal-width bin of each probability: bin i is exactly [i/B, (i+1)/B), and 1.0 joins the last."""
    # Edges as i/B (correctly rounded), not p * B, whose rounding would move values at an edge.
    edges = np.arange(num_bins + 1, dtype=np.float64) / num_bins
    return np.minimum(np.searchsorted(edges, p, side="right") - 1, num_bins - 1)


def binned_ece(p: np.ndarray, y: np.ndarray, num_bins: int) -> float:
    """`ece` without the input checks, for callers that validated `p` (float64 in [0, 1]) and `y` (bool)."""
    idx = bin_index(p, num_bins)
    sum_p = np.bincount(idx, weights=p, minlength=num_bins)
    sum_y = np.bincount(idx, weights=y.astype(np.float64), minlength=num_bins)
    # sum_b (n_b / n) * |mean_y_b - mean_p_b| == sum_b |sum_y_b - sum_p_b| / n; empty bins add 0.
    return float(np.abs(sum_y - sum_p).sum() / p.shape[0])


def binned_eces(p: np.ndarray, y: np.ndarray, num_bins: int) -> np.ndarray:
    """`binned_ece(p[d], y[d], num_bins)` for every row `d` of `p` and `y` (`[D, n]` each, or broadcast to
    it), in one pass: `[D]`, each the bits `binned_ece` gives (the same per-bin accumulation order)."""
    p, y = np.broadcast_arrays(p, y)
    rows, n = p.shape
    cells = (bin_index(p, num_bins) + np.arange(rows)[:, None] * num_bins).ravel()  # (row, bin)
    sum_p = np.bincount(cells, weights=p.ravel(), minlength=rows * num_bins).reshape(rows, num_bins)
    sum_y = np.bincount(cells, weights=y.ravel().astype(np.float64), minlength=rows * num_bins)
    return np.abs(sum_y.reshape(rows, num_bins) - sum_p).sum(axis=1) / n


def ece(probs: Any, labels: Any, num_bins: int = DEFAULT_NUM_BINS) -> float:
    """Expected calibration error: equal-width bins over [0, 1], count-weighted |mean label − mean prob|."""
    if isinstance(num_bins, bool) or not isinstance(num_bins, (int, np.integer)) or num_bins < 1:
        raise ValueError(f"ece: num_bins must be a positive integer, got {num_bins!r}")
    p = _scores(probs, "ece", probabilities=True)
    return binned_ece(p, labels_as_bool(labels, "ece", p.shape[0]), int(num_bins))


def brier(probs: Any, labels: Any) -> float:
    """Brier score: mean squared difference between the probability and the 0/1 outcome."""
    p = _scores(probs, "brier", probabilities=True)
    y = labels_as_bool(labels, "brier", p.shape[0])
    return float(np.mean((p - y) ** 2))


def _average_ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    starts = np.concatenate(([0], np.flatnonzero(np.diff(sorted_x)) + 1))
    ends = np.concatenate((starts[1:], [x.shape[0]]))
    # 1-based ranks start+1 .. end share their mean.
    mean_rank = (starts + 1 + ends) / 2.0
    ranks = np.empty(x.shape[0], dtype=np.float64)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return ranks


def roc_auc(scores: Any, labels: Any) -> float | None:
    """Area under the ROC curve by the rank-sum formula (ties count 1/2); None when one class is absent."""
    s = _scores(scores, "roc_auc", probabilities=False)
    y = labels_as_bool(labels, "roc_auc", s.shape[0])
    n_pos = int(y.sum())
    n_neg = y.shape[0] - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    rank_sum = float(_average_ranks(s)[y].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)
