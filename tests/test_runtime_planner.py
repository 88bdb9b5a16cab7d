import itertools
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dspark.runtime.planner.budget import (
    TIE_RTOL,
    BudgetDecision,
    ScheduleConfig,
    allocate_verify_lens,
    choose_budget,
    forced_budget,
)
from dspark.runtime.planner.cost_models import AdditiveCostTable, CostModel, SpsTable, TierCostTable
from dspark.runtime.planner.survival import LaggedSurvival, survival_from_logits

EXAMPLE_CONFIDENCE = torch.tensor([[0.9, 0.8], [0.6, 0.5]])
# The source's assumed costs: 2 extra rows (M = 4) take 1 ms, 3 extra rows (M = 5) take 1.4 ms.
EXAMPLE_SPS = SpsTable(sample_batch_tokens=(4, 5), sample_steps_per_sec=(1000.0, 1 / 0.0014),
                       max_batch_tokens=6)
EXAMPLE_ADDITIVE = AdditiveCostTable(bias_seconds=0.0, bs_probes=(1,), alpha_seconds=(0.0,), m_probes=(4, 5),
                                     theta_seconds=(0.001, 0.0014))


def example_survival() -> torch.Tensor:
    return survival_from_logits(torch.logit(EXAMPLE_CONFIDENCE.double()))


# --- worked examples -------------------------------------------------------------------------------------


def test_source_example_survival_is_the_cumulative_product() -> None:
    expected = torch.tensor([[0.9, 0.72], [0.6, 0.3]], dtype=torch.float64)
    assert torch.allclose(example_survival(), expected, rtol=0, atol=1e-6)
    assert example_survival().dtype == torch.float64  # float64 logits keep their precision
    half = survival_from_logits(torch.logit(EXAMPLE_CONFIDENCE).to(torch.bfloat16))
    assert half.dtype == torch.float32  # the draft's logits are computed in float32


def test_source_example_two_extra_rows_go_to_the_first_request() -> None:
    lens = allocate_verify_lens(example_survival(), 2, ScheduleConfig(gamma=2))
    assert lens.tolist() == [3, 1] and lens.dtype == torch.int32
    decision = choose_budget(example_survival(), None, ScheduleConfig(gamma=2), max_rows=4)
    assert (decision.budget, decision.num_rows) == (2, 4)
    assert decision.tau == pytest.approx(3.62, abs=1e-6)


@pytest.mark.parametrize("table", [EXAMPLE_SPS, EXAMPLE_ADDITIVE], ids=["sps-1d", "additive"])
def test_source_example_budget_prefers_3620_over_3014_tokens_per_second(table: CostModel) -> None:
    decision = choose_budget(example_survival(), table, ScheduleConfig(gamma=2))
    assert decision.budget == 2 and decision.num_rows == 4
    assert decision.objective == pytest.approx(3620, rel=1e-6)
    assert decision.predicted_step_seconds == pytest.approx(0.001)
    # The source's alternative, 3 extra rows: the planner's tau for them over the table's time at M = 5.
    three = choose_budget(example_survival(), None, ScheduleConfig(gamma=2), max_rows=5)
    assert (three.budget, three.num_rows) == (3, 5) and three.tau == pytest.approx(4.22, abs=1e-6)
    seconds = 1 / table.lookup(5) if isinstance(table, SpsTable) else table.step_time(2, 5)
    assert seconds == pytest.approx(0.0014)
    three_rows = three.tau / seconds
    assert three_rows == pytest.approx(3014.3, abs=0.1)
    assert decision.objective > three_rows


def test_ties_go_to_the_smaller_budget() -> None:
    # Extra rows past the first add survival 0, so budgets 1..3 have the same objective.
    flat = SpsTable((1,), (100.0,), 64)
    cfg = ScheduleConfig(gamma=3, survival_eps=0.0)
    assert choose_budget(torch.tensor([[1.0, 0.0, 0.0]]), flat, cfg).budget == 1


