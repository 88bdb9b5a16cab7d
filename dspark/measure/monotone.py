"""Non-decreasing fits: verifying more rows, or more requests, never makes a step cheaper.

Step timings are noisy, and an unconstrained fit passes the noise on: a table whose theta dips at
96 rows tells the planner that 96 rows cost less than 80. These fits keep the physics instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def cumulative_design(levels: Sequence[int], probes: Sequence[int]) -> np.ndarray:
    """Columns of a fit whose coefficient per probe is a sum of non-negative increments: column k
    (for `probes[k + 1]`) is 1 where the level is at or above that probe. Non-negative least squares
    on these columns fits a non-decreasing function of the level that is 0 at `probes[0]`."""
    level = np.asarray(levels)[:, None]
    return (level >= np.asarray(probes[1:])[None, :]).astype(np.float64)
