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

The planner runs on the host every step, so it is built for B*gamma of a few thousand values: one copy
of the survival to the host, numpy from there on, one ordering of the candidates that the budget and
the allocation share (`Ranking`: the engine's plan ranks once and passes the ranking to both), and cost
tables answering a step's consecutive M values with a slice.
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

    `predicted_step_seconds` is the verify step plus the draft term and the step offset the planner was
    given, so `objective = tau / predicted_step_seconds` (tokens per second); both are None when there is
    no cost model.
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


def survival_by_position(survival: torch.Tensor, cfg: ScheduleConfig) -> np.ndarray:
    """The survival, validated, as a float64 host array `[gamma, B]` (position-major).

    This is the one device-to-host copy a step's plan needs: the budget and the layout are host
    decisions. float64 compares with `survival_eps` and sums tau exactly as the scalar definition
    does. Position-major because the rank order breaks ties by position first, and because numpy
    reduces across contiguous rows (per request, over positions) far faster than along them.
    """
    if survival.dim() != 2 or survival.shape[1] != cfg.gamma:
        raise ValueError(f"survival must be [B, gamma={cfg.gamma}], got shape {tuple(survival.shape)}")
    if not survival.is_floating_point():
        raise ValueError(f"survival must be a floating tensor, got {survival.dtype}")
    s = survival.detach()
    if s.device.type != "cpu":
        s = s.cpu()
    if s.dtype not in (torch.float32, torch.float64):  # numpy has no half or bfloat16
        s = s.to(torch.float64)
    by_pos = np.ascontiguousarray(s.numpy().T, dtype=np.float64)
    # Non-increasing along positions and within [0, 1] at both ends means within [0, 1] everywhere;
    # any NaN fails a comparison. Only a failure pays for finding what exactly is wrong.
    if by_pos.size and not ((by_pos[1:] <= by_pos[:-1]).all() and by_pos[0].max() <= 1
                            and by_pos[-1].min() >= 0):
        host = by_pos.T
        if not ((host >= 0) & (host <= 1)).all():
            raise ValueError("survival must be probabilities in [0, 1] (no NaN); build it with "
                             "survival_from_logits")
        r, k = (int(i) for i in np.argwhere(host[:, 1:] > host[:, :-1])[0])
        raise ValueError(f"survival must be non-increasing along positions (a cumulative product), but "
                         f"request {r} rises from {float(host[r, k])} at draft {k + 1} to "
                         f"{float(host[r, k + 1])} at draft {k + 2}; build it with survival_from_logits")
    return by_pos


def check_survival(survival: torch.Tensor, cfg: ScheduleConfig) -> torch.Tensor:
    """The survival `[B, gamma]`, validated, as a float64 CPU tensor."""
    return torch.from_numpy(survival_by_position(survival, cfg).T)


class Ranking:
    """One step's candidates, ordered once and shared by the budget and the allocation.

    The budget needs every candidate's survival best first (tau's prefix sums); the allocation needs
    only the b-th best value v: each request holds its candidates above v (a prefix of its row, as
    survival is non-increasing along it) plus the ties at v that the rank order reaches first. So one
    sort serves both, and an allocation on its own needs only a selection.
    """

    def __init__(self, by_position: np.ndarray, cfg: ScheduleConfig) -> None:
        f = cfg.floor
        self.num_reqs: int = by_position.shape[1]
        self.floor = f
        # Drafts 1..f-1 are verified whatever their value.
        self.floor_sum = float(by_position[: f - 1].sum()) if f > 1 else 0.0
        self.block = by_position[f - 1 : cfg.cap - 1]  # drafts f..L-1 [L - f, B]: one row per position
        valid = self.block >= cfg.survival_eps
        # Candidates of a request are a prefix of its drafts: survival never rises along them.
        self.valid_counts = np.add.reduce(valid, axis=0, dtype=np.intp)
        self._values = self.block[valid]
        self.num_candidates: int = self._values.size
        self._descending: np.ndarray | None = None

    @classmethod
    def of(cls, survival: torch.Tensor, cfg: ScheduleConfig) -> Ranking:
        return cls(survival_by_position(survival, cfg), cfg)

    @property
    def descending(self) -> np.ndarray:
        """Every candidate's survival, best first (equal values are interchangeable in a prefix sum)."""
        if self._descending is None:
            self._values.sort()
            self._descending = self._values[::-1]
        return self._descending

    def counts(self, budget: int) -> np.ndarray:
        """How many of the `budget` best candidates each request holds (all of them past their number)."""
        if budget >= self.num_candidates:
            return self.valid_counts.copy()  # the ranking's own array stays unchanged
        if budget == 0:
            return np.zeros(self.num_reqs, np.intp)
        if self._descending is not None:
            kth = self._descending[budget - 1]
        else:
            kth = np.partition(self._values, self.num_candidates - budget)[self.num_candidates - budget]
        counts = np.add.reduce(self.block > kth, axis=0, dtype=np.intp)
        # The rest are ties at kth, taken in rank order: earlier position, then lower request index,
        # which is the order of the position-major block's flat indices.
        tied = np.flatnonzero(self.block == kth)[: budget - int(counts.sum())]
        counts += np.bincount(tied % self.num_reqs, minlength=self.num_reqs)
        return counts

    def verify_lens(self, budget: int) -> np.ndarray:
        """`verify_lens` [B] int32: the floor plus each request's share of the budget."""
        return (self.floor + self.counts(budget)).astype(np.int32)


def rank_candidates(survival: torch.Tensor, cfg: ScheduleConfig) -> Candidates:
    """Every candidate with its request and position, in rank order (for analyses that need the
    order itself; the planner needs only `Ranking`)."""
    ranking = Ranking.of(survival, cfg)
    num_reqs = ranking.num_reqs
    # Flattening position-major makes a stable descending sort break ties by earlier position, then
    # lower request index.
    block = ranking.block.ravel()
    flat_index = np.flatnonzero(block >= cfg.survival_eps)
    values = block[flat_index]
    order = np.argsort(-values, kind="stable")
    ranked = flat_index[order]
    divisor = max(num_reqs, 1)  # no candidates exist when B = 0; avoids a modulo by zero
    return Candidates(num_reqs, ranking.floor_sum, values[order], ranked % divisor, ranked // divisor)


def _row_limit(cost_model: CostModel | None, max_rows: int | None) -> int | None:
    limits = []
    if max_rows is not None:
        limits.append(require_int("max_rows", max_rows))
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1 (e.g. the largest captured graph tier), got {max_rows}")
    if cost_model is not None and cost_model.max_rows is not None:
        limits.append(cost_model.max_rows)
    return min(limits) if limits else None


def _check_cost_model(cost_model: CostModel | None) -> None:
    if cost_model is not None and not isinstance(cost_model, (SpsTable, AdditiveCostTable, TierCostTable)):
        raise TypeError(f"cost_model must be an SpsTable, an AdditiveCostTable, a TierCostTable or None, got "
                        f"{type(cost_model).__name__}")


def choose_budget(survival: torch.Tensor, cost_model: CostModel | None, cfg: ScheduleConfig,
                  max_rows: int | None = None, offset_seconds: float = 0.0) -> BudgetDecision:
    """The budget b (extra rows beyond the floor) maximising expected progress per second.

    The objective is `tau(b) * SPS(M)` for an `SpsTable` and `tau(b) / T(B, M)` for an
    `AdditiveCostTable` or a `TierCostTable`; with a draft term it is `tau(b) / (step seconds +
    draft_time(B))`, and `offset_seconds` (the measured excess of a step over its price, `step_offset`) is
    added to every step's seconds. Only budgets with M within `cost_model.max_rows` (a tier table's last
    tier) and `max_rows` are feasible; the first maximum wins ties. Without a cost model every candidate
    is verified, as far as `max_rows` allows.
    """
    _check_cost_model(cost_model)
    return decide_budget(Ranking.of(survival, cfg), cost_model, cfg, max_rows, offset_seconds)


def decide_budget(ranking: Ranking, cost_model: CostModel | None, cfg: ScheduleConfig,
                  max_rows: int | None = None, offset_seconds: float = 0.0) -> BudgetDecision:
    """`choose_budget` of an already ranked survival."""
    num_reqs = ranking.num_reqs
    base_rows = num_reqs * cfg.floor
    limit = _row_limit(cost_model, max_rows)
    if limit is not None and base_rows > limit:
        raise ValueError(f"the floor alone needs B * f = {num_reqs} * {cfg.floor} = {base_rows} rows but at "
                         f"most {limit} are feasible (max_rows={max_rows}, cost model max_rows="
                         f"{cost_model.max_rows if cost_model else None}); split the batch, lower "
                         "min_verify_len, or capture/profile larger steps")
    top = ranking.num_candidates if limit is None else min(ranking.num_candidates, limit - base_rows)
    tau = np.empty(top + 1)
    tau[0] = 0.0
    np.add.accumulate(ranking.descending[:top], out=tau[1:])  # np.cumsum, less its wrapper
    tau += num_reqs + ranking.floor_sum
    if cost_model is None:
        return BudgetDecision(top, base_rows + top, float(tau[top]), None, None)

    # The budgets' M values are consecutive, so each table answers with a slice of its values
    # tabulated at every M (cost_models: `rates_for_rows`, `step_time_for_rows`).
    if not offset_seconds >= 0:
        raise ValueError(f"offset_seconds must be >= 0, got {offset_seconds}")
    # Seconds every budget's step pays on top of its verify rows: the draft and the measured offset.
    extra_seconds = cost_model.draft_time(num_reqs) + offset_seconds
    if isinstance(cost_model, SpsTable):
        steps_per_sec = cost_model.rates_for_rows(base_rows, top + 1)
        if extra_seconds == 0:
            # Without a draft term use the table's rate directly: tau * SPS is the source's formula.
            objective = tau * steps_per_sec
        else:
            objective = tau / (1.0 / steps_per_sec + extra_seconds)
    else:
        step_seconds = cost_model.step_time_for_rows(num_reqs, base_rows, top + 1)
        if extra_seconds:
            step_seconds = step_seconds + extra_seconds
        objective = tau / step_seconds
    best = objective.max()
    budget = int(np.argmax(objective >= best - TIE_RTOL * best))
    if isinstance(cost_model, SpsTable):
        seconds = 1.0 / float(steps_per_sec[budget]) + extra_seconds
    else:
        seconds = float(step_seconds[budget])
    return BudgetDecision(budget, base_rows + budget, float(tau[budget]), seconds, float(objective[budget]))


def price_of_rows(cost_model: CostModel, num_reqs: int, num_rows: int, offset_seconds: float = 0.0) -> float:
    """`decide_budget`'s price of one step of `num_reqs` requests and `num_rows` rows: the verify step, the
    draft term and the step offset."""
    extra = cost_model.draft_time(num_reqs) + offset_seconds
    if isinstance(cost_model, SpsTable):
        return 1.0 / float(cost_model.rates_for_rows(num_rows, 1)[0]) + extra
    return float(cost_model.step_time_for_rows(num_reqs, num_rows, 1)[0]) + extra


def allocate_verify_lens_host(survival: torch.Tensor, budget: int, cfg: ScheduleConfig) -> np.ndarray:
    """`verify_lens` [B] as a host int array: the floor f plus, per request, how many of the `budget`
    best candidates it holds (all candidates when the budget exceeds their number)."""
    budget = require_int("budget", budget)
    if budget < 0:
        raise ValueError(f"budget must be >= 0 extra rows, got {budget}")
    return Ranking.of(survival, cfg).verify_lens(budget)


def allocate_verify_lens(survival: torch.Tensor, budget: int, cfg: ScheduleConfig) -> torch.Tensor:
    """`allocate_verify_lens_host` as an int32 tensor on the survival's device."""
    return torch.from_numpy(allocate_verify_lens_host(survival, budget, cfg)).to(survival.device)


def forced_budget(survival: torch.Tensor, cfg: ScheduleConfig, fraction: float) -> int:
    """Experiment override: verify `fraction` of the candidates (rounded, halves up) instead of the
    cost model's choice."""
    check_fraction(fraction)
    return fraction_of(Ranking.of(survival, cfg).num_candidates, fraction)


def check_fraction(fraction: float) -> None:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1] (share of the candidates to verify), got {fraction!r}")


def fraction_of(num_candidates: int, fraction: float) -> int:
    """`fraction` of `num_candidates`, rounded with halves up (`forced_budget`)."""
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