def test_draft_term_amortises_and_can_raise_the_budget() -> None:
    survival = torch.tensor([[0.5]])
    cfg = ScheduleConfig(gamma=1)
    table = SpsTable((1, 2), (1000.0, 600.0), 2)
    assert choose_budget(survival, table, cfg).budget == 0  # 1 * 1000 beats 1.5 * 600
    with_draft = SpsTable((1, 2), (1000.0, 600.0), 2, draft_bs_probes=(1,), draft_seconds=(0.002,))
    decision = choose_budget(survival, with_draft, cfg)
    assert decision.budget == 1  # 1.5 / (1/600 + 0.002) beats 1 / (0.001 + 0.002)
    assert decision.predicted_step_seconds == pytest.approx(1 / 600 + 0.002)
    assert decision.objective == pytest.approx(1.5 / (1 / 600 + 0.002))


def test_max_rows_limits_the_budget_and_an_infeasible_floor_is_an_error() -> None:
    cfg = ScheduleConfig(gamma=2)
    assert choose_budget(example_survival(), None, cfg).budget == 4
    assert choose_budget(example_survival(), None, cfg, max_rows=3).budget == 1
    assert choose_budget(example_survival(), EXAMPLE_SPS, cfg, max_rows=3).num_rows == 3
    with pytest.raises(ValueError, match=r"the floor alone needs B \* f = 2 \* 2 = 4 rows but at most 3"):
        choose_budget(example_survival(), None, ScheduleConfig(gamma=2, min_verify_len=2), max_rows=3)
    with pytest.raises(ValueError, match="cost model max_rows=1"):
        choose_budget(example_survival(), SpsTable((1,), (10.0,), 1), cfg)


def test_empty_batch_plans_nothing() -> None:
    empty = torch.zeros((0, 3))
    cfg = ScheduleConfig(gamma=3)
    assert choose_budget(empty, EXAMPLE_SPS, cfg) == BudgetDecision(0, 0, 0.0, 0.001, 0.0)
    assert allocate_verify_lens(empty, 5, cfg).tolist() == []


def test_eps_drops_candidates_and_floor_drafts_count_whatever_their_value() -> None:
    survival = torch.tensor([[0.5, 0.2, 1e-3], [1e-4, 1e-5, 1e-6]])
    cfg = ScheduleConfig(gamma=3, min_verify_len=2, survival_eps=0.01)
    # Floor drafts: draft 1 of both requests (0.5 and 1e-4); candidates: only 0.2 survives eps.
    assert allocate_verify_lens(survival, 10, cfg).tolist() == [3, 2]
    decision = choose_budget(survival, None, cfg)
    assert (decision.budget, decision.num_rows) == (1, 5)
    assert decision.tau == pytest.approx(2 + 0.5 + 1e-4 + 0.2)


def test_cap_limits_candidates() -> None:
    survival = torch.ones((2, 4))
    assert allocate_verify_lens(survival, 100, ScheduleConfig(gamma=4, max_verify_len=3)).tolist() == [3, 3]
    assert allocate_verify_lens(survival, 3, ScheduleConfig(gamma=4)).tolist() == [3, 2]  # ties: position


def test_min_verify_len_zero_still_verifies_the_root() -> None:
    lens = allocate_verify_lens(torch.zeros((3, 2)), 0, ScheduleConfig(gamma=2, min_verify_len=0))
    assert lens.tolist() == [1, 1, 1]


def test_forced_budget_rounds_half_up_and_validates() -> None:
    survival = torch.tensor([[0.9, 0.5, 0.1]])  # 3 candidates
    cfg = ScheduleConfig(gamma=3)
    assert [forced_budget(survival, cfg, f) for f in (0.0, 0.5, 0.49, 1.0)] == [0, 2, 1, 3]
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\]"):
        forced_budget(survival, cfg, 1.5)


