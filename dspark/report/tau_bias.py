"""tau section of `dspark report`: `actual − tau` per step (committed tokens minus the planner's
prediction) by run, batch size, lag, policy and graph tier."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dspark.formats.step_records import StepRecord
from dspark.report.inputs import RunData, unique_labels


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
    labels = labels or unique_labels([r.path for r in runs])
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
