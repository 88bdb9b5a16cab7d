"""STS: per-position temperature scaling of the draft's confidence logits (DESIGN.md §6), numpy float64.

The runtime records, per verified request, the raw confidence logits `z[k]` of the `gamma` drafts and
`prefix_mask[k] = k < correct_len` under greedy matching. STS picks one temperature `T_k` per draft
position, left to right, so that the cumulative survival `s[k] = prod_{i<=k} sigmoid(z[i] / T_i)` agrees
with how often the accepted prefix actually reaches draft k. The objective is the ECE of that cumulative
survival, not of the per-position conditional score, because the planner spends rows on survival values.

Shards are the files SGLang's recorder writes: `torch.save({"logits": [n, gamma] float,
"prefix_mask": [n, gamma] bool or 0/1}, path)`. The calibration JSON keeps SGLang's field names
(`temperatures`, `dataset`, `num_samples`, `ece_before`, `ece_after`) so either runtime can read it.

Survival is a predicted probability of reaching a position; it is not a measured acceptance rate, and the
report below never calls it one. Greedy labels do not carry over to sampling: calibrate per policy.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dspark.atomic import atomic_write

DEFAULT_NUM_BINS = 15
DEFAULT_GRID_POINTS = 41
DEFAULT_T_MIN = 0.1
DEFAULT_T_MAX = 10.0
# ECE values closer than this are the same number up to summation order; the smaller T wins such ties so
# that the fit does not depend on floating-point noise.
ECE_TIE_TOLERANCE = 1e-15

SHARD_SUFFIX = ".pt"
LOGITS_KEY = "logits"
PREFIX_MASK_KEY = "prefix_mask"
# Newer SGLang recorders add this when verify windows were capped: positions past the window were never
# checked, so their prefix_mask 0 is not a rejection.
OBSERVED_MASK_KEY = "observed_mask"


class CalibrationError(ValueError):
    """Calibration input (a shard, a calibration file, a setting) is unusable; the message names it."""


# --------------------------------------------------------------------------------------------- metrics


def _labels_as_bool(labels: Any, what: str, n: int) -> np.ndarray:
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


def _binned_ece(p: np.ndarray, y: np.ndarray, num_bins: int) -> float:
    # Edges as i/B (correctly rounded) so that bin i is exactly [i/B, (i+1)/B); 1.0 joins the last bin.
    edges = np.arange(num_bins + 1, dtype=np.float64) / num_bins
    idx = np.minimum(np.searchsorted(edges, p, side="right") - 1, num_bins - 1)
    sum_p = np.bincount(idx, weights=p, minlength=num_bins)
    sum_y = np.bincount(idx, weights=y.astype(np.float64), minlength=num_bins)
    # sum_b (n_b / n) * |mean_y_b - mean_p_b| == sum_b |sum_y_b - sum_p_b| / n; empty bins add 0.
    return float(np.abs(sum_y - sum_p).sum() / p.shape[0])


def ece(probs: Any, labels: Any, num_bins: int = DEFAULT_NUM_BINS) -> float:
    """Expected calibration error: equal-width bins over [0, 1], count-weighted |mean label − mean prob|."""
    if isinstance(num_bins, bool) or not isinstance(num_bins, (int, np.integer)) or num_bins < 1:
        raise ValueError(f"ece: num_bins must be a positive integer, got {num_bins!r}")
    p = _scores(probs, "ece", probabilities=True)
    return _binned_ece(p, _labels_as_bool(labels, "ece", p.shape[0]), int(num_bins))


def brier(probs: Any, labels: Any) -> float:
    """Brier score: mean squared difference between the probability and the 0/1 outcome."""
    p = _scores(probs, "brier", probabilities=True)
    y = _labels_as_bool(labels, "brier", p.shape[0])
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
    y = _labels_as_bool(labels, "roc_auc", s.shape[0])
    n_pos = int(y.sum())
    n_neg = y.shape[0] - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    rank_sum = float(_average_ranks(s)[y].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


# -------------------------------------------------------------------------------------------- survival


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # exp of a non-positive number only: no overflow for logits of any size.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _temperatures(values: Any, gamma: int | None = None) -> np.ndarray:
    t = np.asarray(values, dtype=np.float64)
    if t.ndim != 1 or t.shape[0] == 0:
        raise ValueError(f"temperatures must be a non-empty 1-D sequence, got shape {t.shape}")
    if gamma is not None and t.shape[0] != gamma:
        raise ValueError(f"{t.shape[0]} temperatures given for {gamma} draft positions; "
                         f"give one per position")
    if not (np.isfinite(t) & (t > 0)).all():
        raise ValueError(f"temperatures must be finite and > 0, got {t.tolist()}")
    return t


def confidence(logits: Any, temperatures: Any) -> np.ndarray:
    """`sigmoid(z / T)`: P(draft k is accepted | the accepted prefix reached it), per row."""
    z = np.asarray(logits, dtype=np.float64)
    if z.ndim not in (1, 2):
        raise ValueError(f"logits must be [gamma] or [n, gamma], got shape {z.shape}")
    return _sigmoid(z / _temperatures(temperatures, z.shape[-1]))


def survival(logits: Any, temperatures: Any) -> np.ndarray:
    """`cumprod(sigmoid(z / T))` along the last axis: P(the accepted prefix reaches draft k), per row."""
    return np.cumprod(confidence(logits, temperatures), axis=-1)


# -------------------------------------------------------------------------------------------- data + IO


def _check_prefix_rows(mask: np.ndarray, where: str) -> None:
    # A 1 right after a 0 means acceptance resumed past the first mismatch, which greedy matching forbids.
    resumed = ~mask[:, :-1] & mask[:, 1:]
    if resumed.any():
        row = int(np.flatnonzero(resumed.any(axis=1))[0])
        pattern = "".join("1" if v else "0" for v in mask[row])
        raise CalibrationError(
            f"{where}: row {row} has prefix_mask {pattern}, a 1 after a 0; prefix_mask[k] must be "
            f"k < correct_len (ones, then zeros). Record it from the greedy matching prefix length.")


def _check_finite_rows(logits: np.ndarray, where: str) -> None:
    finite = np.isfinite(logits)
    if not finite.all():
        row = int(np.flatnonzero(~finite.all(axis=1))[0])
        raise CalibrationError(f"{where}: logits row {row} is not finite ({logits[row].tolist()}); "
                               f"drop the shard or re-record it")


@dataclass(frozen=True, eq=False)
class StsData:
    """Recorded `(logits, prefix_mask)` rows, one per verified request-step; arrays are read-only."""

    logits: np.ndarray
    prefix_mask: np.ndarray
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        logits = np.array(self.logits, dtype=np.float64, copy=True)
        mask = np.array(self.prefix_mask, copy=True)
        if logits.ndim != 2 or logits.shape[1] == 0:
            raise CalibrationError(f"StsData: logits must be [n, gamma] with gamma >= 1, got {logits.shape}")
        if mask.shape != logits.shape:
            raise CalibrationError(f"StsData: prefix_mask shape {mask.shape} differs from logits shape "
                                   f"{logits.shape}")
        if mask.dtype != np.bool_:
            raise CalibrationError(f"StsData: prefix_mask must be a bool array, got dtype {mask.dtype}")
        _check_finite_rows(logits, "StsData")
        _check_prefix_rows(mask, "StsData")
        logits.setflags(write=False)
        mask.setflags(write=False)
        object.__setattr__(self, "logits", logits)
        object.__setattr__(self, "prefix_mask", mask)
        object.__setattr__(self, "sources", tuple(str(s) for s in self.sources))

    @property
    def num_samples(self) -> int:
        return int(self.logits.shape[0])

    @property
    def gamma(self) -> int:
        return int(self.logits.shape[1])


def shard_files(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise CalibrationError("no shard paths given; pass .pt shard files or directories holding them")
    files: dict[Path, Path] = {}
    for given in map(Path, paths):
        if given.is_dir():
            found = sorted(p for p in given.iterdir() if p.suffix == SHARD_SUFFIX and p.is_file())
            if not found:
                raise CalibrationError(f"{given}: directory holds no {SHARD_SUFFIX} shards")
        elif given.is_file():
            found = [given]
        else:
            raise CalibrationError(f"{given}: no such shard file or directory")
        for path in found:
            # The same shard named twice (as a file and through its directory) must not count twice.
            files.setdefault(path.resolve(), path)
    return sorted(files.values(), key=str)


def _tensor_to_mask(tensor: Any, path: Path) -> np.ndarray:
    import torch

    if tensor.dtype == torch.bool:
        return tensor.numpy().copy()
    integers = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    if not (tensor.is_floating_point() or tensor.dtype in integers):
        raise CalibrationError(f"{path}: prefix_mask has dtype {tensor.dtype}; "
                               f"expected bool (or 0/1 numbers)")
    values = tensor.to(torch.float64).numpy()
    exact = (values == 0.0) | (values == 1.0)
    if not exact.all():
        row = int(np.flatnonzero(~exact.all(axis=1))[0])
        raise CalibrationError(f"{path}: prefix_mask row {row} is {values[row].tolist()}; every entry must "
                               f"be 0 or 1 (bool k < correct_len)")
    return values == 1.0


def read_shard(path: Path) -> Mapping[str, Any]:
    """A shard's dict as `torch.load` gives it (checked to be a dict, nothing more)."""
    import torch

    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for corrupt or foreign files
        raise CalibrationError(f"{path}: cannot read the shard with torch.load(weights_only=True): "
                               f"{type(err).__name__}: {err}") from None
    if not isinstance(payload, Mapping):
        raise CalibrationError(f"{path}: holds a {type(payload).__name__}; expected the recorder's dict "
                               f"{{'logits': Tensor[n, gamma], 'prefix_mask': Tensor[n, gamma]}}")
    return payload


