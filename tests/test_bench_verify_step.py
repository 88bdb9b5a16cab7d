"""benchmarks/bench_verify_step.py: static, compact and the reference forward timed in one run."""

from __future__ import annotations

import json

import pytest

from .benchmark_loader import load_benchmark
from .runtime_helpers import REPO

bench = load_benchmark("bench_verify_step")
STATIC = str(REPO / "generated" / "tiny_cpu_static")
COMPACT = str(REPO / "generated" / "tiny_cpu_compact")


def test_one_run_times_every_point_and_prints_the_ratios(capsys) -> None:
    argv = [STATIC, COMPACT, "--batch-sizes", "1,2", "--fractions", "0.25,1", "--repeats", "2",
            "--warmup", "0", "--reference", "--json"]
    assert bench.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    points = {(p["num_reqs"], p["rows"]): p for p in result["points"]}
    assert sorted(points) == [(1, 2), (1, 8), (2, 4), (2, 16)]  # 0.25·B·N and B·N rows
    for p in points.values():
        assert p["static_ms"] > 0 and p["compact_ms"] > 0
        assert p["compact_over_static"] == pytest.approx(p["compact_ms"] / p["static_ms"])
        # The reference runs M / B rows per request (whole here) and B·N rows.
        assert p["reference_ms"] > 0 and p["reference_full_ms"] > 0
    # A batch size's static step (and its reference at B·N) is one measurement shared by its points.
    assert points[1, 2]["static_ms"] == points[1, 8]["static_ms"]
    assert points[1, 8]["reference_ms"] == points[1, 8]["reference_full_ms"]

    assert bench.main([STATIC, COMPACT, "--batch-sizes", "1", "--fractions", "0.5", "--repeats", "1",
                       "--warmup", "0"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["B", "M", "static", "B·N"] and len(table) == 2
    assert table[1].split()[:2] == ["1", "4"] and table[1].split()[-2:] == ["-", "-"]  # no reference


def test_an_anchor_build_is_timed_at_the_same_points(capsys) -> None:
    """A second compact build of the deployment (here the tiered one; on a GPU, FlashInfer's) in the
    same rounds, its ratio beside the others."""
    anchor = str(REPO / "generated" / "tiny_cpu_compact_tiers")
    argv = [STATIC, COMPACT, "--anchor", anchor, "--batch-sizes", "2", "--fractions", "0.5", "--repeats", "1",
            "--warmup", "0"]
    assert bench.main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (point,) = result["points"]
    assert result["anchor"] == anchor and point["anchor_ms"] > 0
    assert point["compact_over_anchor"] == pytest.approx(point["compact_ms"] / point["anchor_ms"])
    assert bench.main(argv) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[-3:] == ["anchor", "ms", "compact/anchor"] and len(row.split()) == 10


def test_rows_stay_within_what_a_compact_step_runs() -> None:
    class Timer:
        floor, cap = 1, 8
    assert bench.row_counts(4, Timer, [0.01, 0.25, 0.5, 1.0], 8) == [4, 8, 16, 32]


@pytest.mark.parametrize("argv, message", [
    ([COMPACT, STATIC], "expected a static (or cap-accept) build then a compact one"),
    ([STATIC, str(REPO / "generated" / "llama_50m_cpu_compact")], "differ in model geometry"),
    ([STATIC, COMPACT, "--batch-sizes", "4096"], "exceed serving.max_running_requests"),
])
def test_builds_that_cannot_be_compared_are_refused(argv, message, capsys) -> None:
    assert bench.main([*argv, "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench_verify_step: error: ") and message in err


def test_bad_arguments_exit_2() -> None:
    for argv in (["--fractions", "0"], ["--fractions", "x"], ["--repeats", "0"]):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args([STATIC, COMPACT, *argv])
        assert exc.value.code == 2