# --- validation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"gamma": 0}, "gamma must be >= 1"),
    ({"gamma": 3, "max_verify_len": 5}, r"max_verify_len must be in \[0, gamma \+ 1 = 4\]"),
    ({"gamma": 3, "min_verify_len": -1}, "min_verify_len must be >= 0"),
    ({"gamma": 3, "min_verify_len": 3, "max_verify_len": 2},
     "min_verify_len=3 exceeds the cap max_verify_len=2"),
    ({"gamma": 3, "min_verify_len": 5}, "min_verify_len=5 exceeds the cap max_verify_len=4"),
    ({"gamma": 3, "survival_eps": 1.0}, r"survival_eps must be in \[0, 1\)"),
    ({"gamma": 3, "survival_eps": -0.1}, r"survival_eps must be in \[0, 1\)"),
    ({"gamma": 2.0}, "gamma must be an integer"),
])
def test_schedule_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScheduleConfig(**kwargs)


def test_schedule_config_properties() -> None:
    cfg = ScheduleConfig(gamma=4)
    assert (cfg.num_draft_tokens, cfg.floor, cfg.cap) == (5, 1, 5)
    cfg = ScheduleConfig(gamma=4, min_verify_len=0, max_verify_len=3)
    assert (cfg.floor, cfg.cap) == (1, 3)
    assert ScheduleConfig(gamma=4, min_verify_len=3).floor == 3


def test_survival_from_logits_applies_temperatures_in_float32() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5]], dtype=torch.bfloat16)
    temps = [1.0, 2.0, 0.5]
    got = survival_from_logits(logits, temps)
    z = logits.float()[0]
    expected = torch.cumprod(torch.sigmoid(z / torch.tensor(temps)), dim=0)
    assert got.dtype == torch.float32 and torch.allclose(got[0], expected)
    assert torch.allclose(survival_from_logits(logits, torch.tensor(temps)), got)
    assert torch.allclose(survival_from_logits(logits), torch.cumprod(torch.sigmoid(z), 0)[None])


