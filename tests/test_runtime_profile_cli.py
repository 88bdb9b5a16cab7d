"""`dspark profile`: times the generated runtime's own verify step and writes loadable tables."""

from __future__ import annotations

import json

import pytest

from dspark.cli.main import main
from dspark.formats.profile import ProfileResult
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


@pytest.mark.parametrize("mode", ["static", "cap-accept"])
def test_profile_of_a_fixed_width_build_is_its_static_sweep(tmp_path, capsys, mode) -> None:
    pkg = compile_variant(tmp_path, "tiny_cpu_static.yaml",
                          {"verify": {"mode": mode}, "serving": {"max_running_requests": 4}},
                          f"fixed_{mode.replace('-', '_')}")
    out = tmp_path / "t"
    assert main(["profile", str(pkg), "-o", str(out), "--batch-sizes", "1,3", "--repeats", "2",
                 "--warmup", "0", "--no-progress"]) == 0
    report = capsys.readouterr().out
    assert f"no additive or tier table: a {mode} build runs all N=8 rows" in report
    assert "residuals" not in report and "additive.json" not in report
    assert sorted(p.name for p in out.iterdir()) == ["profile.json", "sps_1d.json"]
    sps = load_cost_model(out / "sps_1d.json")
    assert isinstance(sps, SpsTable) and sps.sample_batch_tokens == (8, 24) and sps.max_batch_tokens == 24
    assert sps.draft_bs_probes == (1, 3)
    fingerprint = json.loads((out / "sps_1d.json").read_text())["fingerprint"]
    assert fingerprint["verify_mode"] == mode and fingerprint["tiers"] == []
    result = ProfileResult.load(out / "profile.json")
    # every step of the build runs B x N rows: the plan has no grid, and none was measured
    assert result.plan.min_verify_len == result.plan.num_draft_tokens == 8 and result.plan.extra_rows == ()
    assert result.grid == () and [(s.num_reqs, s.num_rows, len(s.seconds)) for s in result.static] == [
        (1, 8, 2), (3, 24, 2)]
    assert result.meta["verify_mode"] == mode


def test_a_static_profile_beside_an_older_compact_one_says_which_tables_are_stale(tmp_path, capsys) -> None:
    pkg = compile_variant(tmp_path, "tiny_cpu_static.yaml", {"serving": {"max_running_requests": 2}}, "st")
    out = tmp_path / "t"
    out.mkdir()
    (out / "additive.json").write_text("{}")
    assert main(["profile", str(pkg), "-o", str(out), "--batch-sizes", "1", "--repeats", "1", "--warmup", "0",
                 "--no-draft-time", "--no-progress"]) == 0
    assert f"note: {out / 'additive.json'} is from an earlier profile" in capsys.readouterr().out
    assert (out / "additive.json").read_text() == "{}"  # the user's file is theirs to delete


def test_batch_sizes_beyond_the_deployment_are_refused_naming_the_limit(tmp_path, capsys) -> None:
    pkg = compile_variant(tmp_path, "tiny_cpu_static.yaml",
                          {"serving": {"max_running_requests": 32, "max_total_tokens": 4096}}, "small_pool")
    # 4096 tokens = 256 pages; context 128 + N = 136 tokens take 9 pages: 28 requests fit the pool
    assert main(["profile", str(pkg), "-o", str(tmp_path / "t"), "--batch-sizes", "1,8,32,64,128",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "batch sizes [64, 128] exceed serving.max_running_requests = 32 of small_pool" in err
    assert "max_running_requests >= 128" in err
    assert "holds only 28 requests of context_len 128 + N = 136 tokens" in err
    assert "fewer than batch sizes [32, 64, 128]" in err and "at least 18432" in err
    assert not (tmp_path / "t").exists()
    # a shorter context fits more requests into the same pool
    assert main(["profile", str(pkg), "-o", str(tmp_path / "t"), "--batch-sizes", "32", "--context-len", "8",
                 "--repeats", "1", "--warmup", "0", "--no-draft-time", "--no-progress"]) == 0


def test_rows_are_spread_evenly_within_floor_and_cap() -> None:
    assert spread_rows(7, 3, 1, 8) == [3, 2, 2]
    assert spread_rows(24, 3, 1, 8) == [8, 8, 8]
    with pytest.raises(ProfileError):
        spread_rows(25, 3, 1, 8)
