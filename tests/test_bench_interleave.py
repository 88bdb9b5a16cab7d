"""`dspark bench --sweep ... --interleave`: every policy's engine in one process, taking turns.

- Its flags: one error line naming the flag, exit 2.
- The statistics of synthetic passes: throughput over every pass, the best baseline, the ratio paired by
  pass (a machine that slows down for one pass moves both sides of that pass's ratio alike).
- A small real run on the embedded package: every engine does the same requests, turns alternate, every
  policy's outputs equal target-only's; a differing output is called out and exits 1.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest

from dspark.bench.interleave import (
    ClosedLoop,
    InterleaveResult,
    PassResult,
    format_interleaved,
    lossless_checks,
    run_interleaved,
)
from dspark.bench.sweep import Load, SweepConfig, plan_runs
from dspark.cli.main import main
from dspark.corpus import held_out_prompts
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package

from .test_bench_sweep import COMPACT, COMPACT_PKG, SWEEP, _bench_fails


@pytest.mark.parametrize(("argv", "says"), [
    ([*SWEEP, "--slice-seconds", "0.2"], ("--slice-seconds is the turn of an interleaved sweep",
                                         "add --interleave")),
    ([*SWEEP, "--interleave", "--slice-seconds", "0"], ("--slice-seconds must be a positive",)),
    ([*SWEEP, "--interleave", "--request-rates", "2"], ("--request-rates", "closed-loop loads only")),
    ([*SWEEP, "--interleave", "--server-timeout", "5"], ("--server-timeout", "starts no server")),
    (["--url", "http://127.0.0.1:1", "--interleave"], ("--interleave belongs to a sweep",)),
])
def test_bad_interleave_arguments_are_one_line_and_status_2(argv: list[str], says: Sequence[str],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    _bench_fails(argv, capsys, 2, *says)


# -- statistics of synthetic passes ------------------------------------------------------------------
C4 = Load("concurrency", 4)


def _config(rounds: int) -> SweepConfig:
    runs, _ = plan_runs([COMPACT_PKG], ("target-only", "fixed", "adaptive"), (4, 8), twin=True)
    return SweepConfig(packages=(COMPACT_PKG,), runs=tuple(runs), concurrency=(4,), rounds=rounds)


def _result(rates: dict[str, list[float]]) -> InterleaveResult:
    """Passes of 1000 tokens each at the given tokens/s per pass."""
    rounds = len(next(iter(rates.values())))
    passes = tuple(PassResult(policy, C4, i, 1000, 1000 / rate, 3, None)
                   for policy, per_pass in rates.items() for i, rate in enumerate(per_pass))
    return InterleaveResult(_config(rounds), 0.5, passes, (), "", "", {})


def _median_quantile(values: list[float], q: float) -> tuple[float, float]:
    """The q-quantile of the median of len(values) (odd) draws from `values` with replacement, exactly
    (the bootstrap's limit), and how far the distribution function at it and below it lies from q."""
    n, ordered = len(values), sorted(values)
    assert n % 2 == 1 and len(set(values)) == n

    def at_most(i: int) -> float:  # P(median <= ordered[i - 1]): at least (n + 1) / 2 draws at or below it
        p = i / n
        return sum(math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range((n + 1) // 2, n + 1))

    i = next(i for i in range(1, n + 1) if at_most(i) >= q)
    return ordered[i - 1], min(at_most(i) - q, q - at_most(i - 1))


def test_the_best_base_is_over_every_pass_and_the_ratio_paired_by_pass() -> None:
    # Pass 2 ran on a machine twice as slow for everyone. Fixed-8 is the best base over every pass though
    # fixed-4 wins pass 3; adaptive's ratio to fixed-8 varies by pass, lowest in the slow pass.
    fixed8 = [400, 410, 200, 390, 420, 405, 395]
    fixed4 = [300, 290, 150, 420, 310, 300, 295]
    by_pass = [1.01, 0.98, 0.95, 1.06, 1.04, 1.10, 1.03]  # adaptive / fixed-8 in each pass
    twin_by_pass = [0.97, 1.02, 1.00, 0.99, 1.04, 1.01, 0.96]
    adaptive = [rate * r for rate, r in zip(fixed8, by_pass, strict=True)]
    result = _result({"target-only": [100, 100, 50, 100, 105, 100, 95], "fixed-4": fixed4,
                      "fixed-8": fixed8, "adaptive": adaptive,
                      "adaptive-twin": [rate * r for rate, r in zip(fixed8, twin_by_pass, strict=True)]})
    assert fixed4[3] > fixed8[3]  # the pass-3 winner is not the best base
    assert result.best_base(C4) == "fixed-8"
    seconds = sum(1000 / r for r in fixed8)
    assert result.throughput("fixed-8", C4) == pytest.approx(7000 / seconds)
    assert result.throughput("fixed-4", C4) == pytest.approx(7000 / sum(1000 / r for r in fixed4))
    assert result.paired(C4) == pytest.approx(by_pass)  # against fixed-8 in every pass, pass 3 included
    # the median of the paired ratios, neither the pooled ratio nor a ratio of medians
    median = sorted(by_pass)[3]
    pooled = (7000 / sum(1000 / r for r in adaptive)) / (7000 / seconds)
    of_medians = sorted(adaptive)[3] / sorted(fixed8)[3]
    assert median == 1.03 and abs(pooled - median) > 0.01 and abs(of_medians - median) > 0.01
    assert result.ratio(C4) == pytest.approx(median)
    assert result.ratio(C4, "adaptive-twin") == pytest.approx(1.0)
    # the 90 % bootstrap interval: the 5 % and 95 % quantiles of the median of 7 passes drawn with
    # replacement, each far enough from a step of the exact distribution for 2000 resamples to agree
    (low, low_margin), (high, high_margin) = (_median_quantile(by_pass, q) for q in (0.05, 0.95))
    (twin_low, twin_low_margin), (twin_high, twin_high_margin) = (_median_quantile(twin_by_pass, q)
                                                                  for q in (0.05, 0.95))
    assert (low, high) == (0.98, 1.06) and (twin_low, twin_high) == (0.97, 1.02)
    assert min(low_margin, high_margin, twin_low_margin, twin_high_margin) > 0.03
    data = json.loads(json.dumps(result.to_json()))
    assert data["best_bases"] == {"c=4": "fixed-8"}
    assert data["ratios"]["c=4"] == pytest.approx(median)
    assert data["ratio_intervals"]["c=4"] == pytest.approx([low, high])
    assert data["twin_ratios"]["c=4"] == pytest.approx(1.0)
    assert data["twin_ratio_intervals"]["c=4"] == pytest.approx([twin_low, twin_high])
    assert data["throughput"]["c=4"]["adaptive"] == pytest.approx(pooled * 7000 / seconds)
    table = format_interleaved(result)
    assert f"{median:.3f}x [{low:.3f}, {high:.3f}]" in table and "adaptive-twin / best base" in table
    assert f"1.000x [{twin_low:.3f}, {twin_high:.3f}]" in table


def test_fewer_passes_than_an_interval_needs_give_none() -> None:
    result = _result({"fixed-8": [400, 410], "adaptive": [400, 400]})
    assert result.to_json()["ratio_intervals"] == {"c=4": None}


def test_a_differing_output_is_called_out() -> None:
    checks = {c.policy: c for c in lossless_checks({
        "target-only": [("c=4", 0, [1, 2, 3]), ("c=4", 1, [4, 5])],
        "adaptive": [("c=4", 0, [1, 2, 3]), ("c=4", 1, [4, 6])],
        "fixed-8": [("c=4", 0, [1, 2, 3])],
    })}
    assert checks["fixed-8"].identical and checks["fixed-8"].compared == 1
    assert not checks["adaptive"].identical and checks["adaptive"].mismatched == 1
    assert "prompt 1" in (checks["adaptive"].first_mismatch or "")
    assert lossless_checks({"adaptive": [("c=4", 0, [1])]}) == []


# -- a real run ---------------------------------------------------------------------------------------
def test_a_closed_loop_keeps_c_requests_in_flight_and_sends_each_once() -> None:
    package = load_package(COMPACT)
    runtime = Runtime(package)
    ids = [package.tokenizer.encode(p) for p in held_out_prompts(5)]
    loop = ClosedLoop(runtime, ids, 5, 2, 6)
    assert loop.sent == 2 and len(loop.live) == 2
    while not loop.done:
        loop.turn(0.001)  # a turn finishes the step under way, so even this short a turn makes progress
        assert len(loop.live) <= 2
    assert sorted(loop.outputs) == [0, 1, 2, 3, 4] and loop.tokens == 5 * 6
    assert loop.turns >= 3 and loop.seconds > 0
    assert (loop.tokens_per_step() or 0) > 1  # the embedded draft is accepted
    reference, _ = runtime.generate(ids, 6, target_only=True)
    assert [loop.outputs[i] for i in range(5)] == reference


def test_a_small_interleaved_sweep_is_complete_and_lossless(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--sweep", str(COMPACT), "--interleave", "--policies", "target-only,fixed,adaptive",
            "--fixed-k", "3", "--concurrency-list", "1,3", "--num-prompts", "3", "--max-tokens", "8",
            "--rounds", "2", "--slice-seconds", "0.05", "--no-progress", "--out", str(tmp_path)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    data = json.loads((tmp_path / "interleave.json").read_text())
    assert (tmp_path / "interleave.txt").read_text() == table
    assert data["policies"] == ["target-only", "fixed-3", "adaptive"]
    passes = data["passes"]
    assert len(passes) == 3 * 2 * 2  # policies x loads x passes
    # the same work for every engine and pass: --num-prompts requests, and 2 per slot at c = 3
    assert {(p["load"]["label"], p["tokens"]) for p in passes} == {("c=1", 3 * 8), ("c=3", 6 * 8)}
    assert all(p["seconds"] > 0 and p["turns"] >= 1 for p in passes)
    assert [check["policy"] for check in data["lossless"]] == ["target-only", "fixed-3", "adaptive"]
    assert all(check["identical"] and check["compared"] == 3 + 6 for check in data["lossless"])
    assert "lossless adaptive: 9/9 outputs equal target-only's" in table
    assert "--interleave --slice-seconds 0.05" in data["command"] and "--rounds 2" in data["command"]


def test_an_output_that_differs_exits_1(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    real = run_interleaved

    def broken(*args: object, **kwargs: object) -> InterleaveResult:
        result = real(*args, **kwargs)  # type: ignore[arg-type]
        bad = lossless_checks({"target-only": [("c=4", 0, [1])], "adaptive": [("c=4", 0, [2])]})
        return InterleaveResult(result.config, result.slice_s, result.passes, tuple(bad), result.started,
                                result.finished, result.machine)

    monkeypatch.setattr("dspark.bench.interleave.run_interleaved", broken)
    assert main(["bench", "--sweep", str(COMPACT), "--interleave", "--policies", "target-only,adaptive",
                 "--concurrency-list", "1", "--num-prompts", "1", "--max-tokens", "4", "--rounds", "1",
                 "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "greedy outputs of adaptive differ from target-only's" in err and "Traceback" not in err