@pytest.mark.parametrize("temps, message", [
    ([1.0, 1.0], "2 temperatures but logits have gamma=3 positions"),
    ([1.0, 0.0, 1.0], "temperatures must all be finite and > 0"),
    ([1.0, float("inf"), 1.0], "temperatures must all be finite and > 0"),
])
def test_survival_from_logits_validates_temperatures(temps: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        survival_from_logits(torch.zeros((2, 3)), temps)


@pytest.mark.parametrize("survival, message", [
    (torch.ones((2, 3)), r"survival must be \[B, gamma=2\], got shape \(2, 3\)"),
    (torch.tensor([[0.5, 0.6]]), "non-increasing along positions .* request 0 rises from 0.5 at draft 1"),
    (torch.tensor([[1.5, 0.6]]), r"survival must be probabilities in \[0, 1\]"),
    (torch.tensor([[float("nan"), 0.6]]), r"survival must be probabilities in \[0, 1\]"),
    (torch.ones((1, 2), dtype=torch.int64), "survival must be a floating tensor"),
])
def test_planner_rejects_malformed_survival(survival: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        choose_budget(survival, None, ScheduleConfig(gamma=2))
    with pytest.raises(ValueError, match=message):
        allocate_verify_lens(survival, 1, ScheduleConfig(gamma=2))


def test_negative_budget_is_an_error() -> None:
    with pytest.raises(ValueError, match="budget must be >= 0 extra rows, got -1"):
        allocate_verify_lens(example_survival(), -1, ScheduleConfig(gamma=2))


# --- property tests against brute force -----------------------------------------------------------------

CONFIDENCE = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.floats(0.0, 1.0))


@st.composite
def schedules(draw: st.DrawFn) -> tuple[torch.Tensor, ScheduleConfig]:
    gamma = draw(st.integers(1, 5))
    num_reqs = draw(st.integers(1, 5))
    conf = draw(st.lists(st.lists(CONFIDENCE, min_size=gamma, max_size=gamma), min_size=num_reqs,
                         max_size=num_reqs))
    cap = draw(st.integers(0, gamma + 1))
    resolved_cap = cap or gamma + 1
    min_len = draw(st.integers(0, resolved_cap))
    eps = draw(st.sampled_from([0.0, 1e-6, 0.1, 0.4]))
    cfg = ScheduleConfig(gamma=gamma, min_verify_len=min_len, max_verify_len=cap, survival_eps=eps)
    return torch.cumprod(torch.tensor(conf, dtype=torch.float32), dim=1), cfg


def probes(draw: st.DrawFn, high: int) -> tuple[int, ...]:
    return tuple(sorted(draw(st.sets(st.integers(1, high), min_size=1, max_size=5))))


def draft_term(draw: st.DrawFn) -> dict:
    if not draw(st.booleans()):
        return {}
    bs = probes(draw, 6)
    # Tables are monotone (more work never costs less): sorted draws.
    seconds = sorted(draw(st.lists(st.floats(0.0, 0.01), min_size=len(bs), max_size=len(bs))))
    return {"draft_bs_probes": bs, "draft_seconds": tuple(seconds)}


@st.composite
def cost_models(draw: st.DrawFn) -> CostModel | None:
    kind = draw(st.sampled_from(["sps-1d", "additive", "none"]))
    if kind == "none":
        return None
    if kind == "sps-1d":
        tokens = probes(draw, 30)
        rates = sorted(draw(st.lists(st.floats(1.0, 1000.0), min_size=len(tokens), max_size=len(tokens))),
                       reverse=True)
        return SpsTable(tokens, tuple(rates), draw(st.integers(tokens[-1], 35)), **draft_term(draw))
    bs, ms = probes(draw, 6), probes(draw, 30)
    alpha = sorted(draw(st.lists(st.floats(0.0, 0.01), min_size=len(bs), max_size=len(bs))))
    theta = sorted(draw(st.lists(st.floats(0.0, 0.01), min_size=len(ms), max_size=len(ms))))
    bias = draw(st.floats(1e-4, 0.01))
    return AdditiveCostTable(bias, bs, tuple(alpha), ms, tuple(theta), **draft_term(draw))


def candidates(survival: torch.Tensor, cfg: ScheduleConfig) -> list[tuple[float, int, int]]:
    """(survival, 1-based draft, request) of every candidate, unsorted."""
    rows = survival.tolist()
    return [(rows[r][j - 1], j, r) for r in range(len(rows)) for j in range(cfg.floor, cfg.cap)
            if rows[r][j - 1] >= cfg.survival_eps]


def interp(x: float, xs: tuple[int, ...], ys: tuple[float, ...]) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = max(k for k in range(len(xs)) if xs[k] <= x)
    return ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])


def scalar_seconds(model: CostModel, num_reqs: int, num_rows: int) -> float:
    draft = interp(num_reqs, model.draft_bs_probes, model.draft_seconds) if model.draft_seconds else 0.0
    if isinstance(model, SpsTable):
        below = [i for i, m in enumerate(model.sample_batch_tokens) if m <= num_rows]
        return 1.0 / model.sample_steps_per_sec[below[-1] if below else 0] + draft
    return (model.bias_seconds + interp(num_reqs, model.bs_probes, model.alpha_seconds)
            + interp(num_rows, model.m_probes, model.theta_seconds) + draft)


def verified_tau(survival: torch.Tensor, lens: list[int]) -> float:
    rows = survival.tolist()
    return len(rows) + math.fsum(v for r, row in enumerate(rows) for v in row[: lens[r] - 1])


