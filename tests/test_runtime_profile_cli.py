"""`dspark profile`: times the generated runtime's own verify step and writes loadable tables."""

from __future__ import annotations

import json

import pytest

from dspark.cli.main import main
from dspark.measure.step_timer import ProfileError, spread_rows
from dspark.runtime.package import load_package
from dspark.runtime.planner.cost_models import AdditiveCostTable, SpsTable, TierCostTable, load_cost_model

from .runtime_helpers import compile_variant


def test_profile_measures_a_compact_package_and_writes_both_tables(tmp_path, capsys) -> None:
    pkg = compile_variant(tmp_path, "tiny_cpu_static.yaml",
                          {"verify": {"mode": "compact", "allow_no_cost_model": True},
                           "graph": {"enabled": True, "token_tiers": [8, 16, 24, 32]},
                           "serving": {"max_running_requests": 4}}, "profiled")
    out = tmp_path / "tables"
    assert main(["profile", str(pkg), "-o", str(out), "--batch-sizes", "1,2,4", "--repeats", "1",
                 "--warmup", "0", "--grid-density", "3", "--m-bin", "8", "--no-progress"]) == 0
    report = capsys.readouterr().out
    assert "static sweep" in report and "R²" in report and "residuals" in report
    sps, additive = load_cost_model(out / "sps_1d.json"), load_cost_model(out / "additive.json")
    assert isinstance(sps, SpsTable) and sps.sample_batch_tokens == (8, 16, 32)
    assert sps.max_batch_tokens == 32  # the largest tier: no step may exceed it
    assert isinstance(additive, AdditiveCostTable) and additive.bs_probes == (1, 2, 4)
    # the draft's step time per batch size rides along, for the objective's denominator
    assert sps.draft_bs_probes == additive.draft_bs_probes == (1, 2, 4)
    assert all(seconds > 0 for seconds in additive.draft_seconds)
    compiled = compile_variant(tmp_path, "tiny_cpu_static.yaml",
                               {"verify": {"mode": "compact"},
                                "cost_model": {"type": "additive", "file": str(out / "additive.json")},
                                "graph": {"enabled": True, "token_tiers": [8, 16, 24, 32]},
                                "serving": {"max_running_requests": 4}},
                               "uses_profiled_table")
    table = load_package(compiled).plan.table
    assert table == additive and table.draft_time(2) == additive.draft_seconds[1]
    # every table says what it was measured on; the tier table prices each step at its tier
    tier = load_cost_model(out / "tier.json")
    assert isinstance(tier, TierCostTable) and tier.tiers == (8, 16, 24, 32)
    for name in ("sps_1d.json", "additive.json", "tier.json"):
        assert json.loads((out / name).read_text())["fingerprint"]["tiers"] == [8, 16, 24, 32]
    profile = json.loads((out / "profile.json").read_text())
    assert profile["meta"]["tiers"] == "8,16,24,32" and profile["meta"]["backend"] == "cpu"
    # the tier boundaries are measured densely (tier - 2 ... tier + 2) where the grid reaches
    assert {7, 9, 10} <= {s["num_rows"] for s in profile["grid"] if s["num_reqs"] == 2}


def test_profile_refuses_a_fixed_width_build_and_says_what_to_do(tmp_path, capsys) -> None:
    pkg = compile_variant(tmp_path, "tiny_cpu_static.yaml", {"serving": {"max_running_requests": 2}},
                          "static_profiled")
    assert main(["profile", str(pkg), "-o", str(tmp_path / "t"), "--no-progress"]) == 2
    assert "Profile a compact build" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_rows_are_spread_evenly_within_floor_and_cap() -> None:
    assert spread_rows(7, 3, 1, 8) == [3, 2, 2]
    assert spread_rows(24, 3, 1, 8) == [8, 8, 8]
    with pytest.raises(ProfileError):
        spread_rows(25, 3, 1, 8)
