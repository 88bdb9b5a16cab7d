"""STS: per-position temperature scaling of the draft's confidence logits (docs/planner.md).

The runtime records, per verified request, the raw confidence logits `z[k]` of the `gamma` drafts and
`prefix_mask[k] = k < correct_len` of the uncapped match (`dspark.formats.sts_shards`). STS picks one
temperature `T_k` per draft position, left to right, so that the cumulative survival
`s[k] = prod_{i<=k} sigmoid(z[i] / T_i)` agrees with how often the accepted prefix actually reaches draft
k. The objective is the ECE of that cumulative survival, not of the per-position conditional score,
because the planner spends rows on survival values; the survival is the planner's own
(`dspark.measure.scores`). The calibration file keeps SGLang's field names
(`dspark.formats.sts_calibration`) so either runtime can read it.

Survival is a predicted probability of reaching a position; it is not a measured acceptance rate, and the
report below never calls it one. Greedy labels do not carry over to sampling: calibrate per policy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dspark.formats.sts_calibration import CalibrationFileContents, calibration_json, write_calibration
from dspark.formats.sts_shards import StsData
from dspark.measure.scores import confidence, mapped_scores, survival
from dspark.runtime.planner.calibration_metrics import DEFAULT_NUM_BINS, binned_ece, roc_auc
from dspark.runtime.planner.sts import CalibrationError, check_grid, default_grid, fit_temperatures
from dspark.runtime.planner.survival_map import SurvivalMap, fit_survival_map


@dataclass(frozen=True)
class StsFit:
    """Fitted temperatures and per-position metrics; 'before' means every T = 1 (the raw head).

    The cumulative metrics compare survival `s[:, k]` with `prefix_mask[:, k]` over all rows. The
    conditional ones compare `sigmoid(z[:, k] / T_k)` with `prefix_mask[:, k]` over the rows whose prefix
    reached draft k − 1 (all rows for k = 0); None where no row did.
    """

    temperatures: tuple[float, ...]
    num_samples: int
    num_bins: int
    grid: tuple[float, ...]
    ece_before: tuple[float, ...]
    ece_after: tuple[float, ...]
    brier_before: tuple[float, ...]
    brier_after: tuple[float, ...]
    auc_before: tuple[float | None, ...]
    auc_after: tuple[float | None, ...]
    mean_survival_before: tuple[float, ...]
    mean_survival_after: tuple[float, ...]
    reach_rate: tuple[float, ...]
    conditional_rows: tuple[int, ...]
    conditional_ece_before: tuple[float | None, ...]
    conditional_ece_after: tuple[float | None, ...]
    survival_map: SurvivalMap | None = None  # fitted after the temperatures; "after" includes it

    def __post_init__(self) -> None:
        gamma = len(self.temperatures)
        for name in ("ece_before", "ece_after", "brier_before", "brier_after", "auc_before", "auc_after",
                     "mean_survival_before", "mean_survival_after", "reach_rate", "conditional_rows",
                     "conditional_ece_before", "conditional_ece_after"):
            if len(getattr(self, name)) != gamma:
                raise ValueError(f"StsFit.{name} has {len(getattr(self, name))} entries "
                                 f"for {gamma} positions")

    @property
    def gamma(self) -> int:
        return len(self.temperatures)


def _cumulative_metrics(s: np.ndarray, mask: np.ndarray, num_bins: int) -> dict[str, list[Any]]:
    cols = range(mask.shape[1])
    return {"ece": [binned_ece(s[:, k], mask[:, k], num_bins) for k in cols],
            "brier": [float(np.mean((s[:, k] - mask[:, k]) ** 2)) for k in cols],
            "auc": [roc_auc(s[:, k], mask[:, k]) for k in cols],
            "mean": [float(s[:, k].mean()) for k in cols]}


def _conditional_eces(conf: np.ndarray, mask: np.ndarray, num_bins: int) -> list[float | None]:
    out: list[float | None] = []
    for k in range(mask.shape[1]):
        rows = np.ones(mask.shape[0], dtype=bool) if k == 0 else mask[:, k - 1]
        out.append(binned_ece(conf[rows, k], mask[rows, k], num_bins) if rows.any() else None)
    return out


def fit_sts(data: StsData, grid: Any = None, num_bins: int = DEFAULT_NUM_BINS, map_bins: int = 0) -> StsFit:
    """Fit `T_k` left to right, each minimising the ECE of the cumulative survival at k
    (`dspark.runtime.planner.sts.fit_temperatures`, which the server's online calibration runs too), then with
    `map_bins` > 0 the monotone survival map over them (`survival_map.fit_survival_map`, as online), with
    the fit's metrics before and after (after: the planner's survival, map included)."""
    if isinstance(map_bins, bool) or not isinstance(map_bins, int) or map_bins < 0:
        raise CalibrationError(f"--survival-map must be 0 (none) or a positive number of groups, got "
                               f"{map_bins!r}")
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
        raise CalibrationError(f"num_bins must be a positive integer, got {num_bins!r}")
    if data.num_samples == 0:
        raise CalibrationError("no recorded rows to calibrate on")
    g = default_grid() if grid is None else check_grid(grid)
    z, mask = data.logits, data.prefix_mask
    temps = fit_temperatures(z, mask, g, num_bins)

    before = survival(z)
    after = survival(z, temps)
    survival_map = fit_survival_map(after, mask, bins=map_bins) if map_bins else None
    after, after_conf = (mapped_scores(survival_map, after) if survival_map is not None
                         else (after, confidence(z, temps)))
    m_before = _cumulative_metrics(before, mask, num_bins)
    m_after = _cumulative_metrics(after, mask, num_bins)
    reach_rows = [np.ones(z.shape[0], dtype=bool)] + [mask[:, k - 1] for k in range(1, data.gamma)]
    return StsFit(
        temperatures=tuple(temps), num_samples=data.num_samples, num_bins=num_bins,
        grid=tuple(float(t) for t in g),
        ece_before=tuple(m_before["ece"]), ece_after=tuple(m_after["ece"]),
        brier_before=tuple(m_before["brier"]), brier_after=tuple(m_after["brier"]),
        auc_before=tuple(m_before["auc"]), auc_after=tuple(m_after["auc"]),
        mean_survival_before=tuple(m_before["mean"]), mean_survival_after=tuple(m_after["mean"]),
        reach_rate=tuple(float(mask[:, k].mean()) for k in range(data.gamma)),
        conditional_rows=tuple(int(r.sum()) for r in reach_rows),
        conditional_ece_before=tuple(_conditional_eces(confidence(z), mask, num_bins)),
        conditional_ece_after=tuple(_conditional_eces(after_conf, mask, num_bins)),
        survival_map=survival_map,
    )


# ------------------------------------------------------------------------------------- calibration file


def calibration_contents(fit: StsFit, dataset: str, policy: str | None = None,
                         fingerprint: Mapping[str, Any] | None = None) -> CalibrationFileContents:
    """The calibration file of a fit: SGLang's fields, the fit's metrics, and (when known) the policy the
    labels were recorded under and the recording's fingerprint."""
    if not isinstance(dataset, str):
        raise CalibrationError(f"dataset must be a string naming the recorded load, got {dataset!r}")
    try:
        return CalibrationFileContents(
            temperatures=fit.temperatures, dataset=dataset, num_samples=fit.num_samples,
            ece_before=fit.ece_before, ece_after=fit.ece_after, brier_before=fit.brier_before,
            brier_after=fit.brier_after, auc_before=fit.auc_before, auc_after=fit.auc_after,
            mean_survival_before=fit.mean_survival_before, mean_survival_after=fit.mean_survival_after,
            reach_rate=fit.reach_rate, num_bins=fit.num_bins, grid=fit.grid, policy=policy,
            fingerprint=None if fingerprint is None else dict(fingerprint),
            survival_map=None if fit.survival_map is None else fit.survival_map.to_knots())
    except ValueError as err:  # pydantic's ValidationError: a metric that is not finite, say
        raise CalibrationError(f"the fit cannot be written as a calibration file: {err}") from None