@given(schedules(), cost_models(), st.one_of(st.none(), st.integers(1, 35)))
@settings(max_examples=300, deadline=None)
def test_choose_budget_equals_an_exhaustive_scan(schedule, model: CostModel | None,
                                                 max_rows: int | None) -> None:
    survival, cfg = schedule
    num_reqs = survival.shape[0]
    values = sorted((v for v, _, _ in candidates(survival, cfg)), reverse=True)
    floor_sum = math.fsum(survival[:, : cfg.floor - 1].flatten().tolist())
    limits = [x for x in (max_rows, model.max_rows if model else None) if x is not None]
    limit = min(limits) if limits else None
    feasible = [b for b in range(len(values) + 1) if limit is None or num_reqs * cfg.floor + b <= limit]
    if not feasible:
        with pytest.raises(ValueError, match="the floor alone needs"):
            choose_budget(survival, model, cfg, max_rows)
        return
    decision = choose_budget(survival, model, cfg, max_rows)
    taus = {b: num_reqs + floor_sum + math.fsum(values[:b]) for b in feasible}
    if model is None:
        expected = feasible[-1]
        assert decision.objective is None and decision.predicted_step_seconds is None
    else:
        seconds = {b: scalar_seconds(model, num_reqs, num_reqs * cfg.floor + b) for b in feasible}
        objective = {b: taus[b] / seconds[b] for b in feasible}
        best = max(objective.values())
        # The first maximum, where objectives closer than the planner's tie tolerance are equal
        # (a numpy scan and a scalar scan may round differently in the last bits).
        expected = decision.budget
        assert expected in feasible and objective[expected] >= best * (1 - 1e-9)
        assert all(objective[b] < best * (1 - 0.5 * TIE_RTOL) for b in feasible if b < expected)
        assert decision.objective == pytest.approx(objective[expected], rel=1e-9)
        assert decision.predicted_step_seconds == pytest.approx(seconds[expected], rel=1e-9)
    assert decision.budget == expected
    assert decision.num_rows == num_reqs * cfg.floor + expected
    assert decision.tau == pytest.approx(taus[expected], rel=1e-9)


@given(schedules(), st.integers(0, 30))
@settings(max_examples=300, deadline=None)
def test_allocation_takes_the_best_candidates_by_the_tie_rule(schedule, budget: int) -> None:
    survival, cfg = schedule
    lens = allocate_verify_lens(survival, budget, cfg).tolist()
    assert all(cfg.floor <= length <= cfg.cap for length in lens)
    cands = candidates(survival, cfg)
    ranked = sorted(cands, key=lambda c: (-c[0], c[1], c[2]))[:budget]
    chosen = {(r, j) for r, length in enumerate(lens) for j in range(cfg.floor, length)}
    # The key-sorted top set is exactly what verify_lens encodes, so it is a prefix per request.
    assert chosen == {(r, j) for _, j, r in ranked}
    assert sum(lens) == survival.shape[0] * cfg.floor + min(budget, len(cands))
    if len(cands) <= 10:
        size = min(budget, len(cands))
        best = max(math.fsum(c[0] for c in subset) for subset in itertools.combinations(cands, size))
        assert math.fsum(v for v, j, r in cands if (r, j) in chosen) == pytest.approx(best, rel=1e-12, abs=0)


@given(schedules(), cost_models(), st.one_of(st.none(), st.integers(1, 35)))
@settings(max_examples=200, deadline=None)
def test_decision_rows_and_tau_match_the_allocated_rows(schedule, model: CostModel | None,
                                                        max_rows: int | None) -> None:
    survival, cfg = schedule
    try:
        decision = choose_budget(survival, model, cfg, max_rows)
    except ValueError:
        assume(False)
    lens = allocate_verify_lens(survival, decision.budget, cfg).tolist()
    assert sum(lens) == decision.num_rows
    assert decision.tau == pytest.approx(verified_tau(survival, lens), rel=1e-9)
    assert forced_budget(survival, cfg, 1.0) >= decision.budget


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_results_stay_on_the_input_device() -> None:
    survival = example_survival().cuda()
    assert allocate_verify_lens(survival, 2, ScheduleConfig(gamma=2)).device == survival.device
    assert choose_budget(survival, EXAMPLE_SPS, ScheduleConfig(gamma=2)).budget == 2
    lagged = LaggedSurvival(1, 2)
    lagged.record([0, 1], [0, 0], survival)
    out = lagged.lagged([1, 2], [0, 0], survival)
    assert out.device == survival.device and out.cpu().tolist() == [survival[1].cpu().tolist(), [1.0, 1.0]]


# --- lagged survival ------------------------------------------------------------------------------------


