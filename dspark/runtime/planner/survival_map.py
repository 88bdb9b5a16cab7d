"""A monotone map per draft position on the cumulative survival, after the STS temperatures: the calibration
file's `survival_map` (version 1), fitted by isotonic regression.

Temperatures scale each position's logit; when the reliability curve changes shape (code the pair never saw
bends it, it does not only stretch it), no temperature fits it. The map takes the survival `s_k` of the
temperatures to `f_k(s_k)`, `f_k` piecewise linear through `knots` points `(x, y)` with x and y non-decreasing
from x = 0 to x = 1, and then takes the running minimum along positions, so the result is still a survival
(a later draft is never likelier to be reached than an earlier one, which the budget relies on).

`fit_survival_map` fits `f_k` on the rows whose label at k is known: the survival cut into groups (`groups`:
its `bins` quantile groups, each cut again at multiples of 1/`WIDTH_GROUPS` where that leaves `GROUP_ROWS`
rows a side), each group's mean survival and mean label, the labels made non-decreasing by pooling adjacent
violators (isotonic regression) weighted by the group sizes; the knots are (0, 0), the groups' (mean
survival, pooled label) and (1, the last pooled label). A position with fewer than `min_known` known labels
keeps the identity. numpy for the fit and offline scoring (`searchsorted` on the knots, then a linear blend),
torch for the planner (the same function as a sum over the segments, in fewer kernels); the two agree to
rounding (tested).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from dspark.formats.sts_calibration import SURVIVAL_MAP_VERSION, SurvivalMapKnots, survival_map_problems
from dspark.runtime.planner.isotonic import isotonic

DEFAULT_BINS = 10
# Equal-width cuts refining the quantile groups. On text the draft finds easy most survivals crowd near 1, and
# quantile groups alone spend most knots there: one group then spans 0 to 0.5 and the bend the map exists for
# falls between two knots (served on 27,000 request-steps of prose, the map scored 0.75 of the compiled
# file's ECE on the other part; refined, 0.60).
WIDTH_GROUPS = 15
# Rows a refined group needs (fewer where a quantile group itself holds fewer): a thinner one merges into its
# smaller neighbour, as its mean label would be mostly noise.
GROUP_ROWS = 200


@dataclass(frozen=True)
class SurvivalMap:
    """`x[k]` and `y[k]`: the knots of draft position k's map, the same count at every position."""

    x: tuple[tuple[float, ...], ...]
    y: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        problems = survival_map_problems(self.x, self.y)
        if problems:
            raise ValueError(f"survival map: {problems}")

    @property
    def gamma(self) -> int:
        return len(self.x)

    @classmethod
    def identity(cls, gamma: int, knots: int = DEFAULT_BINS + WIDTH_GROUPS + 2) -> SurvivalMap:
        line = tuple(float(v) for v in np.linspace(0.0, 1.0, knots))
        return cls((line,) * gamma, (line,) * gamma)

    def to_knots(self) -> SurvivalMapKnots:
        """As the calibration file's `survival_map`."""
        return SurvivalMapKnots(version=SURVIVAL_MAP_VERSION, x=self.x, y=self.y)

    @classmethod
    def from_knots(cls, knots: SurvivalMapKnots) -> SurvivalMap:
        return cls(tuple(tuple(r) for r in knots.x), tuple(tuple(r) for r in knots.y))

    def apply(self, survival: np.ndarray) -> np.ndarray:
        """The mapped survival of `[n, k]` (k <= gamma: the first k positions), float64."""
        s = np.asarray(survival, dtype=np.float64)
        k = s.shape[1]
        out = np.empty_like(s)
        knots_x, knots_y = self._knot_arrays
        for j in range(k):
            xs, ys = knots_x[j], knots_y[j]
            i = np.clip(np.searchsorted(xs, s[:, j], side="right") - 1, 0, xs.shape[0] - 2)
            x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
            span = x1 - x0
            t = np.where(span > 0, (s[:, j] - x0) / np.where(span > 0, span, 1.0), 0.0)
            out[:, j] = y0 + np.clip(t, 0.0, 1.0) * (y1 - y0)
        return np.minimum.accumulate(out, axis=1)

    def apply_torch(self, survival: torch.Tensor) -> torch.Tensor:
        """`apply` on the survival's device and dtype, `[B, gamma]`, as a sum over each position's segments
        of the part of its rise below the survival (the whole rise of a jump the survival has reached):
        equal to `apply` to rounding, in seven kernels (nine with jumps) where a search and blend took two
        dozen. The planner maps every step's few rows, where each call's overhead is the cost: at B = 4 on
        the 2-core CPU, a tenth of a millisecond with the caches the model's forward leaves (an
        `np.interp` over all positions, 9 microseconds to these kernels' 18 in a loop, took half as long
        again there: numpy's code is cold in a step, torch's is not)."""
        segments = self._torch_segments.get((survival.dtype, survival.device))
        if segments is None:
            segments = self._torch_segments[(survival.dtype, survival.device)] = _Segments.of(
                self, survival.dtype, survival.device)
        # [B, gamma, m - 1]: each segment's rise times the share of its width below the survival
        parts = (survival.unsqueeze(-1) - segments.start).mul_(segments.slope).clamp_(segments.zero,
                                                                                   segments.rise)
        if segments.jump is not None:
            parts += (survival.unsqueeze(-1) >= segments.start) * segments.jump
        # rounding can carry the sum a hair past the last knot's y: the result stays a probability
        return torch.cummin((parts.sum(-1) + segments.first).clamp_(0.0, 1.0), dim=1).values

    @functools.cached_property
    def _knot_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The knots as float64 arrays `[gamma, m]`, made once per map (every check of the online calibration
        maps the window it scores with the map in use)."""
        return np.asarray(self.x, dtype=np.float64), np.asarray(self.y, dtype=np.float64)

    @functools.cached_property
    def _torch_segments(self) -> dict[tuple[torch.dtype, torch.device], _Segments]:
        """`apply_torch`'s tensors by dtype and device, made once per map (a swap makes a new map); kept on
        the map, as a cache keyed by the map would hash its knots every step."""
        return {}


@dataclass(frozen=True)
class _Segments:
    """A map's segments as `apply_torch` reads them, `[gamma, m - 1]` each: start, slope (rise over width,
    0 where it has no width; at most the dtype's largest, so that no product is NaN), rise (0 where it has no
    width), and the jumps (their rise where the width is 0, else 0; None where the map has none); the first
    knot's y `[gamma]`, and a 0 to clamp at."""

    start: torch.Tensor
    slope: torch.Tensor
    rise: torch.Tensor
    jump: torch.Tensor | None
    first: torch.Tensor
    zero: torch.Tensor

    @classmethod
    def of(cls, survival_map: SurvivalMap, dtype: torch.dtype, device: torch.device) -> _Segments:
        x, y = survival_map._knot_arrays
        # x as the dtype holds it: a segment narrower than the dtype resolves is a jump, as it is to a search
        x = torch.tensor(x, dtype=dtype).double().numpy()
        width, rise = np.diff(x, axis=1), np.diff(y, axis=1)
        wide = width > 0
        slope = np.minimum(np.divide(rise, width, out=np.zeros_like(width), where=wide),
                           float(torch.finfo(dtype).max))
        jump = np.where(wide, 0.0, rise)
        # as `apply`, which keeps a survival at or past the last knot on the segment before it
        jump[:, -1] = 0.0

        def on_device(a: np.ndarray | float) -> torch.Tensor:
            return torch.tensor(a, dtype=dtype, device=device)

        return cls(on_device(x[:, :-1]), on_device(slope), on_device(np.where(wide, rise, 0.0)),
                   on_device(jump) if jump.any() else None, on_device(y[:, 0]), on_device(0.0))


