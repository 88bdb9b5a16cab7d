"""The adaptive plan under sampled drafts keeps the target's distribution exactly.

Rejection sampling commits a token with the target's distribution only if whether draft j is verified
does not depend on draft j's own draw. Slot j + 1's confidence reads the token drawn at slot j (the
Markov input of the confidence head), so a budget chosen from this step's survival would make draft j's
verification depend on its draw through the later drafts' survival; for sampled requests the budget reads
their previous step instead (`AdaptiveVerifyPlan.plan_step`, docs/planner.md "Sampled drafts").

- Property: for a sampled request, "draft j verified" is a function of its confidence at positions <= j
  (and of the other requests and the past), on seeded random tables, tiers, query-block classes and
  configurations, in steps mixing sampled and greedy requests; the same search finds cases where a greedy
  plan's (this step's survival) is not, which greedy drafts may afford (they are not drawn). With classes
  (`one_row_class`, on steps without graph tiers) sampled requests keep their rows and greedy ones below
  the widest class join it, which the seeds exercise.
- Exact: the first committed token's distribution, enumerated over a two-token draft, equals the
  target's with the plan as the engine calls it, and differs when the budget reads this step.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from fractions import Fraction

import pytest
import torch

from dspark.modes import VerifyMode
from dspark.runtime.attention.metadata import row_class_bounds
from dspark.runtime.planner import verify_plan
from dspark.runtime.planner.survival import LaggedSurvival
from dspark.runtime.planner.verify_plan import AdaptiveVerifyPlan

from .test_planner_fast_path import probes, random_table


def _random_plan(rng: random.Random, gamma: int, num_reqs: int) -> AdaptiveVerifyPlan:
    n = gamma + 1
    kind = rng.choice(["sps-1d", "additive", "tier"])
    mode = rng.choice([VerifyMode.COMPACT, VerifyMode.CAP_ACCEPT])
    if rng.random() < 0.5:
        # Query-block classes (`one_row_class`) apply only to steps that run no graph tiers (`plan_step`).
        tiers, align, classes = (), False, row_class_bounds(n, rng.choice([1, 2, 4, 8]))
    else:
        tiers = tuple(sorted(set(probes(rng, num_reqs * n, rng.randint(1, 5)) + [num_reqs * n])))
        align, classes = mode.packs_rows and rng.random() < 0.5, ()
    return AdaptiveVerifyPlan(
        gamma=gamma, mode=mode, min_verify_len=rng.randint(1, 2), survival_eps=rng.choice([1e-6, 0.05]),
        align_to_graph_tier=align, cost_model=random_table(rng, kind, num_reqs * n, num_reqs),
        token_tiers=tiers, row_classes=classes)


def _row_class(rows: int, bounds: tuple[int, ...]) -> int:
    """The query-block class of `rows` rows: how many class bounds lie below it."""
    return sum(bound < rows for bound in bounds)


def _plan(plan: AdaptiveVerifyPlan, logits: torch.Tensor, earlier: torch.Tensor | None,
          sampled: tuple[bool, ...]) -> tuple[int, ...]:
    """verify_lens as the engine gets them: the runtime's history holds the previous step (or nothing).

    With query-block classes, also checks them against the plan without: sampled requests keep their
    rows, greedy ones below the widest class are raised to its fewest rows (never past the cap)."""
    num_reqs = logits.shape[0]
    slots, gens = list(range(num_reqs)), [0] * num_reqs
    history = LaggedSurvival(plan.history_lag(), plan.gamma)
    if earlier is not None:
        history.record(slots, gens, torch.cumprod(torch.sigmoid(earlier), dim=1))
    lens = plan.plan_step(logits, num_reqs, slots, gens, history, sampled=sampled).verify_lens
    bounds = plan.row_classes
    if bounds and plan.mode.packs_rows and not plan.token_tiers:
        base = _plan(plan.with_overrides(row_classes=()), logits, earlier, sampled)
        widest = max(_row_class(rows, bounds) for rows in base)
        fewest = min(bounds[widest - 1] + 1, plan.schedule.cap) if widest else 0
        flags = sampled or (False,) * num_reqs
        assert lens == tuple(rows if is_sampled or _row_class(rows, bounds) == widest else max(rows, fewest)
                             for rows, is_sampled in zip(base, flags, strict=True)), (base, bounds, flags)
    return lens


def _dependence(seed: int, sampled: bool) -> str | None:
    """A case where draft j's verification changes with the confidence after it, or None. `sampled`: a
    random mix of sampled and greedy requests (at least one sampled), and only sampled requests' drafts
    are checked; else every request is greedy (no flags), and any request's."""
    rng = random.Random(seed)
    gamma, num_reqs = rng.randint(2, 7), rng.randint(1, 6)
    plan = _random_plan(rng, gamma, num_reqs)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_reqs, gamma, generator=gen) * 3
    earlier = None if rng.random() < 0.3 else torch.randn(num_reqs, gamma, generator=gen) * 3
    flags: tuple[bool, ...] = ()
    if sampled:
        mix = [rng.random() < 0.5 for _ in range(num_reqs)]
        mix[rng.randrange(num_reqs)] = True
        flags = tuple(mix)
    checked = [r for r in range(num_reqs) if not flags or flags[r]]
    try:
        base = _plan(plan, logits, earlier, flags)
    except ValueError:  # the floor alone does not fit the random table's row limit
        return None
    for _ in range(6):
        r, j = rng.choice(checked), rng.randint(1, gamma - 1)
        changed = logits.clone()
        changed[r, j:] = torch.randn(gamma - j, generator=gen) * 3  # what another draw of draft j reads
        lens = _plan(plan, changed, earlier, flags)
        if (base[r] > j) != (lens[r] > j):  # draft j is verified when verify_len >= j + 1
            return f"seed {seed}: request {r}, draft {j}: verify_len {base[r]} -> {lens[r]}"
    return None


