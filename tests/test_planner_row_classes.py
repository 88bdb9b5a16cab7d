"""Plans that keep a packed step's greedy requests in one query-block class of the CPU attention.

The torch attention runs a step's requests in blocks by how many product tiles their (row, query head)
pairs fill, one attention call per block per layer; a step across two classes pays a call more than
its rows say (benchmarks/verify_step_layouts.py). `AdaptiveVerifyPlan.row_classes` raises the greedy
requests below the step's widest class into it; sampled requests keep their rows (their exactness,
in steps mixing them with raised greedy requests, is tested with random classes in
tests/test_planner_sampled.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark.modes import VerifyMode
from dspark.runtime.attention.metadata import block_class, row_class_bounds
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package
from dspark.runtime.planner.survival import LaggedSurvival
from dspark.runtime.planner.verify_plan import AdaptiveVerifyPlan, one_row_class
from dspark.simulate.config import simulation_setup

from .runtime_helpers import REPO

COMPACT = REPO / "generated" / "tiny_cpu_compact"


@pytest.mark.parametrize(("max_rows", "group", "bounds"), [
    (8, 4, (4, 8)), (8, 1, (8,)), (8, 2, (8,)), (8, 16, (1, 2, 4, 8)), (16, 4, (4, 8, 16)), (3, 4, (3,)),
])
def test_the_bounds_are_where_the_block_class_changes(max_rows: int, group: int,
                                                      bounds: tuple[int, ...]) -> None:
    assert row_class_bounds(max_rows, group) == bounds
    classes = [block_class(rows, group) for rows in range(1, max_rows + 1)]
    assert len(set(classes)) == len(bounds)
    # the class changes right after each bound (below max_rows) and nowhere else
    changes = tuple(rows for rows in range(1, max_rows) if classes[rows] != classes[rows - 1])
    assert changes == bounds[:-1] and bounds[-1] == max_rows
    for low, high in zip((0, *bounds[:-1]), bounds, strict=True):  # constant within (low, high]
        assert len({classes[rows - 1] for rows in range(low + 1, high + 1)}) == 1


def test_greedy_requests_join_the_widest_class_and_sampled_ones_keep_their_rows() -> None:
    assert one_row_class((8, 3, 1, 6), (4, 8), (), 8) == (8, 5, 5, 6)
    assert one_row_class((8, 3, 1, 6), (4, 8), (False, True, False, False), 8) == (8, 3, 5, 6)
    assert one_row_class((3, 1, 4), (4, 8), (), 8) == (3, 1, 4)  # one class already
    assert one_row_class((6, 2), (4, 8), (), 5) == (6, 5)  # never past the cap
    assert one_row_class((16, 2, 6), (1, 2, 4, 8, 16), (), 16) == (16, 9, 9)
    assert one_row_class((), (4, 8), (), 8) == ()


def _plan(row_classes: tuple[int, ...], logits: torch.Tensor, tiers: tuple[int, ...] = ()) -> tuple[int, ...]:
    plan = AdaptiveVerifyPlan(gamma=7, mode=VerifyMode.COMPACT, row_classes=row_classes, token_tiers=tiers,
                              forced_budget_fraction=1.0, survival_eps=0.01)
    num_reqs = logits.shape[0]
    return plan.plan_step(logits, num_reqs, list(range(num_reqs)), [0] * num_reqs,
                          LaggedSurvival(plan.history_lag(), plan.gamma)).verify_lens


def test_a_plan_across_classes_raises_its_short_greedy_requests() -> None:
    sure, unsure = torch.full((1, 7), 6.0), torch.full((1, 7), -6.0)
    logits = torch.cat((sure, sure, unsure, unsure))  # every candidate: only the sure requests have any
    assert _plan((), logits) == (8, 8, 1, 1)
    assert _plan((4, 8), logits) == (8, 8, 5, 5)
    # a step padded to a graph tier pays for the tier's rows: its plan is left to tier alignment
    assert _plan((4, 8), logits, tiers=(16, 32)) == (8, 8, 1, 1)


def test_the_cpu_runtime_plans_with_the_attentions_classes_and_the_simulation_without() -> None:
    package = load_package(Path(COMPACT))
    assert Runtime(package).plan.row_classes == (4, 8)  # 8 query heads over 2 KV heads: 4-row tiles
    assert package.plan.row_classes == ()  # the generated plan itself is backend-neutral
    # a table prices rows alone, so a simulation could not see what the rule saves
    assert simulation_setup(package, None).plan.row_classes == ()


def test_a_step_raised_into_one_class_is_priced_at_the_rows_it_runs() -> None:
    """The step's price (what the measured step time is compared with: the step offset, the online cost refit,
    the step records) is the table's price of the rows that run, not of the budget before the raise."""
    table = {"type": "additive", "bias_seconds": 0.01, "bs_probes": [1, 8], "alpha_seconds": [0.0, 0.004],
             "m_probes": [1, 64], "theta_seconds": [0.0, 0.0315]}
    plan = AdaptiveVerifyPlan(gamma=7, mode=VerifyMode.COMPACT, row_classes=(4, 8), cost_model=table,
                              survival_eps=0.01)
    sure, unsure = torch.full((1, 7), 6.0), torch.full((1, 7), -6.0)
    step = plan.plan_step(torch.cat((sure, sure, unsure, unsure)), 4, [0, 1, 2, 3], [0] * 4,
                          LaggedSurvival(plan.history_lag(), plan.gamma), offset_seconds=0.002)
    assert step.decision is not None and step.step_seconds is not None
    assert step.verify_lens == (8, 8, 5, 5) and step.decision.num_rows == 18
    assert step.step_seconds == pytest.approx(plan.table.step_time(4, 26) + 0.002)
    assert step.decision.predicted_step_seconds == pytest.approx(plan.table.step_time(4, 18) + 0.002)
    unraised = AdaptiveVerifyPlan(gamma=7, mode=VerifyMode.COMPACT, cost_model=table, survival_eps=0.01)
    same = unraised.plan_step(torch.cat((sure, sure, unsure, unsure)), 4, [0, 1, 2, 3], [0] * 4,
                              LaggedSurvival(plan.history_lag(), plan.gamma), offset_seconds=0.002)
    assert same.verify_lens == (8, 8, 1, 1)
    assert same.step_seconds == same.decision.predicted_step_seconds  # type: ignore[union-attr]
