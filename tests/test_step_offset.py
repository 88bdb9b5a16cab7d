"""The measured step offset: the fixed part of what a step costs here beyond its table price, added to
every price the planner weighs (dspark.runtime.planner.step_offset)."""

import numpy as np
import pytest
import torch

from dspark.runtime.planner.budget import ScheduleConfig, choose_budget
from dspark.runtime.planner.cost_models import AdditiveCostTable, SpsTable
from dspark.runtime.planner.step_offset import SLOPE_RANGE, StepOffset, robust_line
from dspark.runtime.planner.switch import SpeculationSwitch, SwitchConfig


def _fed(offset: StepOffset, priced: list[float], measured: list[float]) -> StepOffset:
    for p, m in zip(priced, measured, strict=True):
        offset.observe(p, m)
    return offset


PRICES = [0.010, 0.020, 0.030, 0.040] * 4  # steps of four shapes, as a planner's budgets and batches vary


def test_a_fixed_excess_is_the_offset_and_a_proportional_one_is_none() -> None:
    fixed = _fed(StepOffset(window=16, refit_every=1), PRICES, [p + 0.02 for p in PRICES])
    assert fixed.seconds == pytest.approx(0.02) and fixed.slope == pytest.approx(1.0)
    # a machine 1.6x slower than the table's: every price scales alike, nothing to add
    scaled = _fed(StepOffset(window=16, refit_every=1), PRICES, [1.6 * p for p in PRICES])
    assert scaled.seconds == pytest.approx(0.0, abs=1e-12) and scaled.slope == pytest.approx(1.6)
    # both: the fixed part in the table's units (weighing a * cost + b picks what cost + b / a does)
    both = _fed(StepOffset(window=16, refit_every=1), PRICES, [2.0 * p + 0.01 for p in PRICES])
    assert both.seconds == pytest.approx(0.005) and both.slope == pytest.approx(2.0)


def test_rows_dearer_than_the_table_clip_at_zero_and_free_rows_read_as_all_fixed() -> None:
    dearer = _fed(StepOffset(window=16, refit_every=1), PRICES, [2.2 * p - 0.005 for p in PRICES])
    assert dearer.seconds == 0.0  # the table's own choice stands
    # more rows cost nothing measurable
    flat = _fed(StepOffset(window=16, refit_every=1), PRICES, [0.09] * len(PRICES))
    assert flat.slope == pytest.approx(SLOPE_RANGE[0])
    assert flat.seconds == pytest.approx((0.09 - 0.1 * 0.025) / 0.1)  # intercept at the median price


def test_the_fit_is_robust_waits_for_pairs_holds_on_one_shape_and_forgets() -> None:
    offset = StepOffset(window=16, min_samples=3, refit_every=1)
    offset.observe(0.010, 0.030)
    offset.observe(0.020, 0.040)
    assert offset.seconds == 0.0  # two steps: fewer than min_samples on each side
    _fed(offset, PRICES, [p + 0.02 for p in PRICES])
    assert offset.seconds == pytest.approx(0.02)
    offset.observe(0.020, 1.0)  # one stalled step moves a median little
    assert offset.seconds == pytest.approx(0.02, abs=0.002)
    for _ in range(16):  # every step one shape: a fixed excess cannot be told from a proportional one
        offset.observe(0.030, 0.050)
    assert robust_line(np.full(16, 0.030), np.full(16, 0.050), 1) is None
    assert robust_line(np.array([0.02] + [0.03] * 15), np.array([1.0] + [0.05] * 15), 1) is None
    assert offset.seconds == pytest.approx(0.02, abs=0.002)  # the last estimate is held
    _fed(offset, PRICES, [1.5 * p for p in PRICES])  # the window forgets what it held
    assert offset.seconds == pytest.approx(0.0, abs=1e-12)
    offset.observe(None, 5.0)  # an unpriced step is not evidence
    assert offset.samples == 2 + 16 + 1 + 16 + 16