def shard_arrays(payload: Mapping[str, Any], path: Path, gamma: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Validated float64 logits and bool prefix masks of a read shard (`gamma`: the earlier shards')."""
    import torch

    for key in (LOGITS_KEY, PREFIX_MASK_KEY):
        if key not in payload:
            raise CalibrationError(f"{path}: missing key {key!r} (found {sorted(map(str, payload))}); "
                                   f"a shard must hold both 'logits' and 'prefix_mask'")
        if not isinstance(payload[key], torch.Tensor):
            raise CalibrationError(f"{path}: {key!r} is a {type(payload[key]).__name__}, expected a tensor")
    logits_t, mask_t = payload[LOGITS_KEY], payload[PREFIX_MASK_KEY]
    if logits_t.dim() != 2 or logits_t.shape[1] == 0:
        raise CalibrationError(f"{path}: logits have shape {tuple(logits_t.shape)}; expected [n, gamma] "
                               f"with gamma >= 1")
    if tuple(mask_t.shape) != tuple(logits_t.shape):
        raise CalibrationError(f"{path}: prefix_mask shape {tuple(mask_t.shape)} differs from logits shape "
                               f"{tuple(logits_t.shape)}; both must be [n, gamma]")
    if gamma is not None and logits_t.shape[1] != gamma:
        raise CalibrationError(f"{path}: gamma {logits_t.shape[1]} differs from the earlier shards' gamma "
                               f"{gamma}; calibrate shards of one draft configuration together")
    if not logits_t.is_floating_point():
        raise CalibrationError(f"{path}: logits have dtype {logits_t.dtype}; "
                               f"expected float confidence logits")
    logits = logits_t.to(torch.float64).numpy().copy()
    _check_finite_rows(logits, str(path))
    mask = _tensor_to_mask(mask_t, path)
    _check_prefix_rows(mask, str(path))
    observed = payload.get(OBSERVED_MASK_KEY)
    if observed is not None:
        if not isinstance(observed, torch.Tensor) or tuple(observed.shape) != tuple(logits_t.shape):
            raise CalibrationError(f"{path}: observed_mask must be a tensor shaped like logits")
        if not bool((observed != 0).all()):
            row = int(torch.nonzero((observed == 0).any(dim=1))[0, 0])
            raise CalibrationError(
                f"{path}: observed_mask row {row} marks positions the capped verify window never checked; "
                f"their prefix_mask 0 is not a rejection and would bias the fit. Record calibration data "
                f"with every draft verified (static mode or a full verify window).")
    return logits, mask


def load_shards(paths: Sequence[str | os.PathLike[str]]) -> StsData:
    """Read recorder shards (files, or directories whose `.pt` files are read), validated, in sorted order."""
    logits: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    files = shard_files(paths)
    gamma: int | None = None
    for path in files:
        z, m = shard_arrays(read_shard(path), path, gamma)
        gamma = z.shape[1]
        logits.append(z)
        masks.append(m)
    data = StsData(np.concatenate(logits), np.concatenate(masks), tuple(str(p) for p in files))
    if data.num_samples == 0:
        raise CalibrationError(f"{', '.join(data.sources)}: the shards hold no rows")
    return data


def save_shard(path: str | os.PathLike[str], logits: Any, prefix_mask: Any) -> Path:
    """Write one shard in the recorder's layout (float32 logits, bool mask), atomically."""
    import torch

    data = StsData(np.asarray(logits), np.asarray(prefix_mask))
    payload = {LOGITS_KEY: torch.from_numpy(data.logits.astype(np.float32)),
               PREFIX_MASK_KEY: torch.from_numpy(data.prefix_mask.copy())}
    out = Path(path)
    return atomic_write(out, lambda tmp: torch.save(payload, tmp))


# ------------------------------------------------------------------------------------------------ fit


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


def _check_grid(grid: Any) -> np.ndarray:
    g = np.unique(np.asarray(grid, dtype=np.float64))  # sorted ascending: the tie rule prefers smaller T
    if g.ndim != 1 or g.shape[0] == 0:
        raise CalibrationError("the temperature grid is empty; give at least one temperature")
    if not (np.isfinite(g) & (g > 0)).all():
        raise CalibrationError(f"grid temperatures must be finite and > 0, got {g.tolist()}")
    return g


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
    return {"ece": [_binned_ece(s[:, k], mask[:, k], num_bins) for k in cols],
            "brier": [float(np.mean((s[:, k] - mask[:, k]) ** 2)) for k in cols],
            "auc": [roc_auc(s[:, k], mask[:, k]) for k in cols],
            "mean": [float(s[:, k].mean()) for k in cols]}


def _conditional_eces(conf: np.ndarray, mask: np.ndarray, num_bins: int) -> list[float | None]:
    out: list[float | None] = []
    for k in range(mask.shape[1]):
        rows = np.ones(mask.shape[0], dtype=bool) if k == 0 else mask[:, k - 1]
        out.append(_binned_ece(conf[rows, k], mask[rows, k], num_bins) if rows.any() else None)
    return out


def fit_sts(data: StsData, grid: Any = None, num_bins: int = DEFAULT_NUM_BINS) -> StsFit:
    """Fit `T_k` left to right, each minimising the ECE of the cumulative survival at k.

    Position k's search keeps the temperatures already fitted for positions < k, so the survival the
    planner will compute is what was calibrated. Ties (ECE within `ECE_TIE_TOLERANCE`) keep the smaller T.
    """
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
        raise CalibrationError(f"num_bins must be a positive integer, got {num_bins!r}")
    if data.num_samples == 0:
        raise CalibrationError("no recorded rows to calibrate on")
    g = default_grid() if grid is None else _check_grid(grid)
    z, mask = data.logits, data.prefix_mask

    temps: list[float] = []
    after = np.empty_like(z)
    reached = np.ones(z.shape[0])  # fitted survival up to draft k - 1
    for k in range(data.gamma):
        candidates = [reached * _sigmoid(z[:, k] / t) for t in g]
        eces = np.array([_binned_ece(s, mask[:, k], num_bins) for s in candidates])
        best = int(np.flatnonzero(eces <= eces.min() + ECE_TIE_TOLERANCE)[0])
        temps.append(float(g[best]))
        reached = candidates[best]
        after[:, k] = reached

    before = np.cumprod(_sigmoid(z), axis=1)
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
        conditional_ece_before=tuple(_conditional_eces(_sigmoid(z), mask, num_bins)),
        conditional_ece_after=tuple(_conditional_eces(_sigmoid(z / np.array(temps)), mask, num_bins)),
    )


# ------------------------------------------------------------------------------------- calibration JSON

_FIT_KEYS = ("temperatures", "dataset", "num_samples", "ece_before", "ece_after", "brier_before",
             "brier_after", "auc_before", "auc_after", "mean_survival_before", "mean_survival_after",
             "reach_rate", "num_bins", "grid")


def calibration_payload(fit: StsFit, dataset: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON object `save_calibration` writes (SGLang's five fields first, then ours, then `extra`)."""
    if not isinstance(dataset, str):
        raise CalibrationError(f"dataset must be a string naming the recorded load, got {dataset!r}")
    payload: dict[str, Any] = {
        "temperatures": list(fit.temperatures), "dataset": dataset, "num_samples": int(fit.num_samples),
        "ece_before": list(fit.ece_before), "ece_after": list(fit.ece_after),
        "brier_before": list(fit.brier_before), "brier_after": list(fit.brier_after),
        "auc_before": list(fit.auc_before), "auc_after": list(fit.auc_after),
        "mean_survival_before": list(fit.mean_survival_before),
        "mean_survival_after": list(fit.mean_survival_after), "reach_rate": list(fit.reach_rate),
        "num_bins": int(fit.num_bins), "grid": list(fit.grid),
    }
    for key, value in (extra or {}).items():
        if not isinstance(key, str):
            raise CalibrationError(f"extra key {key!r} must be a string")
        if key in payload:
            raise CalibrationError(f"extra key {key!r} would overwrite the fitted field of that name; "
                                   f"rename it")
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise CalibrationError(f"extra[{key!r}] cannot be written as strict JSON: {err}") from None
        payload[key] = value
    return payload


def save_calibration(path: str | os.PathLike[str], fit: StsFit, dataset: str,
                     extra: Mapping[str, Any] | None = None) -> Path:
    """Write the calibration JSON atomically (a temp file in the same directory, then `os.replace`)."""
    text = json.dumps(calibration_payload(fit, dataset, extra), indent=2, allow_nan=False) + "\n"

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())

    return atomic_write(Path(path), write)


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def load_calibration(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a calibration JSON; `temperatures` comes back as a validated list of floats."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise CalibrationError(f"{path}: cannot read the STS calibration file "
                               f"({err.strerror or err})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise CalibrationError(f"{path}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") \
            from None
    if not isinstance(data, dict):
        raise CalibrationError(f"{path}: expected a JSON object with a 'temperatures' list, got "
                               f"{type(data).__name__}")
    temps = data.get("temperatures")
    if not isinstance(temps, list) or not temps:
        raise CalibrationError(f"{path}: 'temperatures' must be a non-empty list (one per draft position), "
                               f"got {temps!r}; write the file with `dspark calibrate`")
    for i, t in enumerate(temps):
        if not _is_number(t) or not math.isfinite(t) or t <= 0:
            raise CalibrationError(f"{path}: temperatures[{i}] is {t!r}; each STS temperature must be a "
                                   f"finite number > 0")
    data["temperatures"] = [float(t) for t in temps]
    for key in ("ece_before", "ece_after"):
        values = data.get(key)
        if values is None or values == []:
            continue  # SGLang omits these when empty
        if not isinstance(values, list) or len(values) != len(temps) or not all(
                _is_number(v) and math.isfinite(v) for v in values):
            raise CalibrationError(f"{path}: {key!r} must be a list of {len(temps)} finite numbers (one per "
                                   f"position), got {values!r}")
    num_samples = data.get("num_samples")
    if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, int)
                                    or num_samples < 0):
        raise CalibrationError(f"{path}: 'num_samples' must be a non-negative integer, got {num_samples!r}")
    return data


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
