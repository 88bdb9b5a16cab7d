"""Oracle rows of `dspark report`: the fewest verify rows that would have committed the same tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dspark.report.inputs import RunData, unique_labels


@dataclass(frozen=True)
class OracleRow:
    """Mean verify rows per step: the oracle's, the planner's, the target's and the padded tier's."""

    run: str
    mode: str
    steps: int
    oracle_rows: float
    planned_rows: float
    rows: float
    tier_rows: float


def oracle_rows(runs: Sequence[RunData], labels: Sequence[str] | None = None) -> list[OracleRow]:
    """For cap-accept and compact runs: per step, sum over requests of min(raw_correct_len + 1, N).

    That is the fewest rows that commit the same tokens if the matching prefix were known in advance; it
    bounds how far a better budget could cut the rows, with no timing attached.
    """
    labels = labels or unique_labels([r.path for r in runs])
    out = []
    for run, label in zip(runs, labels, strict=True):
        if run.target_only or not run.verify_mode.plans or not run.steps:
            continue
        n = run.gamma + 1
        oracle = [sum(min(r.raw_correct_len + 1, n) for r in step.requests) for step in run.steps]
        out.append(OracleRow(label, run.verify_mode, len(run.steps), float(np.mean(oracle)),
                             float(np.mean([s.planned_rows for s in run.steps])),
                             float(np.mean([s.rows for s in run.steps])),
                             float(np.mean([s.tier for s in run.steps]))))
    return out
