"""The planner's fast path (one host copy, one ranking shared by budget and allocation, tables tabulated
at every M, numpy layouts on the host) against naive scalar references on seeded random inputs: the
same budgets and verify_lens, ties included, for every table kind, floor, cap, eps, row limit, draft
term, lag and graph-tier alignment, and the same layout as the layout kernel's reference."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from dspark.modes import VerifyMode
from dspark.runtime.kernels.verify_rows import build_verify_rows_torch
from dspark.runtime.layout import StepShape, plan_verify
from dspark.runtime.planner.budget import (
    TIE_RTOL,
    Ranking,
    ScheduleConfig,
    allocate_verify_lens,
    allocate_verify_lens_host,
    choose_budget,
    forced_budget,
    rank_candidates,
)
from dspark.runtime.planner.cost_models import (
    AdditiveCostTable,
    CostModel,
    CostModelError,
    SpsTable,
    TierCostTable,
    cost_model_from_dict,
)
from dspark.runtime.planner.survival import LaggedSurvival
from dspark.runtime.planner.verify_plan import AdaptiveVerifyPlan

SEEDS = range(400)

# --- naive references: Python scalars and lists, one candidate at a time --------------------------------


def interp(x: float, xs: tuple[int, ...], ys: tuple[float, ...]) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = max(k for k in range(len(xs)) if xs[k] <= x)
    return ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])


def draft_seconds(model: CostModel, num_reqs: int) -> float:
    return interp(num_reqs, model.draft_bs_probes, model.draft_seconds) if model.draft_seconds else 0.0


def naive_objective(model: CostModel, num_reqs: int, num_rows: int, tau: float) -> float:
    draft = draft_seconds(model, num_reqs)
    if isinstance(model, SpsTable):
        below = [i for i, m in enumerate(model.sample_batch_tokens) if m <= num_rows]
        rate = model.sample_steps_per_sec[below[-1] if below else 0]
        return tau * rate if draft == 0 else tau / (1.0 / rate + draft)
    if isinstance(model, TierCostTable):
        tier = min(j for j, t in enumerate(model.tiers) if t >= num_rows)
        seconds = interp(num_reqs, model.bs_probes, tuple(row[tier] for row in model.step_seconds))
    else:
        seconds = (model.bias_seconds + interp(num_reqs, model.bs_probes, model.alpha_seconds)
                   + interp(num_rows, model.m_probes, model.theta_seconds))
    return tau / (seconds + draft)


def naive_ranked(rows: list[list[float]], cfg: ScheduleConfig) -> list[tuple[float, int, int]]:
    """(survival, 1-based draft, request) of every candidate, best first by the documented tie rule."""
    cands = [(rows[r][j - 1], j, r) for r in range(len(rows)) for j in range(cfg.floor, cfg.cap)
             if rows[r][j - 1] >= cfg.survival_eps]
    return sorted(cands, key=lambda c: (-c[0], c[1], c[2]))


def naive_budget(rows: list[list[float]], model: CostModel | None, cfg: ScheduleConfig,
                 max_rows: int | None) -> int | None:
    """The first budget within TIE_RTOL of the best objective; None where the floor is infeasible."""
    num_reqs = len(rows)
    ranked = naive_ranked(rows, cfg)
    limits = [x for x in (max_rows, model.max_rows if model else None) if x is not None]
    base = num_reqs * cfg.floor
    if limits and base > min(limits):
        return None
    top = len(ranked) if not limits else min(len(ranked), min(limits) - base)
    start = num_reqs + math.fsum(rows[r][k] for r in range(num_reqs) for k in range(cfg.floor - 1))
    taus, acc = [start], 0.0
    for value, _, _ in ranked[:top]:
        acc += value
        taus.append(start + acc)
    if model is None:
        return top
    objective = [naive_objective(model, num_reqs, base + b, tau) for b, tau in enumerate(taus)]
    best = max(objective)
    return next(b for b, value in enumerate(objective) if value >= best - TIE_RTOL * best)


def naive_lens(rows: list[list[float]], budget: int, cfg: ScheduleConfig) -> list[int]:
    lens = [cfg.floor] * len(rows)
    for _, _, r in naive_ranked(rows, cfg)[:budget]:
        lens[r] += 1
    return lens


def naive_aligned(num_reqs: int, budget: int, cfg: ScheduleConfig, tiers: tuple[int, ...]) -> int:
    tier = min(t for t in tiers if t >= num_reqs * cfg.floor + budget)
    return max(budget, min(tier, num_reqs * cfg.cap) - num_reqs * cfg.floor)


# --- seeded random inputs ----------------------------------------------------------------------------------


def random_survival(rng: random.Random, num_reqs: int, gamma: int) -> torch.Tensor:
    """Continuous confidences mixed with a few exact values, so that ties, zeros and ones occur."""
    coarse = rng.random() < 0.5
    conf = [[rng.choice([0.0, 0.25, 0.5, 0.5, 1.0, 1.0]) if coarse and rng.random() < 0.7 else rng.random()
             for _ in range(gamma)] for _ in range(num_reqs)]
    dtype = torch.float64 if rng.random() < 0.2 else torch.float32
    return torch.cumprod(torch.tensor(conf, dtype=dtype).reshape(num_reqs, gamma), dim=1)


def random_config(rng: random.Random, gamma: int) -> ScheduleConfig:
    cap = rng.choice([0, 0, rng.randint(1, gamma + 1)])
    min_len = rng.choice([1, 1, rng.randint(0, cap or gamma + 1)])
    return ScheduleConfig(gamma=gamma, min_verify_len=min_len, max_verify_len=cap,
                          survival_eps=rng.choice([0.0, 1e-6, 1e-6, 0.1, 0.4]))


def probes(rng: random.Random, high: int, count: int) -> list[int]:
    return sorted(rng.sample(range(1, high + 1), min(count, high)))


def ascending(values: list[float]) -> list[float]:
    return sorted(values)


def random_table(rng: random.Random, kind: str, max_m: int, max_b: int) -> dict[str, Any]:
    """A cost table (as the JSON a generated config embeds) covering up to max_m rows and max_b requests;
    monotone, as table files must be (more work never costs less)."""
    table: dict[str, Any] = {"type": kind}
    bs = probes(rng, max_b, rng.randint(1, 4))
    if kind == "sps-1d":
        tokens = probes(rng, max_m, rng.randint(1, 6))
        table.update(sample_batch_tokens=tokens, max_batch_tokens=max_m + rng.randint(0, 8),
                     sample_steps_per_sec=ascending([rng.uniform(5.0, 500.0) for _ in tokens])[::-1])
    elif kind == "additive":
        ms = probes(rng, max_m, rng.randint(1, 6))
        table.update(bias_seconds=rng.uniform(1e-4, 5e-3), bs_probes=bs,
                     alpha_seconds=ascending([rng.uniform(0.0, 2e-3) for _ in bs]), m_probes=ms,
                     theta_seconds=ascending([rng.uniform(0.0, 1e-2) for _ in ms]))
    else:
        tiers = probes(rng, max_m, rng.randint(1, 6))
        tiers[-1] = max(tiers[-1], max_m)  # most steps fit; the row limit still binds at times
        # Non-negative increments along tiers and along B.
        by_tier = ascending([rng.uniform(1e-4, 1e-2) for _ in tiers])
        by_b = ascending([rng.uniform(0.0, 5e-3) for _ in bs])
        table.update(tiers=tiers, bs_probes=bs, step_seconds=[[t + b for t in by_tier] for b in by_b])
    if rng.random() < 0.4:
        draft_bs = probes(rng, max_b, rng.randint(1, 3))
        draft = ascending([rng.uniform(0.0, 5e-3) for _ in draft_bs])
        table.update(draft_bs_probes=draft_bs, draft_seconds=draft)
    return table


def random_case(seed: int) -> tuple[torch.Tensor, ScheduleConfig, dict[str, Any] | None, int | None]:
    rng = random.Random(seed)
    gamma = rng.randint(1, 8)
    num_reqs = 256 if seed % 50 == 0 else rng.randint(1, 24)
    survival = random_survival(rng, num_reqs, gamma)
    cfg = random_config(rng, gamma)
    kind = rng.choice(["sps-1d", "additive", "tier", None])
    table = None if kind is None else random_table(rng, kind, num_reqs * (gamma + 1), num_reqs)
    max_rows = rng.choice([None, None, rng.randint(1, num_reqs * (gamma + 1))])
    return survival, cfg, table, max_rows


# --- budgets and allocations -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_budget_and_allocation_equal_the_naive_reference(seed: int) -> None:
    survival, cfg, table, max_rows = random_case(seed)
    model = None if table is None else cost_model_from_dict(table, "test")
    rows = survival.tolist()
    expected = naive_budget(rows, model, cfg, max_rows)
    if expected is None:
        with pytest.raises(ValueError, match="the floor alone needs"):
            choose_budget(survival, model, cfg, max_rows)
        return
    decision = choose_budget(survival, model, cfg, max_rows)
    assert decision.budget == expected
    assert decision.num_rows == len(rows) * cfg.floor + expected
    for budget in {0, 1, expected, expected + 1, len(rows) * cfg.cap}:
        lens = allocate_verify_lens(survival, budget, cfg)
        assert lens.dtype == torch.int32 and lens.tolist() == naive_lens(rows, budget, cfg)
    # The fast path's tau is the verified rows' survival; the objective is its tokens per second.
    lens = naive_lens(rows, expected, cfg)
    tau = len(rows) + math.fsum(v for r, row in enumerate(rows) for v in row[: lens[r] - 1])
    assert decision.tau == pytest.approx(tau, rel=1e-12)
    if model is not None:
        assert decision.objective == pytest.approx(
            naive_objective(model, len(rows), decision.num_rows, tau), rel=1e-9)


@pytest.mark.parametrize("seed", range(0, 400, 4))
def test_a_shared_ranking_and_a_selection_allocate_alike(seed: int) -> None:
    survival, cfg, _, _ = random_case(seed)
    num = Ranking.of(survival, cfg).num_candidates
    for budget in range(num + 2):
        alone = Ranking.of(survival, cfg)  # allocation by selection, no sort
        shared = Ranking.of(survival, cfg)
        shared.descending  # noqa: B018  (sorts, as the budget's decision does)
        assert np.array_equal(alone.verify_lens(budget), shared.verify_lens(budget))
        assert np.array_equal(alone.verify_lens(budget), allocate_verify_lens_host(survival, budget, cfg))


@pytest.mark.parametrize("seed", range(0, 400, 8))
def test_rank_candidates_lists_the_naive_order(seed: int) -> None:
    survival, cfg, _, _ = random_case(seed)
    cands = rank_candidates(survival, cfg)
    ranked = naive_ranked(survival.tolist(), cfg)
    assert cands.values.tolist() == [v for v, _, _ in ranked]
    assert cands.requests.tolist() == [r for _, _, r in ranked]
    assert cands.positions.tolist() == [j - cfg.floor for _, j, _ in ranked]
    assert forced_budget(survival, cfg, 0.5) == math.floor(0.5 * len(ranked) + 0.5)


@pytest.mark.parametrize("num_reqs", [3, 8, 32])
@pytest.mark.parametrize("per_row", [1e-3, 3e-3, 1.1e-3])
def test_objectives_equal_up_to_rounding_go_to_the_smaller_budget(num_reqs: int, per_row: float) -> None:
    # Every candidate survives (tau = M) and a step costs per_row * M: every budget has the same tokens
    # per second, and rounding alone makes some later budget the plain argmax.
    table = AdditiveCostTable(0.0, (1,), (0.0,), (1, 4096), (per_row, 4096 * per_row))
    survival = torch.ones(num_reqs, 7)
    cfg = ScheduleConfig(gamma=7)
    assert naive_budget(survival.tolist(), table, cfg, None) == 0
    assert choose_budget(survival, table, cfg).budget == 0


def test_an_allocation_after_the_budget_sees_the_values_it_is_given() -> None:
    """An allocation ranks the values it is given, however they changed since the budget."""
    cfg = ScheduleConfig(gamma=3)
    survival = torch.tensor([[0.9, 0.8, 0.7], [0.6, 0.5, 0.4]])
    choose_budget(survival, None, cfg)
    assert allocate_verify_lens(survival, 2, cfg).tolist() == [3, 1]
    survival.numpy()[1] = [0.95, 0.94, 0.93]  # in place behind torch's back: no version bump
    assert allocate_verify_lens(survival, 2, cfg).tolist() == naive_lens(survival.tolist(), 2, cfg) == [1, 3]
    choose_budget(survival, None, cfg)
    capped = ScheduleConfig(gamma=3, max_verify_len=2)
    assert allocate_verify_lens(survival, 2, capped).tolist() == [2, 2]
    survival.numpy()[0, 0] = float("nan")
    with pytest.raises(ValueError, match="no NaN"):
        allocate_verify_lens(survival, 2, cfg)


def test_ties_allocate_by_position_then_request() -> None:
    # Four candidates of 0.5 at draft 1 (requests 0..3) and two at draft 2 (requests 0, 1), equal to the
    # draft-1 ones of requests 2 and 3: three extra rows go to draft 1 of requests 0, 1, 2.
    survival = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.25], [0.5, 0.0]])
    cfg = ScheduleConfig(gamma=2)
    assert allocate_verify_lens(survival, 3, cfg).tolist() == [2, 2, 2, 1]
    assert allocate_verify_lens(survival, 5, cfg).tolist() == [3, 2, 2, 2]
    assert allocate_verify_lens(survival, 6, cfg).tolist() == [3, 3, 2, 2]


# --- the plan a generated package runs ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(0, 400, 2))
def test_plan_step_equals_the_naive_pipeline(seed: int) -> None:
    """Budget (row limit = last tier in compact mode), forced fraction, tier alignment, allocation."""
    rng = random.Random(10_000 + seed)
    survival, cfg, table, _ = random_case(seed)
    num_reqs = survival.shape[0]
    tiers = tuple(sorted(set(probes(rng, num_reqs * cfg.num_draft_tokens, rng.randint(1, 5))
                             + [num_reqs * cfg.num_draft_tokens])))
    mode = rng.choice([VerifyMode.COMPACT, VerifyMode.COMPACT, VerifyMode.CAP_ACCEPT])
    fraction = rng.choice([None, None, None, rng.random()])
    plan = AdaptiveVerifyPlan(gamma=cfg.gamma, mode=mode, min_verify_len=cfg.min_verify_len,
                              max_verify_len=cfg.max_verify_len, survival_eps=cfg.survival_eps,
                              align_to_graph_tier=mode.packs_rows and rng.random() < 0.5,
                              cost_model=table, token_tiers=tiers, forced_budget_fraction=fraction)
    # The logits whose sigmoid-cumprod is this survival (up to float rounding): plan from the survival
    # the plan itself computes.
    conf = torch.ones_like(survival)
    conf[:, 1:] = survival[:, 1:] / survival[:, :-1].clamp(min=1e-30)
    conf[:, 0] = survival[:, 0]
    logits = torch.logit(conf.clamp(0.0, 1.0).double()).float()
    rows = torch.cumprod(torch.sigmoid(logits), dim=1).tolist()
    model = plan.table
    max_rows = tiers[-1] if mode.packs_rows else None
    budget = naive_budget(rows, model, cfg, max_rows)
    if budget is None:
        with pytest.raises(ValueError, match="the floor alone needs"):
            plan.plan_step(logits, num_reqs, list(range(num_reqs)), [1] * num_reqs)
        return
    step = plan.plan_step(logits, num_reqs, list(range(num_reqs)), [1] * num_reqs)
    assert step.decision is not None and step.decision.budget == budget
    if fraction is not None:
        budget = math.floor(fraction * len(naive_ranked(rows, cfg)) + 0.5)
        if max_rows is not None:
            budget = min(budget, max_rows - num_reqs * cfg.floor)
    if plan.align_to_graph_tier:
        budget = naive_aligned(num_reqs, budget, cfg, tiers)
        assert step.aligned_budget == budget
    assert list(step.verify_lens) == naive_lens(rows, budget, cfg)
    assert step.run_lens == (step.verify_lens if mode.packs_rows else (cfg.num_draft_tokens,) * num_reqs)


@pytest.mark.parametrize("seed", range(20))
def test_lagged_plans_budget_from_old_survival_and_allocate_by_the_current(seed: int) -> None:
    rng = random.Random(20_000 + seed)
    gamma, num_reqs = rng.randint(1, 7), rng.randint(1, 12)
    table = random_table(rng, "additive", num_reqs * (gamma + 1), num_reqs)
    plan = AdaptiveVerifyPlan(gamma=gamma, mode=VerifyMode.COMPACT, lag_steps=1, cost_model=table)
    history = LaggedSurvival(1, gamma)
    slots, gens = list(range(num_reqs)), [1] * num_reqs
    previous = None
    for _ in range(3):
        logits = torch.randn(num_reqs, gamma) * 2
        rows = torch.cumprod(torch.sigmoid(logits), dim=1).tolist()
        step = plan.plan_step(logits, num_reqs, slots, gens, history)
        lagged = previous if previous is not None else [[1.0] * gamma] * num_reqs
        budget = naive_budget(lagged, plan.table, plan.schedule, None)
        assert step.decision is not None and step.decision.budget == budget
        assert list(step.verify_lens) == naive_lens(rows, budget, plan.schedule)
        previous = rows


# --- tables tabulated at every M ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(60))
def test_tabulated_lookups_equal_the_per_row_lookups(seed: int) -> None:
    rng = random.Random(30_000 + seed)
    kind = ("sps-1d", "additive", "tier")[seed % 3]
    model = cost_model_from_dict(random_table(rng, kind, rng.randint(1, 300), rng.randint(1, 64)), "test")
    high = model.max_rows if model.max_rows is not None else 400
    for _ in range(6):  # growing, in any order, past the first tabulated size
        num_reqs = rng.randint(0, 80)
        first = rng.randint(0, high)
        count = rng.randint(0, high - first + 1)
        rows = np.arange(first, first + count)
        if isinstance(model, SpsTable):
            got, want = model.rates_for_rows(first, count), model.lookup_many(rows)
        else:
            got, want = model.step_time_for_rows(num_reqs, first, count), model.step_time_many(num_reqs, rows)
        assert got.dtype == np.float64 and np.array_equal(got, want)
        for _ in range(2):  # computed, then remembered per batch size
            want_draft = float(np.interp(num_reqs, model.draft_bs_probes, model.draft_seconds)) \
                if model.draft_seconds else 0.0
            assert model.draft_time(num_reqs) == want_draft


def test_tabulated_lookups_refuse_what_the_per_row_lookups_refuse() -> None:
    sps = SpsTable((8, 64), (900.0, 500.0), max_batch_tokens=96)
    with pytest.raises(CostModelError, match=r"num_rows 97 is outside \[0, max_batch_tokens=96\]"):
        sps.rates_for_rows(90, 8)
    tier = TierCostTable(tiers=(8, 16), bs_probes=(1,), step_seconds=((0.001, 0.002),))
    with pytest.raises(CostModelError, match="num_rows 17 is outside"):
        tier.step_time_for_rows(1, 10, 8)
    additive = AdditiveCostTable(0.001, (1,), (0.0,), (4,), (0.0002,))
    with pytest.raises(CostModelError, match="num_rows must be >= 0"):
        additive.step_time_for_rows(1, -1, 2)
    with pytest.raises(CostModelError, match="num_reqs must be an integer"):
        additive.step_time_for_rows(True, 0, 2)
    with pytest.raises(CostModelError, match="count must be >= 0"):
        sps.rates_for_rows(0, -1)
    assert sps.rates_for_rows(97, 0).size == 0  # an empty run is never out of range


# --- layouts -----------------------------------------------------------------------------------------------


def old_padded_slots(run_lens: list[int], shape: StepShape, tier: int) -> list[int]:
    full, rest = divmod(tier - sum(run_lens), shape.padding_request_rows or 1)
    lens = [*run_lens, *[shape.padding_request_rows] * full, *([rest] if rest else [])]
    if shape.slots_for_tier is not None:
        lens += [0] * (shape.slots_for_tier(tier) - len(lens))
    return lens


@pytest.mark.parametrize("seed", range(150))
def test_host_layout_equals_the_layout_kernel_reference(seed: int) -> None:
    rng = random.Random(40_000 + seed)
    n, page = rng.randint(1, 8), rng.choice([1, 4, 16])
    num_reqs = rng.randint(1, 40)
    run_lens = [rng.randint(1, n) for _ in range(num_reqs)]
    verify_lens = [rng.randint(1, r) for r in run_lens]
    prefix = [rng.randint(0, 200) for _ in range(num_reqs)]
    pages = 256 // page + 2
    table = torch.randint(0, 10_000, (num_reqs, pages), dtype=rng.choice([torch.int32, torch.int64]))
    total = sum(run_lens)
    tiers: tuple[int, ...] = ()
    slots: Callable[[int], int] | None = None
    if rng.random() < 0.6:
        tiers = tuple(sorted({total + rng.randint(0, 3 * n), total + rng.randint(3 * n, 9 * n), 1}))
        if rng.random() < 0.5:
            slots = (lambda tier: tier + 2)  # noqa: E731  (as many slots as a tier can need, and more)
    shape = StepShape(page_size=page, num_draft_tokens=n, tiers=tiers,
                      padding_request_rows=rng.randint(1, n) if tiers else 0, slots_for_tier=slots)
    layout = plan_verify(tuple(run_lens), tuple(verify_lens), prefix, table, shape, torch.device("cpu"))

    tier = min(t for t in tiers if t >= total) if tiers else total
    lens = old_padded_slots(run_lens, shape, tier) if tier > total or slots else run_lens
    padded_prefix = prefix + [0] * (len(lens) - num_reqs)
    kv = [max(p + r, 1) for p, r in zip(padded_prefix, lens, strict=True)]
    assert layout.tier == tier and layout.total_rows == total and layout.num_requests == num_reqs
    assert layout.rows_per_slot.tolist() == lens and layout.prefix_lens.tolist() == padded_prefix
    assert layout.kv_lens.tolist() == kv and layout.verify_lens.tolist() == verify_lens
    assert layout.host_kv_lens == tuple(kv)
    assert layout.host_qo_indptr == tuple(itertools.accumulate(lens, initial=0))
    assert layout.packed == (total < num_reqs * n)
    padded_table = torch.cat((table, table.new_zeros(len(lens) - num_reqs, pages)))
    assert torch.equal(layout.page_table, padded_table)
    rows = build_verify_rows_torch(torch.tensor(lens, dtype=torch.int32), torch.tensor(padded_prefix),
                                   padded_table, page, tier, n)
    for name in ("qo_indptr", "row_req", "positions", "out_cache_loc"):
        got, want = getattr(layout, name), getattr(rows, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert torch.equal(layout.src_index, rows.src_index[:total])
    for name in ("verify_lens", "rows_per_slot", "prefix_lens", "kv_lens"):
        assert getattr(layout, name).dtype == torch.int32
