"""benchmarks/bench_planner.py: our planner and SGLang's torch algorithm timed in one run, agreeing."""

from __future__ import annotations

import json
import random

import pytest
import torch

from dspark.runtime.planner.budget import ScheduleConfig, allocate_verify_lens, choose_budget

from .benchmark_loader import load_benchmark

bench = load_benchmark("bench_planner")
TINY = ["--num-reqs", "16", "--rounds", "1", "--calls", "2", "--inputs", "2", "--layout-batch-sizes", "1,4"]


def test_one_run_prints_both_times_and_the_ratio(capsys) -> None:
    assert bench.main(TINY) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.split()[:1] in (["additive"], ["sps-1d"],
                                                                                   ["tier"])}
    assert sorted(rows) == ["additive", "sps-1d", "tier"]
    for _, ours, sglang, speedup, _ in rows.values():
        assert float(ours) > 0 and float(sglang) > 0
        assert float(speedup.rstrip("x")) == pytest.approx(float(sglang) / float(ours), rel=0.01, abs=0.01)
    layout = [line.split() for line in lines if line.split()[:1] in (["1"], ["4"])]
    assert [row[0] for row in layout] == ["1", "4"] and all(float(x) > 0 for row in layout for x in row[1:4])


def test_json_holds_every_table_and_batch_size(capsys) -> None:
    assert bench.main([*TINY, "--tables", "additive,tier", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [d["table"] for d in result["decisions"]] == ["additive", "tier"]
    for d in result["decisions"]:
        assert d["num_reqs"] == 16 and d["gamma"] == 7
        assert d["speedup"] == pytest.approx(d["sglang_ms"] / d["ours_ms"])
    assert [r["num_reqs"] for r in result["layouts"]] == [1, 4]
    for r in result["layouts"]:
        assert r["plan_and_layout_ms"] > 0 and r["plan_ms"] > 0 and r["layout_ms"] > 0
        assert r["num_reqs"] <= r["mean_rows"] <= r["num_reqs"] * 8


def test_a_disagreement_is_reported_and_fails_the_run(monkeypatch, capsys) -> None:
    real = bench.sgl_budget
    monkeypatch.setattr(bench, "sgl_budget", lambda *args: real(*args) + 1)
    assert bench.main(TINY) == 1
    assert "our budget" in capsys.readouterr().err


@pytest.mark.parametrize("seed", range(40))
def test_the_sglang_reimplementation_decides_like_the_planner(seed: int) -> None:
    """Same budget and verify_lens as ours wherever both define them (floor 1, no cap, no draft term),
    ties included: the comparison times one decision against the same decision."""
    rng = random.Random(seed)
    gamma, num_reqs = rng.randint(1, 8), rng.randint(1, 40)
    conf = [[rng.choice([0.5, 1.0, 0.0]) if rng.random() < 0.3 else rng.random() for _ in range(gamma)]
            for _ in range(num_reqs)]
    survival = torch.cumprod(torch.tensor(conf), dim=1)
    cfg = ScheduleConfig(gamma=gamma)
    for kind, (table, sgl_table) in bench.tables(num_reqs, gamma + 1).items():
        budget = bench.sgl_budget(survival, sgl_table, gamma, cfg.survival_eps)
        assert budget == choose_budget(survival, table, cfg).budget, kind
    for budget in {0, 1, rng.randint(0, num_reqs * gamma), num_reqs * gamma}:
        assert torch.equal(bench.sgl_verify_lens(survival, budget, gamma, cfg.survival_eps),
                           allocate_verify_lens(survival, budget, cfg))


def test_layout_tiers_cover_every_step() -> None:
    assert bench.layout_tiers(2048)[-1] == 2048 and bench.layout_tiers(8) == (8,)
    tiers = bench.layout_tiers(1024)
    assert list(tiers) == sorted(set(tiers)) and tiers[-1] == 1024 and 768 in tiers
