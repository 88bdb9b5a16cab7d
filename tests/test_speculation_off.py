"""The planner's off state: the decode term of a cost table, the switch's hysteresis and probes, and
greedy output equal to target-only whatever the switch does (docs/planner.md, "Speculation off")."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from dspark.formats.cost_tables import CostTableError, cost_table_from_json, cost_table_json
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package
from dspark.runtime.planner.cost_models import AdditiveCostTable, CostModelError, cost_model_from_dict
from dspark.runtime.planner.switch import NO_PREDICTION, Prediction, SpeculationSwitch, SwitchConfig, combine

from .runtime_helpers import REPO, compile_variant
from .test_runtime_lossless import _prompts

TABLE = {"bias_seconds": 0.004, "bs_probes": [1, 32], "alpha_seconds": [0.0, 0.004],
         "m_probes": [1, 256], "theta_seconds": [0.0, 0.02],
         "draft_bs_probes": [1, 32], "draft_seconds": [0.003, 0.015],
         "decode_bs_probes": [1, 32], "decode_seconds": [0.004, 0.008]}


def test_the_decode_term_is_read_priced_and_written_back() -> None:
    table = cost_model_from_dict(TABLE, "t")
    assert table.prices_decode
    assert table.decode_time(1) == pytest.approx(0.004)
    assert table.decode_time(32) == pytest.approx(0.008)
    assert table.decode_time(64) == pytest.approx(0.008)  # clamped at the last probe, as the draft term
    assert cost_table_json(table.to_format())["decode_seconds"] == [0.004, 0.008]
    without = {k: v for k, v in TABLE.items() if not k.startswith("decode")}
    plain = cost_model_from_dict(without, "t")
    assert not plain.prices_decode and "decode_seconds" not in cost_table_json(plain.to_format())
    with pytest.raises(CostModelError, match="no decode term"):
        plain.decode_time(4)


@pytest.mark.parametrize(("change", "message"), [
    ({"decode_seconds": [0.004, 0.003]}, "decode_seconds must not decrease"),
    ({"decode_seconds": [0.0, 0.003]}, "decode_seconds: decode times must be > 0"),
    ({"decode_bs_probes": []}, "decode_seconds: has 2 entries but decode_bs_probes has 0"),
    ({"decode_seconds": None}, "decode_bs_probes is given but decode_seconds is empty"),
    ({"decode_bs_probes": [4, 2]}, "decode_bs_probes"),
    ({"decode_seconds": [0.004]}, "decode_seconds"),
])
def test_a_malformed_decode_term_is_refused_by_name(change: dict[str, object], message: str) -> None:
    with pytest.raises(CostTableError, match=message):
        table = {k: v for k, v in {**TABLE, **change}.items() if v is not None}
        cost_table_from_json(table, "tables/x.json")


def _switch(**config: int | float) -> SpeculationSwitch:
    table = AdditiveCostTable(**TABLE)
    return SpeculationSwitch(table, SwitchConfig(**config), cap=8, max_rows=256,
                             decode_time=table.decode_time)


def _on(switch: SpeculationSwitch, rate_ratio: float, num_reqs: int = 8) -> bool:
    """A step whose predicted speculative rate is `rate_ratio` times the target-only one."""
    return switch.speculates(Prediction(num_reqs, rate_ratio * num_reqs, 1.0, 1.0))


def test_the_switch_turns_off_only_after_patience_steps_beyond_the_margin() -> None:
    switch = _switch(margin=0.1, patience=3, probe_every=100)
    assert [_on(switch, 0.95) for _ in range(5)] == [True] * 5  # within the margin: stays on
    assert [_on(switch, 0.5), _on(switch, 0.5), _on(switch, 1.2)] == [True] * 3  # a streak broken
    assert [_on(switch, 0.5) for _ in range(3)] == [True, True, False]
    assert not switch.speculating
    assert [_on(switch, 1.05) for _ in range(4)] == [False] * 4  # within the margin: stays off
    assert [_on(switch, 2.0) for _ in range(3)] == [False, False, True]
    assert switch.speculating


def test_while_off_every_probe_every_th_step_is_drafted() -> None:
    switch = _switch(margin=0.0, patience=1, probe_every=4)
    assert not _on(switch, 0.5)  # the first step off
    decisions = [_on(switch, 0.5) for _ in range(11)]
    assert decisions == [False, False, True] + [False, False, False, True] * 2
    assert not switch.speculating  # a probe does not switch speculation on by itself


def test_an_idle_step_leaves_the_state_alone() -> None:
    switch = _switch(margin=0.0, patience=1, probe_every=100)
    assert not _on(switch, 0.5)
    assert switch.speculates(NO_PREDICTION) is False and not switch.speculating


def test_the_prediction_is_what_the_requests_committed_at_the_last_rows() -> None:
    switch = _switch()
    first = switch.predict([(0, 0), (1, 0), (2, 0), (3, 0)])
    assert first.on_rate == float("inf")  # nothing drafted yet: speculate
    switch.observe([(0, 0), (1, 0)], [2, 4], rows=8)
    table = AdditiveCostTable(**TABLE)
    p = switch.predict([(0, 0), (1, 0), (2, 0), (3, 0)])
    # request 0: (2 + 2 x 3) / 3, request 1: (4 + 2 x 3) / 3, the others the batch's mean 3
    assert p.tau == pytest.approx(8 / 3 + 10 / 3 + 3 + 3)
    assert p.on_seconds == pytest.approx(table.step_time(4, 16) + table.draft_time(4))  # 4 rows each
    assert p.off_seconds == pytest.approx(table.decode_time(4))
    assert switch.predict([]) == NO_PREDICTION
    # a slow request's own history outweighs the batch's as its drafted steps add up
    for _ in range(10):
        switch.observe([(1, 0)], [1], rows=8)
    assert switch.predict([(1, 0)]).tau == pytest.approx((14 + 2 * 16 / 12) / 13)
    assert switch.predict([(1, 1)]).tau == pytest.approx(16 / 12)  # a slot's next request: the batch's mean


def test_dp_ranks_combine_tokens_and_take_the_slowest_step() -> None:
    got = combine([Prediction(2, 6.0, 0.01, 0.004), NO_PREDICTION, Prediction(3, 9.0, 0.02, 0.003)])
    assert got == Prediction(5, 15.0, 0.02, 0.004)


class ScriptedSwitch:
    """A switch whose decisions follow a fixed pattern (on, off, probe), to check that any sequence of
    states decodes exactly as target-only."""

    def __init__(self, pattern: list[bool]) -> None:
        self.decisions = itertools.cycle(pattern)
        self.speculating = True
        self.probing = False
        self.observed = 0

    def predict(self, requests: list[tuple[int, int]], offset_seconds: float = 0.0,
                context_len: float | None = None) -> Prediction:
        return Prediction(len(requests), 1.0, 1.0, 1.0)

    def decode_seconds(self, num_reqs: int, context_len: float | None = None) -> float:
        return 1.0

    def speculates(self, prediction: Prediction) -> bool:
        self.speculating = next(self.decisions)
        return self.speculating

    def observe(self, requests: list[tuple[int, int]], committed: list[int], rows: int) -> None:
        self.observed += 1


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("off")
    # a decode step this cheap always wins: the switch goes off as soon as its patience allows
    common = {"cost_model": {**TABLE, "file": None, "decode_seconds": [1e-5, 2e-5]},
              "calibration": {"file": str(REPO / "specs" / "tables" / "tiny_cpu" / "sts.json")},
              "serving": {"max_running_requests": 4}}
    auto = compile_variant(tmp, "tiny_cpu_compact.yaml",
                           {**common, "verify": {"off": "auto", "off_patience": 2, "probe_every": 5}},
                           "off_auto")
    never = compile_variant(tmp, "tiny_cpu_compact.yaml", {**common, "verify": {"off": "never"}},
                            "off_never")
    return auto, never


@pytest.mark.slow
def test_greedy_output_equals_target_only_through_every_switch(packages: tuple[Path, Path]) -> None:
    auto, never = packages
    runtime = Runtime(load_package(auto))
    prompts = _prompts(runtime.package.tokenizer)
    expected, _ = runtime.generate(prompts, 48, target_only=True)
    # the planner's own switch: a decode step this cheap wins, so it goes off after 2 steps and probes
    outputs, stats = runtime.generate(prompts, 48)
    assert outputs == expected
    assert stats.off_steps > 0 and stats.switches >= 1 and stats.planned_steps >= 2
    assert stats.off_steps + stats.planned_steps == stats.steps
    assert stats.on_seconds + stats.off_seconds == pytest.approx(stats.decode_seconds)
    # any sequence of states, probes included
    for pattern in ([True, False], [False, False, True], [True, True, False, False, False]):
        runtime.switch = switch = ScriptedSwitch(pattern)  # type: ignore[assignment]
        runtime.reset_switch = lambda: None  # type: ignore[method-assign]
        outputs, stats = runtime.generate(prompts, 48)
        assert outputs == expected, pattern
        assert stats.off_steps > 0 and switch.observed == stats.planned_steps > 0
    # pinned on: no step without speculation
    pinned = Runtime(load_package(never))
    assert pinned.switch is None
    outputs, stats = pinned.generate(prompts, 48)
    assert outputs == expected and stats.off_steps == 0
