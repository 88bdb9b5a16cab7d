"""The measured step offset: what a step costs here beyond its table price, added to every price the
planner weighs (dspark.runtime.planner.step_offset)."""

import pytest
import torch

from dspark.runtime.planner.budget import ScheduleConfig, choose_budget
from dspark.runtime.planner.cost_models import AdditiveCostTable, SpsTable
from dspark.runtime.planner.step_offset import StepOffset
from dspark.runtime.planner.switch import SpeculationSwitch, SwitchConfig


def test_offset_is_the_running_median_excess_clipped_at_zero() -> None:
    offset = StepOffset(window=4, min_samples=3)
    offset.observe(0.010, 0.030)
    offset.observe(0.010, 0.040)
    assert offset.seconds == 0.0  # fewer than min_samples steps seen
    offset.observe(0.010, 0.020)
    assert offset.seconds == pytest.approx(0.020)  # median of 0.02, 0.03, 0.01
    offset.observe(0.010, 1.0)  # one stalled step moves a median little
    assert offset.seconds == pytest.approx(0.025)
    for _ in range(4):  # the window forgets: a table faster than the machine is never a negative offset
        offset.observe(0.010, 0.005)
    assert offset.seconds == 0.0
    offset.observe(None, 5.0)  # an unpriced step is not evidence
    assert offset.seconds == 0.0 and offset.samples == 8


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