def step_survival(step: int) -> torch.Tensor:
    # Distinct per step and per row so the test can tell which step a value came from.
    return torch.tensor([[0.9 - 0.1 * step, 0.05], [0.8 - 0.1 * step, 0.04]])


def test_lag_zero_passes_the_current_survival_through() -> None:
    lagged = LaggedSurvival(0, 2)
    current = step_survival(0)
    lagged.record([3, 4], [0, 0], current)
    assert lagged.lagged([3, 4], [0, 0], current) is current


def test_lag_two_returns_the_survival_recorded_two_steps_ago() -> None:
    lagged = LaggedSurvival(2, 2)
    slots, gens = [3, 4], [7, 7]
    for step in range(5):
        current = step_survival(step)
        got = lagged.lagged(slots, gens, current)
        expected = torch.ones((2, 2)) if step < 2 else step_survival(step - 2)
        assert torch.equal(got, expected), step
        lagged.record(slots, gens, current)


def test_rows_follow_the_slot_not_the_batch_position() -> None:
    lagged = LaggedSurvival(1, 2)
    lagged.record([3, 4], [0, 0], step_survival(0))
    got = lagged.lagged([4, 3], [0, 0], torch.zeros((2, 2)))
    assert torch.equal(got, step_survival(0).flip(0))


def test_reused_slot_and_new_slot_fall_back_to_survival_one() -> None:
    lagged = LaggedSurvival(1, 2)
    lagged.record([3, 4], [0, 0], step_survival(0))
    # Slot 4 was freed and reused by a new request (generation 1); slot 9 is new.
    got = lagged.lagged([3, 4, 9], [0, 1, 0], torch.zeros((3, 2)))
    assert got.tolist() == [step_survival(0)[0].tolist(), [1.0, 1.0], [1.0, 1.0]]
    none_known = lagged.lagged([8, 9], [0, 0], torch.zeros((2, 2)))
    assert none_known.tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_recorded_survival_is_a_copy() -> None:
    lagged = LaggedSurvival(1, 2)
    buffer = step_survival(0)
    lagged.record([0, 1], [0, 0], buffer)
    buffer.zero_()
    assert torch.equal(lagged.lagged([0, 1], [0, 0], buffer), step_survival(0))


