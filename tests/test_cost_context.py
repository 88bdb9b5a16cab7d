"""The additive table's context term (issue 25): the format's rules, the table at a context (interpolated
between the profiled ones, extrapolated beyond them), the planner pricing a step at its batch's context, the
step record carrying that context, the report's step time by context, and `dspark profile --context-len`
with several lengths."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from dspark.cli.main import main
from dspark.formats.cost_tables import CostTableError, cost_table_from_json, cost_table_json
from dspark.formats.step_records import StepRecordError, StepRing, read_steps
from dspark.report.cost import step_time_by_context
from dspark.runtime.planner.cost_models import AdditiveCostTable, cost_model_from_format, load_cost_model

from .runtime_helpers import compile_variant

BASE = {"bias_seconds": 0.004, "bs_probes": [1, 8], "alpha_seconds": [0.0, 0.002], "m_probes": [1, 64],
        "theta_seconds": [0.0, 0.006], "decode_bs_probes": [1, 8], "decode_seconds": [0.003, 0.005]}
CONTEXT = {"context_len": 128, "context_lens": [512, 896], "context_bias_seconds": [0.005, 0.006],
           "context_alpha_seconds": [[0.0, 0.004], [0.0, 0.008]],
           "context_theta_seconds": [[0.0, 0.010], [0.0, 0.014]],
           "context_decode_seconds": [[0.004, 0.008], [0.005, 0.011]]}


def table(**changes: object) -> AdditiveCostTable:
    return cost_model_from_format(cost_table_from_json({**BASE, **CONTEXT, **changes}, "t.json"))


def test_the_table_at_a_context_is_interpolated_between_the_profiled_ones() -> None:
    t = table()
    assert t.at_context(128).step_time(8, 64) == pytest.approx(0.004 + 0.002 + 0.006)
    assert t.at_context(512).step_time(8, 64) == pytest.approx(0.005 + 0.004 + 0.010)
    assert t.at_context(320).step_time(8, 64) == pytest.approx((0.012 + 0.019) / 2)  # halfway
    assert t.at_context(40).step_time(8, 64) == pytest.approx(0.012)  # below the first: the first
    assert t.at_context(320).decode_time(8) == pytest.approx(0.0065)
    beyond = t.at_context(1280)  # extrapolated from the last two, never cheaper than the last
    assert beyond.step_time(8, 64) == pytest.approx(0.006 + 0.008 + 0.014 + (0.028 - 0.019))
    assert t.at_context(320) is t.at_context(321)  # remembered per quantum of 16 tokens
    plain = cost_model_from_format(cost_table_from_json(BASE, "plain.json"))
    assert plain.at_context(900) is plain  # no context term: one price whatever the context


def test_the_file_keeps_the_context_term_and_a_table_without_one_writes_none() -> None:
    t = cost_table_from_json({**BASE, **CONTEXT}, "t.json")
    assert cost_table_from_json(cost_table_json(t), "again") == t
    assert not [key for key in cost_table_json(cost_table_from_json(BASE, "b")) if key.startswith("context")]


@pytest.mark.parametrize(("change", "message"), [
    ({"context_len": None}, "context_lens needs context_len"),
    ({"context_lens": [512, 300]}, "strictly increasing"),
    ({"context_lens": [100, 896]}, "strictly increasing"),
    ({"context_bias_seconds": [0.005]}, "context_bias_seconds has 1 entries for 2 context_lens"),
    ({"context_decode_seconds": []}, "context_decode_seconds has 0 entries"),
    ({"context_theta_seconds": [[0.0, 0.010], [0.02, 0.014]]},
     "at context 896: theta_seconds: theta_seconds must not decrease"),
])
def test_a_broken_context_term_is_refused_saying_where(change: dict, message: str) -> None:
    with pytest.raises(CostTableError, match=message) as err:
        cost_table_from_json({**BASE, **CONTEXT, **change}, "t.json")
    assert str(err.value).startswith("t.json: ")


def test_the_planner_prices_a_step_at_its_batchs_context() -> None:
    import torch

    from dspark.modes import VerifyMode
    from dspark.runtime.planner.verify_plan import AdaptiveVerifyPlan

    data = {**BASE, **CONTEXT, "type": "additive"}
    plan = AdaptiveVerifyPlan(gamma=3, mode=VerifyMode.COMPACT, cost_model=data)
    logits = torch.full((4, 3), 2.0)
    short = plan.plan_step(logits, 4, [0, 1, 2, 3], [0] * 4, context_len=128.0)
    long = plan.plan_step(logits, 4, [0, 1, 2, 3], [0] * 4, context_len=896.0)
    assert short.decision is not None and long.decision is not None
    at = table().at_context(896)
    rows = sum(long.verify_lens)
    assert long.decision.predicted_step_seconds == pytest.approx(at.step_time(4, rows) + at.draft_time(4))
    assert long.decision.predicted_step_seconds > short.decision.predicted_step_seconds


def test_a_step_record_keeps_its_context(tmp_path: Path) -> None:
    from .test_formats_step_records import GAMMA, record

    ring = StepRing(capacity=4)
    ring.append(dataclasses.replace(record(), context_len=517.5, offset_slope=1.25))
    ring.append(record())  # an older recording's step: no context
    steps = read_steps(ring.write(tmp_path / "steps.jsonl"), GAMMA)
    assert [s.context_len for s in steps] == [517.5, None] and steps[0].offset_slope == 1.25
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    (tmp_path / "bad.jsonl").write_text(lines[0].replace("517.5", "-1") + "\n")
    with pytest.raises(StepRecordError, match="context_len must be >= 0"):
        read_steps(tmp_path / "bad.jsonl", GAMMA)


def test_the_report_groups_step_time_by_context() -> None:
    from .test_formats_step_records import record

    steps = [dataclasses.replace(record(), context_len=c, step_seconds=m, predicted_step_seconds=p,
                                 offset_seconds=o, offset_slope=1.1)
             for c, m, p, o in ((100, 0.010, 0.009, 0.001), (120, 0.012, 0.011, 0.001),
                                (600, 0.020, 0.016, 0.0))]
    steps.append(record())  # no context: left out
    rows = step_time_by_context(steps)
    assert [(r.bucket, r.steps) for r in rows] == [("0-127", 2), ("512-639", 1)]
    assert rows[0].measured_seconds == pytest.approx(0.011) and rows[0].table_seconds == pytest.approx(0.009)
    assert rows[1].table_ratio == pytest.approx(0.8) and rows[1].online_seconds == pytest.approx(0.0176)


def test_profile_at_several_contexts_writes_a_table_with_their_term(tmp_path: Path, capsys) -> None:
    pkg = compile_variant(tmp_path, "tiny_cpu_static.yaml",
                          {"verify": {"mode": "compact", "allow_no_cost_model": True},
                           "serving": {"max_running_requests": 4}}, "profiled_contexts")
    out = tmp_path / "tables"
    assert main(["profile", str(pkg), "-o", str(out), "--batch-sizes", "1,2", "--repeats", "1",
                 "--warmup", "0", "--grid-density", "2", "--m-bin", "8", "--no-progress",
                 "--context-len", "32,96"]) == 0
    assert "priced at contexts 32, 96" in capsys.readouterr().out
    additive = load_cost_model(out / "additive.json")
    assert isinstance(additive, AdditiveCostTable)
    assert additive.context_len == 32 and additive.context_lens == (96,)
    assert len(additive.context_alpha_seconds[0]) == len(additive.bs_probes)
    assert np.isfinite(additive.at_context(64).step_time(2, 8))
    assert "context_len" not in json.loads((out / "sps_1d.json").read_text())
    for bad, says in (("96,32", "must increase"), ("", "is empty")):
        assert main(["profile", str(pkg), "-o", str(out), "--context-len", bad]) == 2
        assert says in capsys.readouterr().err
