"""Cost-model section of `dspark report`: profiled step times against each table, the fit error near
graph tiers and elsewhere (`dspark.measure.residuals`), and the panels of the cost plot."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dspark.formats.profile import Sample
from dspark.measure.residuals import FitQuality, model_fit_quality, predict_seconds
from dspark.runtime.planner.cost_models import CostModel


@dataclass(frozen=True)
class ResidualRow:
    """How well one table reproduces the profiled medians (measured − predicted)."""

    model: str
    fit: FitQuality | None  # None when the table predicts none of the samples
    out_of_range: int  # samples the table cannot predict (beyond its max_rows)


def residual_table(samples: Sequence[Sample], models: Sequence[tuple[str, CostModel]],
                   tiers: Sequence[int]) -> list[ResidualRow]:
    """One row per model over `samples` = `(B, M, median seconds)`."""
    rows = []
    for name, model in models:
        fit = model_fit_quality(model, samples, tiers)
        rows.append(ResidualRow(name, fit, len(samples) if fit is None else fit.num_outside))
    return rows


@dataclass(frozen=True)
class CostPanel:
    """Measured medians of one batch size and each model's prediction over every M in their range."""

    num_reqs: int
    rows: np.ndarray
    seconds: np.ndarray
    model_rows: np.ndarray
    predictions: Mapping[str, np.ndarray]  # NaN where a model cannot predict


def cost_panels(samples: Sequence[Sample], models: Sequence[tuple[str, CostModel]],
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


CONTEXT_BUCKET = 128  # tokens: the report groups recorded steps by mean context in buckets this wide


@dataclass(frozen=True)
class ContextRow:
    """Recorded drafted steps whose batch's mean context fell in one bucket: the measured step time against
    the planner's price (the table's, then with the measured step offset it added)."""

    bucket: str
    steps: int
    measured_seconds: float
    table_seconds: float  # predicted_step_seconds - offset_seconds
    priced_seconds: float  # predicted_step_seconds: what the budget weighed
    online_seconds: float  # offset_slope * predicted_step_seconds: the planner's whole prediction

    @property
    def table_ratio(self) -> float:
        return self.table_seconds / self.measured_seconds


def step_time_by_context(steps: Sequence[Any]) -> list[ContextRow]:
    """Per context bucket, the mean measured and predicted step time of the recorded steps that were priced
    (a predicted step time) at a recorded context (recordings since the planner priced the context)."""
    groups: dict[int, list[Any]] = {}
    for step in steps:
        if step.predicted_step_seconds is not None and step.context_len is not None:
            groups.setdefault(int(step.context_len // CONTEXT_BUCKET), []).append(step)
    rows = []
    for bucket in sorted(groups):
        group = groups[bucket]
        measured = float(np.mean([s.step_seconds for s in group]))
        priced = float(np.mean([s.predicted_step_seconds for s in group]))
        table = float(np.mean([s.predicted_step_seconds - s.offset_seconds for s in group]))
        online = float(np.mean([s.offset_slope * s.predicted_step_seconds for s in group]))
        low = bucket * CONTEXT_BUCKET
        rows.append(ContextRow(f"{low}-{low + CONTEXT_BUCKET - 1}", len(group), measured, table, priced,
                               online))
    return rows
