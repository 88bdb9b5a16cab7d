"""Where graph tiers matter to a measurement: the rows around each tier.

A step padded to a graph tier costs what the tier costs, so step time jumps between `tier` and
`tier + 1` rows. The profiler measures densely within `TIER_RADIUS` rows of every tier, and
`dspark cost-eval` and the report split a table's fit error into those samples ("near a tier") and
the rest, where a smooth (additive) table is expected to do well.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

TIER_RADIUS = 2


def rows_around(tiers: Iterable[int], radius: int = TIER_RADIUS) -> tuple[int, ...]:
    """Row counts `tier - radius … tier + radius` for each graph tier (>= 1), for `ProfilePlan.extra_rows`."""
    if radius < 0:
        raise ValueError(f"radius must be >= 0, got {radius}")
    return tuple(sorted({m for t in tiers for m in range(t - radius, t + radius + 1) if m >= 1}))


def near_tier(rows: Sequence[int] | np.ndarray, tiers: Sequence[int],
              radius: int = TIER_RADIUS) -> np.ndarray:
    """Per row count, whether it lies within `radius` rows of a tier (all False without tiers)."""
    m = np.asarray(rows, dtype=np.int64)
    t = np.asarray(tiers, dtype=np.int64)
    if t.size == 0:
        return np.zeros(m.shape, dtype=bool)
    return (np.abs(m[:, None] - t[None, :]) <= radius).any(axis=1)
