"""benchmarks/compare_profiles.py: static against compact profiles of one deployment, point by point."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dspark.cli.main import main as dspark_main
from dspark.fingerprint import Fingerprint
from dspark.measure.profiler import ProfilePlan, ProfileResult, ProfileSample, fit_sps_table, write_tables

from .benchmark_loader import load_benchmark
from .runtime_helpers import compile_variant

compare_profiles = load_benchmark("compare_profiles")

FINGERPRINT = Fingerprint(backend="cpu", device="generic", dtype="float32", model_geometry="0123456789abcdef",
                          model_weights="", draft="fedcba9876543210", draft_weights="", tp=1, dp=1, tiers=(),
                          verify_mode="static", gamma=3, policy="greedy")


def write_profile(directory: Path, mode: str, samples: dict[tuple[int, int], float], *,
                  context_len: str = "64", **fingerprint_changes) -> Path:
    """A profile directory as `dspark profile` writes it, with one measurement per (B, M) (N = 4)."""
    full = [ProfileSample(b, m, (s,)) for (b, m), s in samples.items() if m == 4 * b]
    grid = [ProfileSample(b, m, (s,)) for (b, m), s in samples.items() if m != 4 * b]
    batch_sizes = sorted({b for b, _ in samples})
    plan = ProfilePlan(batch_sizes=batch_sizes, num_draft_tokens=4, min_verify_len=1 if grid else 4)
    meta = {"deployment": f"demo_{mode}", "verify_mode": mode, "context_len": context_len}
    result = ProfileResult(plan, tuple(full), tuple(grid), meta=meta)
    fingerprint = dataclasses.replace(FINGERPRINT, verify_mode=mode, **fingerprint_changes)
    sps = fit_sps_table(result.static_samples(), result.max_batch_tokens)
    write_tables(directory, sps, None, result, fingerprint=fingerprint.to_json())
    return directory


STATIC = {(1, 4): 0.010, (2, 8): 0.020, (8, 32): 0.080}
COMPACT = {(1, 1): 0.004, (1, 4): 0.011, (2, 2): 0.006, (2, 5): 0.012, (2, 8): 0.021, (4, 16): 0.05}


def test_compact_points_are_compared_with_the_static_step_of_the_same_batch_size(tmp_path, capsys) -> None:
    static = write_profile(tmp_path / "s", "static", STATIC)
    compact = write_profile(tmp_path / "c", "compact", COMPACT, tiers=(4, 8, 12))  # the mode's tiers differ
    comparison = compare_profiles.compare(compare_profiles.load_profile_dir(static),
                                          compare_profiles.load_profile_dir(compact))
    got = [(p.num_reqs, p.num_rows, p.full_rows, p.static_seconds, p.compact_seconds)
           for p in comparison.points]
    assert got == [(1, 1, 4, 0.010, 0.004), (1, 4, 4, 0.010, 0.011), (2, 2, 8, 0.020, 0.006),
                   (2, 5, 8, 0.020, 0.012), (2, 8, 8, 0.020, 0.021)]
    assert [p.ratio for p in comparison.points] == pytest.approx([0.4, 1.1, 0.3, 0.6, 1.05])
    assert comparison.only_static == (8,) and comparison.only_compact == (4,)

    assert compare_profiles.main([str(static), str(compact)]) == 0
    text = capsys.readouterr().out
    assert "graph tiers none" in text and "graph tiers 4,8,12" in text
    assert f"{2:>6} {5:>7} {'62.5%':>8} {20.0:>11.4f} {12.0:>11.4f} {0.6:>15.3f}" in text
    assert "batch sizes [8] were measured in the static profile only" in text

    assert compare_profiles.main([str(static), str(compact), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["static"]["verify_mode"] == "static" and data["compact"]["tiers"] == [4, 8, 12]
    assert data["points"][0] == {"num_reqs": 1, "num_rows": 1, "full_rows": 4, "static_seconds": 0.010,
                                 "compact_seconds": 0.004, "compact_over_static": pytest.approx(0.4)}
    assert "verify_mode" not in data["deployment"] and data["deployment"]["gamma"] == 3
    assert data["batch_sizes_only_in_static"] == [8] and data["batch_sizes_only_in_compact"] == [4]


@pytest.mark.parametrize(("static_changes", "compact_changes", "message"), [
    ({"dtype": "bfloat16"}, {}, "dtype: static 'bfloat16', compact 'float32'"),
    ({}, {"model_weights": "00000000000000aa", "gamma": 4},
     "model_weights: static '', compact '00000000000000aa'\n  gamma: static 3, compact 4"),
    ({}, {"context_len": "128"}, "context_len: static measured with '64' cached tokens per request, compact "
                                 "with '128'"),
])
def test_profiles_of_different_deployments_are_refused_naming_the_field(
        tmp_path, capsys, static_changes, compact_changes, message) -> None:
    def split(changes: dict) -> tuple[dict, dict]:
        context = {k: v for k, v in changes.items() if k == "context_len"}
        return context, {k: v for k, v in changes.items() if k != "context_len"}
    s_context, s_fp = split(static_changes)
    c_context, c_fp = split(compact_changes)
    static = write_profile(tmp_path / "s", "static", STATIC, **s_context, **s_fp)
    compact = write_profile(tmp_path / "c", "compact", COMPACT, **c_context, **c_fp)
    assert compare_profiles.main([str(static), str(compact)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("compare_profiles: error:")


def test_the_static_profile_comes_first_and_every_directory_needs_a_fingerprint(tmp_path, capsys) -> None:
    static = write_profile(tmp_path / "s", "cap-accept", STATIC)  # cap-accept runs B x N rows too
    compact = write_profile(tmp_path / "c", "compact", COMPACT)
    assert compare_profiles.main([str(static), str(compact)]) == 0
    capsys.readouterr()
    assert compare_profiles.main([str(compact), str(static)]) == 2
    assert "swap the two directories" in capsys.readouterr().err
    assert compare_profiles.main([str(static), str(write_profile(tmp_path / "s2", "static", STATIC))]) == 2
    assert "got cap-accept" in capsys.readouterr().err
    table = json.loads((compact / "sps_1d.json").read_text())
    del table["fingerprint"]
    (compact / "sps_1d.json").write_text(json.dumps(table))
    assert compare_profiles.main([str(static), str(compact)]) == 2
    assert "has no fingerprint" in capsys.readouterr().err
    assert compare_profiles.main([str(static), str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err


@pytest.mark.slow
def test_profiles_of_a_static_and_a_compact_build_compare_end_to_end(tmp_path, capsys) -> None:
    """`dspark profile` of both builds of one tiny deployment, then the comparison of what it wrote."""
    limits = {"serving": {"max_running_requests": 2}}
    static_pkg = compile_variant(tmp_path, "tiny_cpu_static.yaml", limits, "pair_static")
    compact_pkg = compile_variant(tmp_path, "tiny_cpu_static.yaml",
                                  {**limits, "verify": {"mode": "compact", "allow_no_cost_model": True}},
                                  "pair_compact")
    common = ["--batch-sizes", "1,2", "--repeats", "1", "--warmup", "0", "--context-len", "32",
              "--no-draft-time", "--no-progress"]
    assert dspark_main(["profile", str(static_pkg), "-o", str(tmp_path / "s"), *common]) == 0
    assert dspark_main(["profile", str(compact_pkg), "-o", str(tmp_path / "c"), "--grid-density", "3",
                        *common]) == 0
    capsys.readouterr()
    assert compare_profiles.main([str(tmp_path / "s"), str(tmp_path / "c"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    static = ProfileResult.load(tmp_path / "s" / "profile.json")
    compact = ProfileResult.load(tmp_path / "c" / "profile.json")
    expected = sorted((s.num_reqs, s.num_rows) for s in (*compact.static, *compact.grid))
    assert [(p["num_reqs"], p["num_rows"]) for p in data["points"]] == expected
    full = {s.num_reqs: s.median_seconds for s in static.static}
    for point in data["points"]:
        b = point["num_reqs"]
        assert point["full_rows"] == 8 * b and point["static_seconds"] == full[b]
        assert point["compact_over_static"] == pytest.approx(point["compact_seconds"] / full[b])
    assert data["static"]["deployment"] == "pair_static" and data["compact"]["context_len"] == "32"
