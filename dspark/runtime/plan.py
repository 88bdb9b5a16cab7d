"""Verify plans: how many rows each request verifies in a step.

The generated `planner_config.py` instantiates one of these for its verify mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StaticVerifyPlan:
    """`static` mode: no planner, every request verifies all `N = gamma + 1` rows."""

    gamma: int
    mode: str = "static"

    def __post_init__(self) -> None:
        if self.gamma < 1:
            raise ValueError(f"gamma must be >= 1 (N = gamma + 1 >= 2), got {self.gamma}")

    @property
    def num_draft_tokens(self) -> int:
        return self.gamma + 1

    def verify_lens(self, num_reqs: int, confidence_logits: torch.Tensor | None = None) -> torch.Tensor:
        return torch.full((num_reqs,), self.num_draft_tokens, dtype=torch.int32)
