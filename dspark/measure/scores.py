"""Survival and per-position confidence of recorded confidence logits, as the planner computes them.

`survival[r, k] = cumprod(sigmoid(z / T))[r, k]` has one definition, the planner's
`survival_from_logits` (docs/planner.md); calibration, the head refit's metrics and the report score
recorded logits through it, so what they measure is what the planner spends rows on. These wrappers
only move numpy arrays in and out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dspark.runtime.planner.survival import survival_from_logits
from dspark.runtime.planner.survival_map import SurvivalMap

Temperatures = Sequence[float] | np.ndarray | None


def survival(logits: np.ndarray, temperatures: Temperatures = None) -> np.ndarray:
    """The planner's survival of `[n, gamma]` logits (one temperature per position, or none), float64."""
    # torch shares the array's memory, so a read-only array (StsData's) is copied first.
    z = torch.from_numpy(np.require(logits, dtype=np.float64, requirements=["C", "W"]))
    temps = None if temperatures is None else np.asarray(temperatures, dtype=np.float64)
    return survival_from_logits(z, temps).to(torch.float64).numpy()


def confidence(logits: np.ndarray, temperatures: Temperatures = None) -> np.ndarray:
    """`sigmoid(z_k / T_k)` per position: P(draft k accepted | the prefix reached it), `[n, gamma]`.

    Each column is the survival of a one-position window, so the planner's function defines it too.
    """
    z = np.asarray(logits, dtype=np.float64)
    temps = None if temperatures is None else np.asarray(temperatures, dtype=np.float64)
    if temps is not None and temps.shape != (z.shape[-1],):
        raise ValueError(f"temperatures has shape {temps.shape} but logits have gamma={z.shape[-1]} "
                         "positions; give one T_k per draft position")
    columns = [survival(z[:, k:k + 1], None if temps is None else temps[k:k + 1])
               for k in range(z.shape[1])]
    return np.concatenate(columns, axis=1) if columns else np.zeros_like(z)


def mapped_scores(survival_map: SurvivalMap, unmapped: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(survival, confidence) with the calibration's survival map after the temperatures' `unmapped`
    survival: the planner's survival, and each position's step down along it (s_k / s_{k-1}, 0 where the
    prefix cannot be reached), which is P(draft k accepted | the prefix reached it) there."""
    mapped = survival_map.apply(unmapped)
    reached = np.concatenate([np.ones((mapped.shape[0], 1)), mapped[:, :-1]], axis=1)
    return mapped, np.divide(mapped, reached, out=np.zeros_like(mapped), where=reached > 0)