def knot_count(bins: int) -> int:
    """Knots a position's map has at `bins` quantile groups: (0, 0), at most one per group, (1, ·)."""
    return bins + WIDTH_GROUPS + 2


def groups(s: np.ndarray, bins: int) -> np.ndarray:
    """Each survival's group (0 ..): `bins` quantile groups cut at multiples of 1/`WIDTH_GROUPS`, a group
    with fewer than min(`GROUP_ROWS`, n / `bins`) rows merged into its smaller neighbour until none is."""
    edges = np.unique(np.concatenate([np.quantile(s, np.linspace(0.0, 1.0, bins + 1)),
                                      np.linspace(0.0, 1.0, WIDTH_GROUPS + 1)]))
    cuts = edges[(edges > s.min()) & (edges <= s.max())]  # interior: a group's rows lie below its cut
    fine = np.searchsorted(cuts, s, side="right")  # the rows are placed once; merges renumber the groups
    count = list(np.bincount(fine, minlength=cuts.shape[0] + 1))
    first = list(range(cuts.shape[0] + 1))  # each group's first fine group
    least = min(GROUP_ROWS, s.shape[0] // bins)
    while len(count) > 1:
        i = int(np.argmin(count))
        if count[i] >= least:
            break
        # merge group i with its smaller neighbour: drop the cut between them
        j = i - 1 if i == len(count) - 1 or (i > 0 and count[i - 1] < count[i + 1]) else i
        count[j:j + 2] = [count[j] + count[j + 1]]
        del first[j + 1]
    merged = np.zeros(cuts.shape[0] + 1, dtype=np.int64)
    merged[first[1:]] = 1
    return np.cumsum(merged)[fine]


def fit_position(s: np.ndarray, y: np.ndarray, bins: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """One position's knots from its survivals `s` and labels `y` (see the module docstring)."""
    group = groups(s, bins)
    count = np.bincount(group).astype(np.float64)
    filled = count > 0
    mean_s = np.bincount(group, weights=s)[filled] / count[filled]
    mean_y = np.bincount(group, weights=y.astype(np.float64))[filled] / count[filled]
    pooled = np.clip(isotonic(mean_y, count[filled]), 0.0, 1.0)
    # Fewer groups than the most repeat the last knot: every position keeps `knot_count(bins)` knots.
    pad = knot_count(bins) - 2 - pooled.shape[0]
    xs = np.concatenate([[0.0], np.clip(mean_s, 0.0, 1.0), [1.0] * (pad + 1)])
    ys = np.concatenate([[0.0], pooled, [pooled[-1]] * (pad + 1)])
    return tuple(float(v) for v in np.maximum.accumulate(xs)), tuple(float(v) for v in ys)


def fit_survival_map(survival: np.ndarray, labels: np.ndarray, known: np.ndarray | None = None,
                     bins: int = DEFAULT_BINS, min_known: int = 1,
                     previous: SurvivalMap | None = None) -> SurvivalMap:
    """The map of `survival [n, gamma]` (the temperatures' cumulative survival) against `labels [n, gamma]`
    over the rows `known` marks at each position; below `min_known` a position keeps `previous`'s knots
    (the identity when None)."""
    gamma = survival.shape[1]
    keep = previous or SurvivalMap.identity(gamma, knot_count(bins))
    if len(keep.x[0]) != knot_count(bins):
        keep = SurvivalMap.identity(gamma, knot_count(bins))
    xs: list[tuple[float, ...]] = []
    ys: list[tuple[float, ...]] = []
    for k in range(gamma):
        rows = np.ones(survival.shape[0], dtype=bool) if known is None else known[:, k]
        if int(rows.sum()) < max(min_known, bins):
            xs.append(keep.x[k])
            ys.append(keep.y[k])
            continue
        x, y = fit_position(survival[rows, k], labels[rows, k], bins)
        xs.append(x)
        ys.append(y)
    return SurvivalMap(tuple(xs), tuple(ys))
