"""The seconds a decode step costs here beyond its cost-table price (docs/planner.md, "Step offset").

A cost table is profiled once, on one machine, at one context length, with the engine alone on it. A
served step pays for more: a machine of another make, longer contexts, the HTTP threads and a load
generator sharing the cores. Where that extra is a fixed cost per step it changes the planner's choice,
since a step's fixed cost is what verifying more rows spreads over more tokens: priced by the table alone
the planner trims rows that cost nothing here and commits fewer tokens per step than a fixed full-width
verify does. So the engine measures every decode step it prices and the planner adds the median excess
of the last `window` steps to every price it weighs (a drafted step's and a step without speculation's
alike).

A median per step cannot tell a fixed excess from one in proportion to the step (a uniformly slower
machine): it reads both as fixed, which moves the planner towards longer verifies than a proportional
excess calls for, and never below the table's own choice at zero excess. An excess below zero (a faster
machine than the table's) is clipped at zero for the same reason. Refitting the table itself from the
measured steps replaces this where it is done.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class StepOffset:
    """The running median of (measured − priced) step seconds over the last `window` priced steps, >= 0;
    zero until `min_samples` steps were seen, and always zero with `window = 0` (the offset off)."""

    def __init__(self, window: int = 64, min_samples: int = 8) -> None:
        if window < 0 or min_samples < 1:
            raise ValueError(f"the step offset's window must be >= 0 (0 turns it off) and min_samples >= 1, "
                             f"got {window} and {min_samples}")
        self.window = window
        self.min_samples = min(min_samples, window) if window else min_samples
        self._excess: deque[float] = deque(maxlen=window or 1)
        self.seconds = 0.0
        self.samples = 0  # priced steps observed in all

    def observe(self, priced_seconds: float | None, measured_seconds: float) -> None:
        """One decode step: what the table priced it at (None: unpriced, ignored) and what it took."""
        if not self.window or priced_seconds is None:
            return
        self._excess.append(measured_seconds - priced_seconds)
        self.samples += 1
        if len(self._excess) >= self.min_samples:
            self.seconds = max(0.0, float(np.median(np.fromiter(self._excess, np.float64))))
