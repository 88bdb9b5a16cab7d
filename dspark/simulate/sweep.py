"""Every policy at every concurrency: steps of c request-steps drawn from the trace, priced by the table.

At concurrency c each simulated step draws c distinct request-steps of the trace (with replacement
only when the trace holds fewer than c) from a generator seeded by (seed, c), so a concurrency's
figures do not depend on which others were asked for. Every policy sees the same draws, so their
differences are the policies', not the sample's. Throughput is total committed tokens over total
predicted seconds.

When the cost of a step never falls as rows are added and the cost per row never rises (a fixed
part plus rows at a non-increasing marginal cost), `oracle` is at least every fixed k: it commits
the most tokens any policy can and runs one row per token. A table with tier cliffs can break that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dspark.simulate.policies import Batch, Policy, committed_tokens, dropped_drafts
from dspark.simulate.pricing import StepPricer
from dspark.simulate.trace import Trace


@dataclass(frozen=True)
class DroppedDrafts:
    """The drafts a planner left out, over all simulated steps: what its survival said they were
    worth against how many the target would have accepted."""

    count: int
    survival: float  # summed survival
    reached: int  # accepted, had they been verified

    @property
    def mean_survival(self) -> float:
        return self.survival / self.count if self.count else 0.0

    @property
    def reach_rate(self) -> float:
        return self.reached / self.count if self.count else 0.0


@dataclass(frozen=True)
class PolicyResult:
    """One policy at one concurrency (the JSON `results` entries)."""

    concurrency: int
    policy: str
    verify_len: int | None
    tokens_per_s: float
    tokens_per_step: float  # committed tokens per step, summed over the batch
    rows_per_step: float  # rows the target runs per step, tier padding included
    dropped: DroppedDrafts | None = None  # a planner's left-out drafts (not in the JSON results entries)
    off_share: float = 0.0  # share of the steps decoded without speculation

    def to_json(self) -> dict[str, object]:
        return {"concurrency": self.concurrency, "policy": self.policy, "verify_len": self.verify_len,
                "tokens_per_s": self.tokens_per_s, "tokens_per_step": self.tokens_per_step,
                "rows_per_step": self.rows_per_step, "off_share": self.off_share}


@dataclass
class Tally:
    """Running sums of one policy's simulated steps."""

    steps: int = 0
    tokens: int = 0
    rows: int = 0
    seconds: float = 0.0
    dropped: DroppedDrafts | None = None
    off_steps: int = 0

    def add(self, tokens: int, rows: int, seconds: float,
            dropped: tuple[float, int, int] | None = None, drafted: bool = True) -> None:
        self.steps += 1
        self.off_steps += not drafted
        self.tokens += tokens
        self.rows += rows
        self.seconds += seconds
        if dropped is not None:
            survival, reached, count = dropped
            before = self.dropped or DroppedDrafts(0, 0.0, 0)
            self.dropped = DroppedDrafts(before.count + count, before.survival + survival,
                                         before.reached + reached)

    def result(self, concurrency: int, policy: Policy) -> PolicyResult:
        steps = max(self.steps, 1)
        return PolicyResult(concurrency, policy.name, policy.verify_len, self.tokens / self.seconds,
                            self.tokens / steps, self.rows / steps, self.dropped, self.off_steps / steps)


def trace_batch(trace: Trace, rows: np.ndarray, source: np.ndarray | None) -> Batch:
    """The batch of the trace's request-steps `rows`; with a lag, `source` holds each request's earlier
    row of the trace (-1: none), whose confidence the planner's budget reads."""
    accept = None if trace.accept_prob is None else trace.accept_prob[rows]
    if source is None:
        return Batch(trace.confidence[rows], trace.raw_correct_len[rows], accept_prob=accept,
                     sampled=trace.sampled)
    known = source >= 0
    return Batch(trace.confidence[rows], trace.raw_correct_len[rows],
                 trace.confidence[np.where(known, source, 0)], known, accept, trace.sampled)


def draw(rng: np.random.Generator, size: int, concurrency: int) -> np.ndarray:
    return rng.choice(size, size=concurrency, replace=size < concurrency)