@pytest.mark.parametrize("seed", range(300))
def test_a_sampled_drafts_verification_never_reads_the_confidence_after_it(seed: int) -> None:
    assert _dependence(seed, sampled=True) is None


def test_a_budget_from_this_steps_survival_would_read_it() -> None:
    found = [case for seed in range(300) if (case := _dependence(seed, sampled=False)) is not None]
    assert found, "no case found: the property test above would not notice the budget reading this step"


def test_the_seeds_raise_greedy_requests_beside_sampled_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    # The property above holds in steps where the row-class rule ran and raised greedy requests beside
    # sampled ones (the steps whose verify_lens it changed).
    real, steps = verify_plan.one_row_class, []

    def spy(verify_lens: Sequence[int], bounds: Sequence[int], sampled: Sequence[bool],
            cap: int) -> tuple[int, ...]:
        lens = real(verify_lens, bounds, sampled, cap)
        steps.append(any(sampled) and not all(sampled) and lens != tuple(verify_lens))
        return lens

    monkeypatch.setattr(verify_plan, "one_row_class", spy)
    for seed in range(300):
        assert _dependence(seed, sampled=True) is None
    assert steps, "no seed planned with row classes"
    raised = sum(steps)
    assert raised >= 10, f"{raised} of {len(steps)} steps raised a greedy request beside a sampled one"


# --- the committed token's distribution, exactly ---------------------------------------------------------
P = (Fraction(8, 10), Fraction(2, 10))  # the target's next-token distribution
Q = (Fraction(5, 10), Fraction(5, 10))  # the draft's at slot 1


def _first_token(verified: dict[int, bool]) -> tuple[Fraction, Fraction]:
    """P(first committed token = y): draft 1 is x ~ Q; verified (`verified[x]`) it is accepted with
    min(1, P/Q), else the token comes from the residual (P - Q)+; not verified, the bonus is drawn from P."""
    residual = [max(p - q, Fraction(0)) for p, q in zip(P, Q, strict=True)]
    mass = sum(residual)
    out = [Fraction(0), Fraction(0)]
    for x in (0, 1):
        if verified[x]:
            accept = min(Fraction(1), P[x] / Q[x])
            out[x] += Q[x] * accept
            for y in (0, 1):
                out[y] += Q[x] * (1 - accept) * residual[y] / mass
        else:
            for y in (0, 1):
                out[y] += Q[x] * P[y]
    return out[0], out[1]


@pytest.mark.parametrize("sampled", [True, False])
def test_the_first_committed_token_follows_the_target_exactly(sampled: bool) -> None:
    # One request, two drafts. Draft 1's confidence is 0.6; draft 2's reads draft 1's token: 0.95 after
    # token 0, 0.01 after token 1. The table prices one row at 1 s and two or three rows at 2 s: verifying
    # draft 1 alone never pays (1.6 tokens in 2 s), drafts 1 and 2 together do after token 0 (2.17 in 2 s).
    plan = AdaptiveVerifyPlan(gamma=2, mode=VerifyMode.COMPACT, cost_model={
        "type": "sps-1d", "sample_batch_tokens": (1, 2, 3), "max_batch_tokens": 3,
        "sample_steps_per_sec": (1.0, 0.5, 0.5)})
    logit = torch.logit(torch.tensor([0.6, 0.95, 0.01], dtype=torch.float64)).float()
    earlier = torch.stack((logit[0], logit[1]))[None]  # the previous step drafted token 0 at slot 1
    verified = {}
    for x, second in ((0, logit[1]), (1, logit[2])):
        lens = _plan(plan, torch.stack((logit[0], second))[None], earlier, (True,) if sampled else ())
        verified[x] = lens[0] > 1
    distribution = _first_token(verified)
    if sampled:  # the budget read the previous step (two drafts worth it): draft 1 verified either way
        assert verified == {0: True, 1: True}
        assert distribution == P
    else:  # the budget read this step: draft 1 is verified only after token 0 was drawn
        assert verified == {0: True, 1: False}
        assert distribution != P
