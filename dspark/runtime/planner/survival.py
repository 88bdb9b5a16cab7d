"""Survival from confidence logits, and the lagged survival an overlapped scheduler plans with.

`survival[r, k] = cumprod(sigmoid(z / T))[r, k]`: the probability that request r's accepted prefix
reaches draft k + 1 (docs/planner.md).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.runtime.planner.budget import require_int
from dspark.runtime.planner.survival_map import SurvivalMap


def survival_from_logits(logits: torch.Tensor,
                         temperatures: Sequence[float] | torch.Tensor | None = None,
                         survival_map: SurvivalMap | None = None) -> torch.Tensor:
    """`cumprod(sigmoid(z / T))` along positions, on the logits' device: [B, gamma], in float32
    (float64 logits stay float64, for offline calibration to the last ulp); then the calibration's monotone
    `survival_map`, where it has one."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, gamma], got shape {tuple(logits.shape)}")
    z = logits if logits.dtype == torch.float64 else logits.to(torch.float32)
    if temperatures is not None:
        # Host values are checked on the host, so planning a step never waits on the device.
        values = temperatures.tolist() if isinstance(temperatures, torch.Tensor) else list(temperatures)
        if len(values) != z.shape[1] or any(isinstance(v, list) for v in values):
            raise ValueError(f"{len(values)} temperatures but logits have gamma={z.shape[1]} positions; give "
                             "one T_k per draft position")
        if not all(0 < v < float("inf") for v in values):
            raise ValueError(f"temperatures must all be finite and > 0 (1.0 = uncalibrated), got {values}")
        z = z / _divisor(tuple(values), z.dtype, z.device)
    survival = torch.cumprod(torch.sigmoid(z), dim=1)
    return survival if survival_map is None else survival_map.apply_torch(survival)


@functools.lru_cache(maxsize=64)
def _divisor(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The temperatures as a tensor, made once per device: building it every step would be a blocking
    host-to-device copy, which waits for the draft's kernels before planning needs to."""
    return torch.tensor(values, dtype=dtype, device=device)


@dataclass(frozen=True)
class _Recorded:
    rows: dict[tuple[int, int], int]  # (slot, generation) -> row of `survival`
    survival: torch.Tensor


def _keys(slots: Sequence[int], generations: Sequence[int], gamma: int, survival: torch.Tensor,
          what: str) -> list[tuple[int, int]]:
    if survival.dim() != 2 or survival.shape[1] != gamma:
        raise ValueError(f"{what}: survival must be [B, gamma={gamma}], got shape {tuple(survival.shape)}")
    num_reqs = survival.shape[0]
    if len(slots) != num_reqs or len(generations) != num_reqs:
        raise ValueError(f"{what}: got {len(slots)} slots and {len(generations)} generations for "
                         f"{num_reqs} survival rows; give one (slot, generation) per request")
    keys = [(int(slot), int(gen)) for slot, gen in zip(slots, generations, strict=True)]
    if len({slot for slot, _ in keys}) != len(keys):
        raise ValueError(f"{what}: a slot appears twice in {list(slots)}; each request holds its own slot")
    return keys


class LaggedSurvival:
    """Survival from `lag_steps` steps ago, for an overlapped scheduler that plans before this step's
    confidence is ready.

    Each step call `lagged()` first (to plan) and then `record()` (with this step's survival), exactly once
    each; "lag_steps ago" counts `record()` calls. A request whose (slot, generation) was not recorded
    `lag_steps` steps ago, including a reused slot under a new generation, gets survival 1.0: it must never
    inherit another request's confidence, and 1.0 is the optimistic fallback the source uses.
    """

    def __init__(self, lag_steps: int, gamma: int) -> None:
        self.lag_steps = require_int("lag_steps", lag_steps)
        self.gamma = require_int("gamma", gamma)
        if self.lag_steps < 0:
            raise ValueError(f"lag_steps must be >= 0 (0 = plan with this step's survival), got {lag_steps}")
        if self.gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        # The oldest entry is exactly lag_steps records old when lagged() runs before this step's record().
        self._history: deque[_Recorded] = deque(maxlen=self.lag_steps)

    def record(self, slots: Sequence[int], generations: Sequence[int], survival: torch.Tensor) -> None:
        """Remember this step's survival [B, gamma] under each request's (slot, generation)."""
        keys = _keys(slots, generations, self.gamma, survival, "record")
        if self.lag_steps == 0:
            return
        # Cloned: the caller may reuse the buffer next step.
        rows = {key: row for row, key in enumerate(keys)}
        self._history.append(_Recorded(rows, survival.detach().clone()))

    def lagged(self, slots: Sequence[int], generations: Sequence[int],
               current: torch.Tensor) -> torch.Tensor:
        """The survival to plan with: `current` for lag 0, else each request's survival recorded
        lag_steps steps ago under the same (slot, generation), or a row of ones."""
        keys = _keys(slots, generations, self.gamma, current, "lagged")
        if self.lag_steps == 0:
            return current
        ones = torch.ones_like(current)
        if len(self._history) < self.lag_steps:
            return ones
        past = self._history[0]
        source = [past.rows.get(key, -1) for key in keys]
        if all(row < 0 for row in source):
            return ones
        index = torch.tensor(source, dtype=torch.long, device=current.device)
        # Gather then select instead of boolean indexing: no host sync on a device tensor.
        gathered = past.survival.to(device=current.device, dtype=current.dtype)[index.clamp(min=0)]
        return torch.where((index >= 0).unsqueeze(1), gathered, ones)