@pytest.mark.parametrize("call, message", [
    (lambda s: s.record([0], [0], torch.ones((2, 2))), "record: got 1 slots and 1 generations for 2"),
    (lambda s: s.record([0, 0], [0, 1], torch.ones((2, 2))), "record: a slot appears twice"),
    (lambda s: s.lagged([0], [0], torch.ones((1, 3))), r"lagged: survival must be \[B, gamma=2\]"),
    (lambda s: LaggedSurvival(-1, 2), "lag_steps must be >= 0"),
])
def test_lagged_survival_validation(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(LaggedSurvival(1, 2))


# --- tier table --------------------------------------------------------------------------------------------

# Two requests (base M = 2); ranked candidates 0.9, 0.85, 0.6, 0.2, 0.1, 0.05, 0.04, 0.01.
TIER_SURVIVAL = torch.tensor([[0.9, 0.6, 0.1, 0.05], [0.85, 0.2, 0.04, 0.01]], dtype=torch.float64)
# Rows 1..4 replay the 4-row graph (1 ms), rows 5..8 the 8-row graph (1.6 ms).
TIERS_4_8 = TierCostTable(tiers=(4, 8), bs_probes=(1,), step_seconds=((0.001, 0.0016),))


def test_tier_table_fills_a_tier_instead_of_spilling_one_row_into_the_next() -> None:
    cfg = ScheduleConfig(gamma=4)
    decision = choose_budget(TIER_SURVIVAL, TIERS_4_8, cfg)
    # M=4: tau 3.75 in 1 ms. M=3 costs the same with less tau; M=5 adds 0.2 but pays the 8-row graph.
    assert (decision.budget, decision.num_rows) == (2, 4)
    assert decision.predicted_step_seconds == 0.001
    assert decision.objective == pytest.approx(3750.0)
    assert 4.35 / 0.0016 < 3750.0 and 4.70 / 0.0016 < 3750.0
    # The same two points as an additive table blend the cliff (M=5 looks like 1.15 ms) and spill.
    smooth = AdditiveCostTable(0.0, (1,), (0.0,), (4, 8), (0.001, 0.0016))
    assert choose_budget(TIER_SURVIVAL, smooth, cfg).num_rows == 5


def test_tier_table_limits_rows_to_the_last_tier() -> None:
    cfg = ScheduleConfig(gamma=4)
    everything = torch.ones(2, 4, dtype=torch.float64)  # would verify all 10 rows if it could
    decision = choose_budget(everything, TIERS_4_8, cfg)
    assert decision.num_rows == 8 and decision.predicted_step_seconds == 0.0016
    with pytest.raises(ValueError, match=r"the floor alone needs B \* f = 3 \* 3 = 9 rows but at most 8"):
        choose_budget(torch.ones(3, 4, dtype=torch.float64), TIERS_4_8,
                      ScheduleConfig(gamma=4, min_verify_len=3))


def test_tier_table_adds_its_draft_term() -> None:
    with_draft = TierCostTable((4, 8), (1,), ((0.001, 0.0016),), draft_bs_probes=(1,), draft_seconds=(0.004,))
    decision = choose_budget(TIER_SURVIVAL, with_draft, ScheduleConfig(gamma=4))
    # 4.70 / 5.6 ms beats 3.75 / 5 ms once the draft's 4 ms is paid either way.
    assert (decision.num_rows, decision.predicted_step_seconds) == (8, pytest.approx(0.0056))


@st.composite
def tier_models(draw: st.DrawFn) -> TierCostTable:
    tiers, bs = probes(draw, 30), probes(draw, 6)
    drawn = [draw(st.lists(st.floats(1e-4, 0.01), min_size=len(tiers), max_size=len(tiers))) for _ in bs]
    # Monotone along tiers and along B (a table file refuses less time for more work): running maxima.
    rows = [list(itertools.accumulate(row, max)) for row in drawn]
    seconds = [tuple(max(rows[k][j] for k in range(i + 1)) for j in range(len(tiers)))
               for i in range(len(bs))]
    return TierCostTable(tiers, bs, tuple(seconds), **draft_term(draw))


def scalar_tier_seconds(model: TierCostTable, num_reqs: int, num_rows: int) -> float:
    tier = min(j for j, t in enumerate(model.tiers) if t >= num_rows)
    column = tuple(row[tier] for row in model.step_seconds)
    draft = interp(num_reqs, model.draft_bs_probes, model.draft_seconds) if model.draft_seconds else 0.0
    return interp(num_reqs, model.bs_probes, column) + draft


@given(schedules(), tier_models(), st.one_of(st.none(), st.integers(1, 35)))
@settings(max_examples=200, deadline=None)
def test_choose_budget_with_a_tier_table_equals_an_exhaustive_scan(schedule, model: TierCostTable,
                                                                   max_rows: int | None) -> None:
    survival, cfg = schedule
    num_reqs = survival.shape[0]
    values = sorted((v for v, _, _ in candidates(survival, cfg)), reverse=True)
    floor_sum = math.fsum(survival[:, : cfg.floor - 1].flatten().tolist())
    limit = min(x for x in (max_rows, model.tiers[-1]) if x is not None)
    feasible = [b for b in range(len(values) + 1) if num_reqs * cfg.floor + b <= limit]
    if not feasible:
        with pytest.raises(ValueError, match="the floor alone needs"):
            choose_budget(survival, model, cfg, max_rows)
        return
    decision = choose_budget(survival, model, cfg, max_rows)
    objective = {b: (num_reqs + floor_sum + math.fsum(values[:b]))
                 / scalar_tier_seconds(model, num_reqs, num_reqs * cfg.floor + b) for b in feasible}
    best = max(objective.values())
    assert decision.budget in feasible and objective[decision.budget] >= best * (1 - 1e-9)
    assert all(objective[b] < best * (1 - 0.5 * TIE_RTOL) for b in feasible if b < decision.budget)