def test_the_fit_runs_every_refit_every_steps() -> None:
    offset = StepOffset(window=16, refit_every=8)
    _fed(offset, PRICES[:15], [p + 0.02 for p in PRICES[:15]])
    assert offset.seconds == 0.0  # one fit at step 8: too few steps on each side of the prices then
    offset.observe(PRICES[15], PRICES[15] + 0.02)
    assert offset.seconds == pytest.approx(0.02)  # the fit at step 16
    with pytest.raises(ValueError, match="refit_every"):
        StepOffset(refit_every=0)


def test_robust_line_needs_prices_apart() -> None:
    same = np.full(10, 0.02)
    assert robust_line(same, same * 2, 1) is None
    assert robust_line(np.array([0.02]), np.array([0.03]), 1) is None
    assert robust_line(np.array([0.01, 0.02, 0.04, 0.05]), np.array([0.03, 0.05, 0.09, 0.11]), 3) is None
    slope, intercept = robust_line(np.array([0.01, 0.02, 0.04, 0.05]), np.array([0.03, 0.05, 0.09, 0.11]), 2)
    assert slope == pytest.approx(2.0) and intercept == pytest.approx(0.01)


def test_window_zero_turns_the_offset_off_and_bad_settings_are_refused() -> None:
    offset = StepOffset(window=0)
    for _ in range(20):
        offset.observe(0.01, 0.5)
    assert offset.seconds == 0.0 and offset.samples == 0
    with pytest.raises(ValueError, match="window must be >= 0"):
        StepOffset(window=-1)


def test_a_fixed_cost_per_step_raises_the_budget_it_amortises() -> None:
    survival = torch.tensor([[0.5]])
    cfg = ScheduleConfig(gamma=1)
    table = SpsTable((1, 2), (1000.0, 600.0), 2)
    assert choose_budget(survival, table, cfg).budget == 0  # 1 * 1000 beats 1.5 * 600
    decision = choose_budget(survival, table, cfg, offset_seconds=0.002)
    assert decision.budget == 1  # 1.5 / (1/600 + 0.002) beats 1 / (0.001 + 0.002)
    assert decision.predicted_step_seconds == pytest.approx(1 / 600 + 0.002)
    additive = AdditiveCostTable(0.0, (1,), (0.0,), (1, 2), (0.001, 1 / 600))
    assert choose_budget(survival, additive, cfg).budget == 0
    assert choose_budget(survival, additive, cfg, offset_seconds=0.002).budget == 1
    with pytest.raises(ValueError, match="offset_seconds must be >= 0"):
        choose_budget(survival, table, cfg, offset_seconds=-0.001)


def test_the_off_state_prices_both_states_with_the_offset() -> None:
    table = AdditiveCostTable(0.0, (1, 8), (0.0, 0.0), (1, 64), (0.001, 0.010),
                              decode_bs_probes=(1, 8), decode_seconds=(0.0005, 0.001))
    switch = SpeculationSwitch(table, SwitchConfig(), cap=8, max_rows=None, decode_time=table.decode_time)
    switch.observe([(0, 0), (1, 0)], [3, 3], rows=16)
    plain, offset = switch.predict([(0, 0), (1, 0)]), switch.predict([(0, 0), (1, 0)], 0.05)
    assert offset.on_seconds == pytest.approx(plain.on_seconds + 0.05)
    assert offset.off_seconds == pytest.approx(plain.off_seconds + 0.05)
    # a step that costs the same whatever it runs favours the state committing more tokens per step
    assert plain.off_rate > plain.on_rate and offset.on_rate > offset.off_rate


def test_the_engine_measures_every_priced_step_and_stays_lossless() -> None:
    from pathlib import Path

    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import load_package

    pkg = load_package(Path(__file__).resolve().parents[1] / "generated" / "tiny_cpu_compact")
    prompts = [pkg.tokenizer.encode(text) for text in ("def main(", "import os\nimport sys\n", "class A:")]
    runtime = Runtime(pkg)
    expected, _ = runtime.generate(prompts, 24, target_only=True)
    got, stats = runtime.generate(prompts, 24)
    assert got == expected
    offset = runtime.speculative.offset
    assert offset.window == 64 and offset.samples == stats.steps and offset.seconds >= 0.0
