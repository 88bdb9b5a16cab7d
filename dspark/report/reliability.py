"""Calibration section of `dspark report`: reliability of the confidence and the survival, before and
after the STS temperatures, pooled per policy and gamma (greedy labels do not carry over to sampling)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dspark.formats.sts_calibration import CalibrationFileContents
from dspark.measure.scores import confidence, mapped_scores, survival
from dspark.report.inputs import ReportError, RunData, StsSamples, unique_labels
from dspark.runtime.planner.calibration_metrics import DEFAULT_NUM_BINS, bin_index, brier, ece, roc_auc
from dspark.runtime.planner.survival_map import SurvivalMap

NUM_BINS = DEFAULT_NUM_BINS


@dataclass(frozen=True)
class Reliability:
    """A reliability diagram over equal-width confidence bins, with ECE, Brier score and AUROC."""

    counts: np.ndarray
    mean_confidence: np.ndarray  # NaN in empty bins
    event_rate: np.ndarray  # NaN in empty bins
    ece: float
    brier: float
    auroc: float

    @property
    def num_samples(self) -> int:
        return int(self.counts.sum())


def reliability(probability: np.ndarray, event: np.ndarray, num_bins: int = NUM_BINS) -> Reliability:
    """Bin `probability` in [0, 1] into `num_bins` equal-width bins (1.0 in the last) against the 0/1
    `event`, the bins the ECE uses. ECE, Brier and AUROC are NaN without samples."""
    conf = np.asarray(probability, dtype=np.float64).ravel()
    hit = np.asarray(event, dtype=bool).ravel()
    if conf.shape != hit.shape:
        raise ValueError(f"confidence has {conf.size} values but event has {hit.size}")
    index = bin_index(conf, num_bins)
    counts = np.bincount(index, minlength=num_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.bincount(index, weights=conf, minlength=num_bins) / counts
        rate = np.bincount(index, weights=hit.astype(np.float64), minlength=num_bins) / counts
    if conf.size == 0:
        return Reliability(counts, mean_conf, rate, math.nan, math.nan, math.nan)
    auroc = roc_auc(conf, hit)
    return Reliability(counts, mean_conf, rate, ece(conf, hit, num_bins), brier(conf, hit),
                       math.nan if auroc is None else auroc)


@dataclass(frozen=True)
class CalibrationGroup:
    """STS rows of every run with one policy and gamma, scored before (T=1) and, given a file, after STS.

    `conditional[k]`: sigmoid(z_k / T_k) against "draft k accepted", over rows whose prefix reached k.
    `cumulative[k]`: survival cumprod(sigmoid(z / T))[k] against prefix_mask[k], over every row.
    Each maps "before" / "after" to one `Reliability` per position.
    """

    policy: str
    gamma: int
    runs: tuple[str, ...]
    num_samples: int
    skipped_requests: int
    temperatures: tuple[float, ...] | None
    conditional: Mapping[str, tuple[Reliability, ...]]
    cumulative: Mapping[str, tuple[Reliability, ...]]


Scored = tuple[tuple["Reliability", ...], tuple["Reliability", ...]]


def _score(logits: np.ndarray, mask: np.ndarray, temps: tuple[float, ...] | None,
           survival_map: SurvivalMap | None = None) -> Scored:
    cum_survival = survival(logits, temps)
    cum_survival, cond_conf = (mapped_scores(survival_map, cum_survival) if survival_map is not None
                               else (cum_survival, confidence(logits, temps)))
    conditional, cumulative = [], []
    for k in range(logits.shape[1]):
        reached = np.ones(len(mask), dtype=bool) if k == 0 else mask[:, k - 1]
        conditional.append(reliability(cond_conf[reached, k], mask[reached, k]))
        cumulative.append(reliability(cum_survival[:, k], mask[:, k]))
    return tuple(conditional), tuple(cumulative)


def calibration_groups(runs: Sequence[RunData], calibration: CalibrationFileContents | None,
                       labels: Sequence[str] | None = None,
                       calibration_name: str = "the calibration") -> list[CalibrationGroup]:
    """Pool the runs' STS rows per (policy, gamma): greedy labels do not carry over to sampling."""
    labels = labels or unique_labels([r.path for r in runs])
    pooled: dict[tuple[str, int], list[tuple[str, StsSamples]]] = defaultdict(list)
    for run, label in zip(runs, labels, strict=True):
        if run.sts is not None and len(run.sts.logits):
            pooled[(run.sts.policy, run.gamma)].append((label, run.sts))
    groups = []
    for (policy, gamma), members in sorted(pooled.items()):
        logits = np.concatenate([s.logits for _, s in members])
        mask = np.concatenate([s.prefix_mask for _, s in members])
        scored = {"before": _score(logits, mask, None)}
        temps = None
        if calibration is not None:
            if len(calibration.temperatures) != gamma:
                raise ReportError(f"{calibration_name}: has {len(calibration.temperatures)} temperatures but "
                                  f"the runs {[m for m, _ in members]} have gamma={gamma}; pass the "
                                  "calibration fitted for this deployment")
            temps = calibration.temperatures
            knots = calibration.survival_map
            scored["after"] = _score(logits, mask, temps,
                                     None if knots is None else SurvivalMap.from_knots(knots))
        groups.append(CalibrationGroup(
            policy=policy, gamma=gamma, runs=tuple(m for m, _ in members), num_samples=len(logits),
            skipped_requests=sum(s.skipped_requests for _, s in members), temperatures=temps,
            conditional={when: pair[0] for when, pair in scored.items()},
            cumulative={when: pair[1] for when, pair in scored.items()}))
    return groups