def simulate_concurrency(trace: Trace, policies: Sequence[Policy], pricer: StepPricer, concurrency: int,
                         steps: int, seed: int, lag_steps: int = 0) -> list[PolicyResult]:
    """Every policy over `steps` steps of `concurrency` request-steps drawn from the trace."""
    if concurrency < 1 or steps < 1:
        raise ValueError(f"concurrency and steps must be >= 1, got {concurrency} and {steps}")
    rng = np.random.default_rng((seed, concurrency))
    lag = trace.budget_lag(lag_steps)
    lag_source = trace.lag_source(lag) if lag else None
    tallies = [Tally() for _ in policies]
    for policy in policies:
        policy.reset()
    for _ in range(steps):
        rows = draw(rng, trace.size, concurrency)
        batch = trace_batch(trace, rows, None if lag_source is None else lag_source[rows])
        for policy, tally in zip(policies, tallies, strict=True):
            lens = policy.lens(batch)
            ran = pricer.padded_rows(lens.run_rows) if lens.drafted else lens.run_rows
            tally.add(committed_tokens(batch.raw_correct_len, lens.verify_lens), ran,
                      pricer.step_seconds(concurrency, lens.run_rows, lens.drafted),
                      dropped_drafts(lens, batch.raw_correct_len), lens.drafted)
    return [tally.result(concurrency, policy) for policy, tally in zip(policies, tallies, strict=True)]


def simulate(trace: Trace, policies: Sequence[Policy], pricer: StepPricer, concurrencies: Sequence[int],
             steps: int, seed: int, lag_steps: int = 0) -> list[PolicyResult]:
    """`simulate_concurrency` for each concurrency, in the order given."""
    return [result for c in concurrencies
            for result in simulate_concurrency(trace, policies, pricer, c, steps, seed, lag_steps)]


@dataclass(frozen=True)
class Comparison:
    """Adaptive (with its off state) against target-only, the best fixed verify length, the oracle and
    static at one concurrency."""

    concurrency: int
    best_fixed_verify_len: int
    adaptive_over_best_fixed: float
    adaptive_over_oracle: float
    adaptive_over_static: float
    adaptive_over_target_only: float
    adaptive_off_share: float  # share of adaptive's steps without speculation
    adaptive_dropped: DroppedDrafts | None = None
    # adaptive-on over `informed` (the plan on the true acceptance probabilities), where the trace has them
    adaptive_on_over_informed: float | None = None

    @property
    def adaptive_over_best(self) -> float:
        """Adaptive over the better of target-only and the best fixed verify length."""
        return min(self.adaptive_over_best_fixed, self.adaptive_over_target_only)

    def to_json(self) -> dict[str, object]:
        dropped = self.adaptive_dropped
        return {"concurrency": self.concurrency, "best_fixed_verify_len": self.best_fixed_verify_len,
                "adaptive_over_best_fixed": self.adaptive_over_best_fixed,
                "adaptive_over_oracle": self.adaptive_over_oracle,
                "adaptive_over_static": self.adaptive_over_static,
                "adaptive_over_target_only": self.adaptive_over_target_only,
                "adaptive_over_best": self.adaptive_over_best,
                "adaptive_off_share": self.adaptive_off_share,
                "adaptive_on_over_informed": self.adaptive_on_over_informed,
                "adaptive_dropped_drafts": None if dropped is None else {
                    "count": dropped.count, "mean_survival": dropped.mean_survival,
                    "reach_rate": dropped.reach_rate}}


def compare(results: Sequence[PolicyResult]) -> list[Comparison]:
    """One `Comparison` per concurrency present in `results` (ratios of tokens/s)."""
    out = []
    for c in dict.fromkeys(r.concurrency for r in results):
        at = [r for r in results if r.concurrency == c]
        one = {r.policy: r for r in at if r.policy != "fixed"}
        best = max((r for r in at if r.policy == "fixed"), key=lambda r: r.tokens_per_s)
        adaptive = one["adaptive"]
        rate = adaptive.tokens_per_s
        assert best.verify_len is not None
        out.append(Comparison(c, best.verify_len, rate / best.tokens_per_s, rate / one["oracle"].tokens_per_s,
                              rate / one["static"].tokens_per_s, rate / one["target-only"].tokens_per_s,
                              adaptive.off_share, adaptive.dropped,
                              (one["adaptive-on"].tokens_per_s / one["informed"].tokens_per_s
                               if "informed" in one and "adaptive-on" in one else None)))
    return out
