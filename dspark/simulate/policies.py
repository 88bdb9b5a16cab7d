"""The verify policies a simulation compares, each turning one step's batch into `verify_lens`.

- `static`: every request verifies all N rows (the full B x N block).
- `fixed` k: every request verifies k rows, packed (what a compact step with floor = cap = k runs).
- `oracle`: each request verifies exactly the rows that commit a token, `raw_correct_len + 1` capped at
  N: the most tokens at the fewest rows, knowing the outcome in advance.
- `adaptive`: the deployment's own plan (`AdaptiveVerifyPlan.plan_step`: survival from the confidence
  with its temperatures, lag, floor and cap, survival_eps, budget under its cost model, tier alignment),
  and its off state (`SpeculationSwitch`, with the plan's hysteresis): steps without speculation where
  the table says they pay.
- `adaptive-on`: the same plan with speculation pinned on (`verify.off: never`).
- `target-only`: no speculation; every request commits one token per step, priced as a decode step.
- `informed` (traces that recorded `accept_prob`): the adaptive plan, speculation on and no lag, given each
  draft's true acceptance probability instead of the confidence head's estimate: the best a planner can do
  without knowing the outcome. The oracle also knows the outcome, which under rejection sampling is a coin
  flip no head can see; greedy, the two coincide (every probability is 0 or 1).

Committed tokens of a request follow from the trace's uncapped match: `min(raw_correct_len, verify_len
- 1) + 1`, exact because the trace's steps ran every row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from dspark.runtime.planner.survival import LaggedSurvival, survival_from_logits
from dspark.runtime.planner.switch import SpeculationSwitch
from dspark.runtime.planner.verify_plan import AdaptiveVerifyPlan


@dataclass(frozen=True)
class Batch:
    """One simulated step's requests: their confidence and outcome, and for a lagged planner the
    confidence its budget reads (`lagged_known` false: the request had no step that long ago)."""

    confidence: np.ndarray  # float32 [B, gamma]
    raw_correct_len: np.ndarray  # int64 [B]
    lagged: np.ndarray | None = None  # float32 [B, gamma]
    lagged_known: np.ndarray | None = None  # bool [B]
    accept_prob: np.ndarray | None = None  # float32 [B, gamma]: P(draft accepted | prefix accepted)
    sampled: bool = False  # the drafts were sampled: the budget reads `lagged` (one step back)

    @property
    def num_reqs(self) -> int:
        return int(self.raw_correct_len.shape[0])


@dataclass(frozen=True)
class StepLens:
    """What a policy decided for one step: rows each request may accept, and rows the target runs."""

    verify_lens: np.ndarray  # int [B]
    run_rows: int  # rows run for the real requests (before tier padding)
    survival: np.ndarray | None = None  # [B, gamma]: what a planner allocated the rows by
    drafted: bool = True  # False: a target-only decode step (one row per request, no draft)


def dropped_drafts(lens: StepLens, raw_correct_len: np.ndarray) -> tuple[float, int, int] | None:
    """For a planned step: the summed survival of the drafts it did not verify, how many of them the
    target would have accepted (the uncapped match reaches them), and how many there were. Where the
    first is well below the second, the planner cut drafts its survival undervalues."""
    if lens.survival is None:
        return None
    draft = np.arange(1, lens.survival.shape[1] + 1)[None, :]  # draft k sits in row k
    dropped = draft >= lens.verify_lens[:, None]
    reached = draft <= raw_correct_len[:, None]
    return float(lens.survival[dropped].sum()), int((dropped & reached).sum()), int(dropped.sum())


def commit_lens(raw_correct_len: np.ndarray, verify_lens: np.ndarray) -> np.ndarray:
    """Tokens each request commits: its accepted drafts (capped by its verify_len) plus the bonus."""
    return np.minimum(raw_correct_len, verify_lens - 1) + 1


def committed_tokens(raw_correct_len: np.ndarray, verify_lens: np.ndarray) -> int:
    """Tokens a step commits, summed over its requests."""
    return int(commit_lens(raw_correct_len, verify_lens).sum())


class Policy(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def verify_len(self) -> int | None: ...

    def lens(self, batch: Batch) -> StepLens: ...

    def reset(self) -> None:
        """Forget what earlier steps taught the policy (a new concurrency, a new run)."""
        ...


@dataclass(frozen=True)
class StaticPolicy:
    num_draft_tokens: int
    name: str = "static"
    verify_len: int | None = None

    def lens(self, batch: Batch) -> StepLens:
        n = self.num_draft_tokens
        return StepLens(np.full(batch.num_reqs, n), batch.num_reqs * n)

    def reset(self) -> None:
        pass


@dataclass(frozen=True)
class TargetOnlyPolicy:
    name: str = "target-only"
    verify_len: int | None = None

    def lens(self, batch: Batch) -> StepLens:
        return StepLens(np.ones(batch.num_reqs, dtype=np.int64), batch.num_reqs, drafted=False)

    def reset(self) -> None:
        pass


@dataclass(frozen=True)
class FixedPolicy:
    k: int
    name: str = "fixed"

    @property
    def verify_len(self) -> int:
        return self.k

    def lens(self, batch: Batch) -> StepLens:
        return StepLens(np.full(batch.num_reqs, self.k), batch.num_reqs * self.k)

    def reset(self) -> None:
        pass


@dataclass(frozen=True)
class OraclePolicy:
    num_draft_tokens: int
    name: str = "oracle"
    verify_len: int | None = None

    def lens(self, batch: Batch) -> StepLens:
        lens = np.minimum(batch.raw_correct_len + 1, self.num_draft_tokens)
        return StepLens(lens, int(lens.sum()))

    def reset(self) -> None:
        pass


class AdaptivePolicy:
    """The deployment's planner, called as the engine calls it, on the batch's recorded confidence; with
    `decode_time` (seconds of a target-only decode step of B requests) its off state too, stepped as the
    runtime steps it, with the plan's hysteresis."""

    verify_len: int | None = None

    def __init__(self, plan: AdaptiveVerifyPlan, decode_time: Callable[[int], float] | None = None) -> None:
        self.plan = plan
        self.decode_time = decode_time
        self.name = "adaptive" if decode_time is not None else "adaptive-on"
        self.reset()

    def reset(self) -> None:
        self.switch: SpeculationSwitch | None = (None if self.decode_time is None
                                                 else self.plan.off_state(self.decode_time))

    def lens(self, batch: Batch) -> StepLens:
        switch = self.switch
        keys = [(slot, 0) for slot in range(batch.num_reqs)]
        if switch is not None and not switch.speculates(switch.predict(keys)):
            return StepLens(np.ones(batch.num_reqs, dtype=np.int64), batch.num_reqs, drafted=False)
        num_reqs, plan = batch.num_reqs, self.plan
        slots, generations = list(range(num_reqs)), [0] * num_reqs
        history = None
        if plan.lag_steps or batch.sampled:
            lag = plan.history_lag()
            if batch.lagged is None or batch.lagged_known is None:
                raise ValueError(f"the plan's budget reads confidence {lag} steps back; give the batch "
                                 "its lagged confidence")
            # The engine's own history object, filled so that its oldest entry is the step `lag` ago:
            # requests absent then fall back to survival 1.0 exactly as they do when serving.
            history = LaggedSurvival(lag, plan.gamma)
            known = np.flatnonzero(batch.lagged_known)
            past = survival_from_logits(torch.from_numpy(batch.lagged[known]), plan.temperatures)
            history.record([slots[i] for i in known], [0] * known.size, past)
            for _ in range(lag - 1):
                history.record([], [], torch.empty((0, plan.gamma)))
        step = plan.plan_step(torch.from_numpy(batch.confidence), num_reqs, slots, generations, history,
                              sampled=(True,) * num_reqs if batch.sampled else ())
        if switch is not None:
            commits = commit_lens(batch.raw_correct_len, np.array(step.verify_lens))
            switch.observe(keys, commits.tolist(), sum(step.run_lens))
        survival = None if step.survival is None else step.survival.detach().cpu().numpy()
        return StepLens(np.array(step.verify_lens, dtype=np.int64), int(sum(step.run_lens)), survival)