def _with_extra(fit: StsFit, dataset: str, extra: Mapping[str, Any] | None) -> CalibrationFileContents:
    extra = dict(extra or {})
    unknown = sorted(set(extra) - {"policy", "fingerprint"})
    if unknown:
        raise CalibrationError(f"extra keys {unknown} are not fields of a calibration file; only 'policy' "
                               "and 'fingerprint' may be added to a fit")
    return calibration_contents(fit, dataset, extra.get("policy"), extra.get("fingerprint"))


def calibration_payload(fit: StsFit, dataset: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON object `save_calibration` writes; `extra` may set `policy` and `fingerprint`."""
    return calibration_json(_with_extra(fit, dataset, extra))


def save_calibration(path: str | os.PathLike[str], fit: StsFit, dataset: str,
                     extra: Mapping[str, Any] | None = None) -> Path:
    """Write the calibration file atomically (`extra` as in `calibration_payload`)."""
    return write_calibration(path, _with_extra(fit, dataset, extra))


# --------------------------------------------------------------------------------------------- report


def _pair(before: float | None, after: float | None, digits: int) -> str:
    def one(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.{digits}f}"

    return f"{one(before)} → {one(after)}"


def format_fit_report(fit: StsFit, policy: str | None = None) -> str:
    """A per-position table of the fit: temperature and before → after calibration metrics
    (`policy`: what the recording says its labels are, from the shards' meta.json)."""
    lines = [
        f"STS calibration: {fit.num_samples} recorded request-steps, gamma {fit.gamma}, "
        f"ECE over {fit.num_bins} equal-width bins, {len(fit.grid)} grid temperatures "
        f"[{fit.grid[0]:g}, {fit.grid[-1]:g}]",
        "survival s[k]: predicted probability that the accepted prefix reaches draft k; "
        "reach: observed share with correct_len > k",
        "",
        f"{'k':>3} {'T_k':>8}  {'ECE':^17}  {'Brier':^17}  {'AUC':^15}  {'mean survival':^17}  "
        f"{'reach':>6}  {'cond. ECE':^17}",
    ]
    for k in range(fit.gamma):
        lines.append(
            f"{k:>3} {fit.temperatures[k]:>8.4f}  {_pair(fit.ece_before[k], fit.ece_after[k], 4):^17}  "
            f"{_pair(fit.brier_before[k], fit.brier_after[k], 4):^17}  "
            f"{_pair(fit.auc_before[k], fit.auc_after[k], 3):^15}  "
            f"{_pair(fit.mean_survival_before[k], fit.mean_survival_after[k], 4):^17}  "
            f"{fit.reach_rate[k]:>6.4f}  "
            f"{_pair(fit.conditional_ece_before[k], fit.conditional_ece_after[k], 4):^17}")
    lines += ["", "columns show before (every T = 1) → after; cond. ECE scores sigmoid(z/T_k) on the rows "
              "that reached draft k-1"]
    if fit.survival_map is not None:
        lines.append(f"after: the temperatures, then a monotone survival map of {len(fit.survival_map.x[0])} "
                     "knots a position (isotonic), as the planner computes its survival")
    ends = (fit.grid[0], fit.grid[-1])
    edge = [k for k, t in enumerate(fit.temperatures) if len(fit.grid) > 1 and t in ends]
    if edge:
        lines.append(f"note: T at the edge of the grid for position(s) {edge}; widen --t-min/--t-max")
    if policy is None:
        lines.append("labels: the recording's policy is unknown (no meta.json beside the shards); serve "
                     "this calibration only with the policy the shards were recorded under")
    elif policy == "greedy":
        lines.append("labels are greedy prefix matches: recalibrate for a sampling policy before serving it")
    else:
        lines.append(f"labels are the acceptance events of {policy}: serve this calibration with that "
                     "policy only")
    return "\n".join(lines) + "\n"
