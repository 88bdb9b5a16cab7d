"""benchmarks/verify_step_layouts.py: its layout syntax, and a ragged step timed through the profiler's
timer (which refuses a layout the build cannot run)."""

from __future__ import annotations

import argparse

import pytest
import torch

from dspark.measure.step_timer import ProfileError, VerifyStepTimer
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.engine.step_forward import VerifyForward
from dspark.runtime.layout import VerifyLayout
from dspark.runtime.package import load_package

from .benchmark_loader import load_benchmark
from .runtime_helpers import REPO

bench = load_benchmark("verify_step_layouts")


def test_a_layout_reads_and_names_back() -> None:
    lens = bench.parse_layout("2x8+3x4+1x1")
    assert lens == (8, 8, 4, 4, 4, 1)
    assert bench.layout_name(lens) == "2x8+3x4+1x1"
    assert bench.layout_name((4, 8, 4)) == "1x8+2x4"
    for bad in ("8", "2x", "0x8", "2x0", "2x8+", "ax8"):
        with pytest.raises(argparse.ArgumentTypeError, match="COUNTxROWS"):
            bench.parse_layout(bad)


def test_a_ragged_step_is_timed_and_a_bad_one_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = Runtime(load_package(REPO / "generated" / "tiny_cpu_compact"))
    timer = VerifyStepTimer(runtime, context_len=32)
    real, calls = runtime.forward.verify, []

    def spy(step: VerifyForward) -> tuple[VerifyLayout, torch.Tensor, torch.Tensor | None]:
        layout, hidden, states = real(step)
        calls.append((step, layout, hidden.shape[0]))
        return layout, hidden, states

    monkeypatch.setattr(runtime.forward, "verify", spy)
    assert timer.time_lens((8, 8, 3, 1)) > 0
    # the runtime's verify forward ran the ragged step itself: each request its own rows, packed
    # (no graph tiers on the CPU), after 32 cached tokens each, on the timer's slots
    [(step, layout, rows)] = calls
    assert step.verify_lens == step.run_lens == (8, 8, 3, 1)
    assert step.prefix_lens == (32,) * 4 and step.slots == tuple(timer.slots[:4]) and step.tier is None
    assert layout.packed and layout.total_rows == layout.tier == rows == 8 + 8 + 3 + 1
    assert layout.host_qo_indptr == (0, 8, 16, 19, 20)
    for bad in ((), (9,), (8, 0)):
        with pytest.raises(ProfileError, match="every request runs 1..8 rows"):
            timer.time_lens(bad)
    assert len(calls) == 1  # a refused layout runs nothing


def test_the_script_prints_each_layout_beside_its_even_spread(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([str(REPO / "generated" / "tiny_cpu_compact"), "--context-len", "32", "--repeats", "1",
                       "--warmup", "0", "--layout", "2x8+2x2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[2:]] == ["2x8+2x2", "4x5"]
