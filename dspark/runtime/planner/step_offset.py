"""The fixed seconds a decode step costs here beyond its cost-table price (docs/planner.md, "Step offset").

A cost table is profiled once, on one machine, at one context length, with the engine alone on it. A
served step pays for more: a machine of another make, longer contexts, the HTTP threads and a load
generator sharing the cores. Only the part of that extra that is fixed per step changes the planner's
choice, since a step's fixed cost is what verifying more rows spreads over more tokens; an extra in
proportion to the step (a uniformly slower machine, cores shared with a client) scales every price
alike and leaves every choice as the table makes it.

So the engine measures every decode step it prices and fits measured ≈ a · priced + b over the last
`window` steps, robustly (Theil-Sen: the median slope over pairs of steps whose prices differ, then the
median intercept). The planner adds `b / a`, the fixed part in the table's units, to every price it
weighs (a drafted step's and a step without speculation's alike): weighing tokens against a · cost + b
picks what weighing them against cost + b / a does. A negative intercept (rows dearer here than the
table says) is clipped at zero, where the table's own choice stands.

While the window's prices hardly differ (every step the same shape) a fixed excess cannot be told from a
proportional one, and the estimate keeps its last value: a fallback to zero would let the planner trim,
and one to the median excess would lock it into full-width verifies that never show what rows cost.
The online cost refit (`online_cost.py`) moves the table's own shape to the measured steps; where it runs,
the offset restarts at each swap and measures what the refitted table leaves.
"""

from __future__ import annotations

from collections import deque

import numpy as np

# Two steps' prices must differ by this share of the window's median price for their pair to carry a slope.
MIN_PRICE_SPREAD = 0.05
# The slope is held to this range: a step measured as costing nothing more for more rows (a flat slope)
# reads as an excess that is all fixed, and one far steeper than the table as noise in a few pairs.
SLOPE_RANGE = (0.1, 10.0)


class StepOffset:
    """The fixed part `b / a` of the robust fit measured ≈ a · priced + b over the last `window` priced
    steps, >= 0 (`seconds`, in the table's units), refitted every `refit_every` steps; zero until the
    window holds `min_samples` cheaper and `min_samples` dearer steps whose prices differ (`robust_line`),
    held while it does not, and always zero with `window = 0` (off)."""

    def __init__(self, window: int = 64, min_samples: int = 8, refit_every: int = 8) -> None:
        if window < 0 or min_samples < 1 or refit_every < 1:
            raise ValueError(f"the step offset's window must be >= 0 (0 turns it off), min_samples and "
                             f"refit_every >= 1, got {window}, {min_samples} and {refit_every}")
        self.window = window
        self.min_samples = min_samples
        # A fit over 64 steps takes about 0.2 ms on a 2-core CPU, 1 % of a small step: refit every few.
        self.refit_every = refit_every
        self._priced: deque[float] = deque(maxlen=window or 1)
        self._measured: deque[float] = deque(maxlen=window or 1)
        self.seconds = 0.0
        self.slope = 1.0  # `a` of the last fit: measured seconds per priced second beyond the fixed part
        self.samples = 0  # priced steps observed in all

    def observe(self, priced_seconds: float | None, measured_seconds: float) -> None:
        """One decode step: what the table priced it at (None: unpriced, ignored) and what it took."""
        if not self.window or priced_seconds is None:
            return
        self._priced.append(priced_seconds)
        self._measured.append(measured_seconds)
        self.samples += 1
        if self.samples % self.refit_every:
            return
        fit = robust_line(np.fromiter(self._priced, np.float64), np.fromiter(self._measured, np.float64),
                          self.min_samples)
        if fit is not None:
            self.slope, intercept = fit
            self.seconds = max(0.0, intercept / self.slope)


def robust_line(priced: np.ndarray, measured: np.ndarray, min_points: int) -> tuple[float, float] | None:
    """Theil-Sen (slope, intercept) of measured against priced, the slope held to `SLOPE_RANGE`; None
    unless the cheaper and the dearer half of the points, `min_points` or more each, have median prices
    `MIN_PRICE_SPREAD` apart (a few odd prices among one shape would make every pair one point's)."""
    half = len(priced) // 2
    if half < max(min_points, 1):
        return None
    spread = MIN_PRICE_SPREAD * float(np.median(priced))
    ordered = np.sort(priced)
    if float(np.median(ordered[-half:]) - np.median(ordered[:half])) < spread:
        return None
    dp = priced[None, :] - priced[:, None]
    dm = measured[None, :] - measured[:, None]
    apart = np.triu(np.abs(dp) >= spread, k=1)
    slope = float(np.clip(np.median(dm[apart] / dp[apart]), *SLOPE_RANGE))
    return slope, float(np.median(measured - slope * priced))
