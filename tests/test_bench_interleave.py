"""`dspark bench --sweep ... --interleave`: every policy's engine in one process, taking turns.

- Its flags: one error line naming the flag, exit 2.
- The statistics of synthetic passes: throughput over every pass, the best baseline, the ratio paired by
  pass (a machine that slows down for one pass moves both sides of that pass's ratio alike).
- A small real run on the embedded package: every engine does the same requests, turns alternate, every
  policy's outputs equal target-only's; a differing output is called out and exits 1.
"""

from __future__ import annotations

import json
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


def test_the_best_base_is_over_every_pass_and_the_ratio_paired_by_pass() -> None:
    # pass 2 ran on a machine twice as slow for everyone; adaptive is 2 % ahead of fixed-8 in every pass
    result = _result({"target-only": [100, 100, 50, 100], "fixed-4": [300, 290, 150, 310],
                      "fixed-8": [400, 410, 200, 390], "adaptive": [408, 418.2, 204, 397.8],
                      "adaptive-twin": [400, 410, 200, 390]})
    assert result.best_base(C4) == "fixed-8"
    seconds = sum(1000 / r for r in (400, 410, 200, 390))
    assert result.throughput("fixed-8", C4) == pytest.approx(4000 / seconds)
    assert result.paired(C4) == pytest.approx([1.02] * 4)
    assert result.ratio(C4) == pytest.approx(1.02)
    assert result.ratio(C4, "adaptive-twin") == pytest.approx(1.0)
    data = json.loads(json.dumps(result.to_json()))
    assert data["best_bases"] == {"c=4": "fixed-8"}
    assert data["ratio_intervals"]["c=4"] == pytest.approx([1.02, 1.02])
    table = format_interleaved(result)
    assert "1.020x [1.020, 1.020]" in table and "adaptive-twin / best base" in table


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
    assert all(check["identical"] and check["compared"] == 3 + 6 for check in data["lossless"])
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
