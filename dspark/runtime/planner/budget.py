"""The verify budget that maximises expected progress per second, and the per-request `verify_lens`
that spend it (docs/planner.md).

Rows of a request: row 0 is its root, row j (1..gamma) verifies draft j; `survival[r, j-1]` is the
probability that request r's accepted prefix reaches draft j, and `verify_len = l` verifies rows 0..l-1.

Floor and cap (shared by the budget and the allocation, so the two always agree): with
`f = max(min_verify_len, 1)` and `L` the resolved `max_verify_len`, every request verifies its root and
drafts 1..f-1; the candidates are drafts f..L-1 with `survival >= survival_eps`. A budget of b extra rows
verifies `M = B*f + b` rows with expected committed tokens
`tau(b) = B + sum(survival of drafts 1..f-1) + sum(the b best candidates)`.
Candidates rank by survival descending, ties by earlier position, then lower request index.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark.runtime.layout import tier_for
from dspark.runtime.planner.cost_models import AdditiveCostTable, CostModel, SpsTable, TierCostTable

# Objectives within this relative distance of the best count as tied (and the smaller budget wins), so the
# float summation order (numpy here, a scalar loop in a check, another device) cannot flip a decision
# between two equally good budgets.
TIE_RTOL = 1e-12


def require_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class ScheduleConfig:
    """Planner limits. `max_verify_len = 0` means `gamma + 1` (every draft may be verified)."""

    gamma: int
    min_verify_len: int = 1
    max_verify_len: int = 0
    survival_eps: float = 1e-6

    def __post_init__(self) -> None:
        gamma = require_int("gamma", self.gamma)
        max_len = require_int("max_verify_len", self.max_verify_len)
        min_len = require_int("min_verify_len", self.min_verify_len)
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1 (draft tokens per request per step), got {gamma}")
        if not 0 <= max_len <= gamma + 1:
            raise ValueError(f"max_verify_len must be in [0, gamma + 1 = {gamma + 1}] (0 means gamma + 1), "
                             f"got {max_len}")
        if min_len < 0:
            raise ValueError(f"min_verify_len must be >= 0, got {min_len}")
        if max(min_len, 1) > self.cap:
            raise ValueError(f"min_verify_len={min_len} exceeds the cap max_verify_len={self.cap}; lower "
                             "min_verify_len or raise max_verify_len")
        if isinstance(self.survival_eps, bool) or not isinstance(self.survival_eps, (int, float)) \
                or not 0 <= self.survival_eps < 1:
            raise ValueError(f"survival_eps must be in [0, 1), got {self.survival_eps!r}; use 0 to keep "
                             "every candidate")

    @property
    def num_draft_tokens(self) -> int:
        """N = gamma + 1: the root row plus the drafts."""
        return self.gamma + 1

    @property
    def floor(self) -> int:
        """f: rows every request verifies (the root always counts, even with min_verify_len = 0)."""
        return max(self.min_verify_len, 1)

    @property
    def cap(self) -> int:
        """L: the most rows one request may verify."""
        return self.max_verify_len or self.gamma + 1


@dataclass(frozen=True)
class BudgetDecision:
    """The chosen number of extra rows and what the planner expects from it.

    `predicted_step_seconds` is the verify step plus the draft term, so `objective = tau /
    predicted_step_seconds` (tokens per second); both are None when there is no cost model.
    """

    budget: int
    num_rows: int
    tau: float
    predicted_step_seconds: float | None
    objective: float | None

    def __post_init__(self) -> None:
        if self.budget < 0 or self.num_rows < self.budget:
            raise ValueError(f"budget must be in [0, num_rows], got budget={self.budget}, "
                             f"num_rows={self.num_rows}")
        if not self.tau >= 0:
            raise ValueError(f"tau must be >= 0, got {self.tau}")
        if (self.predicted_step_seconds is None) != (self.objective is None):
            raise ValueError("predicted_step_seconds and objective must both be set (with a cost model) "
                             "or both be None")


@dataclass(frozen=True)
class Candidates:
    num_reqs: int
    floor_sum: float  # survival of drafts 1..f-1, which every request verifies whatever its value
    values: np.ndarray  # float64, best first, ties in (position, request) order
    requests: np.ndarray  # request index of each ranked candidate
    positions: np.ndarray  # 0-based offset of each ranked candidate from draft f


def check_survival(survival: torch.Tensor, cfg: ScheduleConfig) -> torch.Tensor:
    if survival.dim() != 2 or survival.shape[1] != cfg.gamma:
        raise ValueError(f"survival must be [B, gamma={cfg.gamma}], got shape {tuple(survival.shape)}")
    if not survival.is_floating_point():
        raise ValueError(f"survival must be a floating tensor, got {survival.dtype}")
    # The scan is tiny (B*gamma values); float64 keeps tau's prefix sums exact enough to compare budgets.
    s = survival.detach().to(device="cpu", dtype=torch.float64)
    if not bool(((s >= 0) & (s <= 1)).all()):
        raise ValueError("survival must be probabilities in [0, 1] (no NaN); build it with "
                         "survival_from_logits")
    rises = s[:, 1:] > s[:, :-1]
    if bool(rises.any()):
        r, k = (int(i) for i in torch.nonzero(rises)[0])
        raise ValueError(f"survival must be non-increasing along positions (a cumulative product), but "
                         f"request {r} rises from {float(s[r, k])} at draft {k + 1} to {float(s[r, k + 1])} "
                         f"at draft {k + 2}; build it with survival_from_logits")
    return s


def rank_candidates(survival: torch.Tensor, cfg: ScheduleConfig) -> Candidates:
    s = check_survival(survival, cfg)
    num_reqs, f, cap = s.shape[0], cfg.floor, cfg.cap
    floor_sum = float(s[:, : f - 1].sum())
    # Drafts f..L-1 (1-based) are columns f-1..L-2. Flattening position-major makes a stable descending
    # sort break ties by earlier position, then lower request index.
    block = s[:, f - 1 : cap - 1].T.reshape(-1)
    flat_index = torch.nonzero(block >= cfg.survival_eps).squeeze(1)
    values = block[flat_index]
    order = torch.sort(values, descending=True, stable=True).indices
    ranked = flat_index[order].numpy()
    divisor = max(num_reqs, 1)  # no candidates exist when B = 0; avoids a modulo by zero
    return Candidates(num_reqs, floor_sum, values[order].numpy(), ranked % divisor, ranked // divisor)


def _row_limit(cost_model: CostModel | None, max_rows: int | None) -> int | None:
    limits = []
    if max_rows is not None:
        limits.append(require_int("max_rows", max_rows))
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1 (e.g. the largest captured graph tier), got {max_rows}")
    if cost_model is not None and cost_model.max_rows is not None:
        limits.append(cost_model.max_rows)
    return min(limits) if limits else None


def choose_budget(survival: torch.Tensor, cost_model: CostModel | None, cfg: ScheduleConfig,
                  max_rows: int | None = None) -> BudgetDecision:
    """The budget b (extra rows beyond the floor) maximising expected progress per second.

    The objective is `tau(b) * SPS(M)` for an `SpsTable` and `tau(b) / T(B, M)` for an
    `AdditiveCostTable` or a `TierCostTable`; with a draft term it is `tau(b) / (step seconds +
    draft_time(B))`. Only budgets with M within `cost_model.max_rows` (a tier table's last tier) and
    `max_rows` are feasible; the first maximum wins ties. Without a cost model every candidate is
    verified, as far as `max_rows` allows.
    """
    if cost_model is not None and not isinstance(cost_model, (SpsTable, AdditiveCostTable, TierCostTable)):
        raise TypeError(f"cost_model must be an SpsTable, an AdditiveCostTable, a TierCostTable or None, got "
                        f"{type(cost_model).__name__}")
    cands = rank_candidates(survival, cfg)
    num_reqs = cands.num_reqs
    base_rows = num_reqs * cfg.floor
    limit = _row_limit(cost_model, max_rows)
    if limit is not None and base_rows > limit:
        raise ValueError(f"the floor alone needs B * f = {num_reqs} * {cfg.floor} = {base_rows} rows but at "
                         f"most {limit} are feasible (max_rows={max_rows}, cost model max_rows="
                         f"{cost_model.max_rows if cost_model else None}); split the batch, lower "
                         "min_verify_len, or capture/profile larger steps")
    top = cands.values.size if limit is None else min(cands.values.size, limit - base_rows)
    tau = num_reqs + cands.floor_sum + np.concatenate(([0.0], np.cumsum(cands.values[:top])))
    if cost_model is None:
        return BudgetDecision(top, base_rows + top, float(tau[top]), None, None)

    rows = base_rows + np.arange(top + 1)
    draft_seconds = cost_model.draft_time(num_reqs)
    if isinstance(cost_model, SpsTable):
        steps_per_sec = cost_model.lookup_many(rows)
        step_seconds = 1.0 / steps_per_sec + draft_seconds
        # Without a draft term use the table's rate directly: tau * SPS is the source's formula.
        objective = tau * steps_per_sec if draft_seconds == 0 else tau / step_seconds
    else:
        step_seconds = cost_model.step_time_many(num_reqs, rows) + draft_seconds
        objective = tau / step_seconds
    best = objective.max()
    budget = int(np.argmax(objective >= best - TIE_RTOL * best))
    return BudgetDecision(budget, int(rows[budget]), float(tau[budget]), float(step_seconds[budget]),
                          float(objective[budget]))


def allocate_verify_lens_host(survival: torch.Tensor, budget: int, cfg: ScheduleConfig) -> np.ndarray:
    """`verify_lens` [B] as a host int array: the floor f plus, per request, how many of the `budget`
    best candidates it holds (all candidates when the budget exceeds their number)."""
    budget = require_int("budget", budget)
    if budget < 0:
        raise ValueError(f"budget must be >= 0 extra rows, got {budget}")
    cands = rank_candidates(survival, cfg)
    chosen_reqs = cands.requests[:budget]
    counts = np.bincount(chosen_reqs, minlength=cands.num_reqs)
    # Survival is non-increasing per request and ties go to earlier positions, so each request's chosen
    # offsets are exactly 0..count-1: distinct non-negative integers sum to count*(count-1)/2 only then.
    offset_sums = np.bincount(chosen_reqs, weights=cands.positions[:budget], minlength=cands.num_reqs)
    assert np.array_equal(offset_sums, counts * (counts - 1) / 2), "chosen set is not a per-request prefix"
    return (cfg.floor + counts).astype(np.int32)


def allocate_verify_lens(survival: torch.Tensor, budget: int, cfg: ScheduleConfig) -> torch.Tensor:
    """`allocate_verify_lens_host` as an int32 tensor on the survival's device."""
    return torch.from_numpy(allocate_verify_lens_host(survival, budget, cfg)).to(survival.device)


def forced_budget(survival: torch.Tensor, cfg: ScheduleConfig, fraction: float) -> int:
    """Experiment override: verify `fraction` of the candidates (rounded, halves up) instead of the
    cost model's choice."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1] (share of the candidates to verify), got {fraction!r}")
    num_candidates = rank_candidates(survival, cfg).values.size
    return int(math.floor(fraction * num_candidates + 0.5))


def tier_aligned_budget(num_reqs: int, budget: int, floor: int, cap: int, tiers: Sequence[int]) -> int:
    """Graph-tier alignment ("paid padding reclamation").

    The rows of the chosen budget replay in the smallest tier that holds them; its padding rows
    cost nothing extra, so the budget grows to fill the tier with the next-best candidates:
    `min(G, B * cap) - B * floor`. Allocation still never takes a candidate below survival_eps,
    so the step may stay short of the tier.
    """
    rows = num_reqs * floor + budget
    tier = tier_for(rows, tiers)
    return max(budget, min(tier, num_reqs * cap) - num_reqs * floor)