class InformedPolicy:
    """The plan with speculation on and no lag, allocating by the survival the true acceptance
    probabilities give (`cumprod(accept_prob)`), through the plan's own budget and cost model."""

    name = "informed"
    verify_len: int | None = None

    def __init__(self, plan: AdaptiveVerifyPlan) -> None:
        # Uncalibrated logits of the probabilities: the plan's survival is then their running product.
        self.plan = plan.with_overrides(temperatures=None, lag_steps=0)

    def reset(self) -> None:
        pass

    def lens(self, batch: Batch) -> StepLens:
        if batch.accept_prob is None:
            raise ValueError("the informed policy needs the trace's accept_prob; record the trace again "
                             "with this version (`dspark run STATIC_PACKAGE --record DIR`)")
        prob = torch.from_numpy(batch.accept_prob).double().clamp(1e-12, 1.0 - 1e-12)
        num_reqs = batch.num_reqs
        step = self.plan.plan_step(torch.logit(prob), num_reqs, list(range(num_reqs)), [0] * num_reqs)
        survival = step.survival.detach().cpu().numpy() if step.survival is not None else None
        return StepLens(np.array(step.verify_lens, dtype=np.int64), int(sum(step.run_lens)), survival)


def policies_for(plan: AdaptiveVerifyPlan, decode_time: Callable[[int], float],
                 informed: bool = False) -> list[Policy]:
    """Every policy a simulation compares: target-only, static, fixed k = 1..N, adaptive with speculation
    pinned on and with its off state, oracle, and with `informed` (a trace with acceptance
    probabilities) the informed bound. `decode_time(B)` prices a target-only step for the planner."""
    n = plan.num_draft_tokens
    fixed = [FixedPolicy(k) for k in range(1, n + 1)]
    bound: list[Policy] = [InformedPolicy(plan)] if informed else []
    return [TargetOnlyPolicy(), StaticPolicy(n), *fixed, AdaptivePolicy(plan),
            AdaptivePolicy(plan, decode_time), *bound, OraclePolicy(n)]
