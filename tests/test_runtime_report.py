"""`dspark report`: loading and validation, the tables on constructed numbers, and the written report."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dspark.cli import report as report_cli
from dspark.formats.cost_tables import write_cost_table
from dspark.formats.profile import ProfilePlan, ProfileResult, ProfileSample
from dspark.formats.sts_calibration import read_calibration
from dspark.report.cost import residual_table
from dspark.report.inputs import ReportError, load_inputs, load_run
from dspark.report.markdown import TERMINOLOGY, write_report
from dspark.report.oracle import oracle_rows
from dspark.report.reliability import calibration_groups, reliability
from dspark.report.runs import missing_figures, run_summaries
from dspark.report.tau_bias import bias_by_batch_and_lag, bias_tables
from dspark.runtime.planner.cost_models import AdditiveCostTable, SpsTable, TierCostTable

GAMMA = 3
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def request(verify_len: int, correct_len: int, raw: int | None = None, slot: int = 0, *,
            confidence: bool = True, survival: bool = True) -> dict[str, Any]:
    return {"slot": slot, "generation": 1, "verify_len": verify_len, "correct_len": correct_len,
            "raw_correct_len": correct_len if raw is None else raw, "commit_len": correct_len + 1,
            "confidence": [1.0, 0.5, -0.5] if confidence else None,
            "survival": [0.7, 0.5, 0.3] if survival else None}


def step(i: int, reqs: list[dict[str, Any]], tau: float | None, committed: int, tier: int | None = None,
         mode: str = "compact") -> dict[str, Any]:
    planned = sum(r["verify_len"] for r in reqs)
    return {"step": i, "num_reqs": len(reqs), "lag": 0, "mode": mode, "budget": None if tau is None else 2,
            "aligned_budget": None, "decision_tau": tau, "planned_rows": planned, "rows": planned,
            "tier": planned if tier is None else tier, "padding_rows": 0 if tier is None else tier - planned,
            "tau": tau, "committed": committed, "predicted_step_seconds": None if tau is None else 0.01,
            "step_seconds": 0.012, "requests": reqs}


def write_run(root: Path, name: str, steps: list[dict[str, Any]], *, lag: int = 0, mode: str = "compact",
              policy: str = "greedy", tiers: list[int] | None = None, stats: dict[str, Any] | None = None,
              sts: tuple[np.ndarray, np.ndarray] | None = None) -> Path:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    base_stats = {"requests": 2, "steps": len(steps), "generated_tokens": 40, "wall_seconds": 0.5,
                  "tokens_per_second": 80.0, "mean_commit_len": 2.5}
    run = {"format": "dspark-run", "version": 1, "deployment": f"dep_{name}", "verify_mode": mode,
           "backend": "cpu", "device": "generic", "gamma": GAMMA, "lag_steps": lag, "policy": policy,
           "tiers": tiers or [], "target_only": False, "stats": {**base_stats, **(stats or {})}}
    (run_dir / "run.json").write_text(json.dumps(run))
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    if sts is not None:
        (run_dir / "sts").mkdir()
        logits, mask = sts
        half = len(logits) // 2  # two shards: the loader must concatenate them
        for k, rows in enumerate((slice(0, half), slice(half, None))):
            torch.save({"logits": torch.tensor(logits[rows], dtype=torch.float32),
                        "prefix_mask": torch.tensor(mask[rows])}, run_dir / "sts" / f"shard_{k}.pt")
        (run_dir / "sts" / "meta.json").write_text(json.dumps(
            {"policy": policy, "num_samples": len(logits), "skipped_requests": 1, "skip_reason": "capped"}))
    return run_dir


def sts_samples(seed: int = 0, n: int = 400) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = rng.normal(1.0, 1.5, size=(n, GAMMA))
    accept = rng.random((n, GAMMA)) < 1 / (1 + np.exp(-logits / 2))
    # prefix_mask[k] = k < correct_len: true until the first rejection.
    return logits, np.cumprod(accept, axis=1).astype(bool)


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path]:
    """Two compact runs with known tau/committed: lag 0 (graph tiers, STS recorded) and lag 2."""
    lag0 = write_run(tmp_path, "lag0", [
        step(0, [request(3, 2), request(1, 0, raw=1, slot=1)], tau=3.0, committed=4, tier=8),   # bias +1
        step(1, [request(2, 1), request(2, 0, raw=3, slot=1)], tau=3.5, committed=3, tier=8),   # bias -0.5
        step(2, [request(4, 3, raw=3)], tau=1.5, committed=4, tier=8),                          # bias +2.5
    ], lag=0, tiers=[8, 16], sts=sts_samples(),
        stats={"drafts_verified_by_position": [10, 6, 2], "drafts_accepted_by_position": [8, 3, 0]})
    lag2 = write_run(tmp_path, "lag2", [
        step(0, [request(2, 1), request(2, 1, slot=1)], tau=3.0, committed=4),                  # bias +1
        step(1, [request(1, 0), request(3, 1, slot=1)], tau=2.0, committed=3),                  # bias +1
    ], lag=2)
    return lag0, lag2


def write_profile(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A profile whose medians equal an additive table exactly, except +1 ms at M=16 (a tier)."""
    additive = AdditiveCostTable(bias_seconds=0.001, bs_probes=(1, 4), alpha_seconds=(0.0, 0.002),
                                 m_probes=(4, 32), theta_seconds=(0.0, 0.0028))
    samples = []
    for b in (1, 4):
        for m in range(b, b * 4 + 1, max(1, b // 2)):
            seconds = additive.step_time(b, m) + (0.001 if m == 16 else 0.0)
            samples.append(ProfileSample(b, m, (seconds, seconds, seconds)))
    plan = ProfilePlan(batch_sizes=(1, 4), num_draft_tokens=4, grid_density=4, repeats=3, m_bin=4)
    static = tuple(s for s in samples if s.num_rows == s.num_reqs * 4)
    grid = tuple(s for s in samples if s.num_rows != s.num_reqs * 4)
    result = ProfileResult(plan=plan, static=static, grid=grid, meta={"tiers": "8,16"})
    profile_path = tmp_path / "profile.json"
    result.save(profile_path)
    sps = SpsTable(sample_batch_tokens=(4, 8), sample_steps_per_sec=(400.0, 200.0), max_batch_tokens=12)
    return (profile_path, write_cost_table(tmp_path / "additive.json", additive.to_format()),
            write_cost_table(tmp_path / "sps_1d.json", sps.to_format()))


def write_bench(tmp_path: Path) -> Path:
    def row(package: str, mode: str, tps: float, ratio: float) -> dict[str, Any]:
        return {"package": package, "mode": mode, "tokens_per_s": tps, "mean_commit_len": 3.1,
                "rows_per_request_step": 3.5, "padding_rows_per_request_step": 0.0,
                "planned_rows_per_request_step": 3.5, "lossless": True,
                "predicted_tau_per_step": None if mode == "static" else 9.0,
                "committed_per_step": None if mode == "static" else 9.4,
                "ratio_to_first": ratio}

    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"prompts": 8, "max_new_tokens": 32, "max_running_requests": 4, "results": [
        row("tiny_static", "static", 100.0, 1.0), row("tiny_compact", "compact", 120.0, 1.2)]}))
    return path


# ----------------------------------------------------------------------------------------- loading


def test_load_run_reads_every_file(runs: tuple[Path, Path]) -> None:
    run = load_run(runs[0])
    assert (run.deployment, run.verify_mode, run.lag_steps, run.tiers) == ("dep_lag0", "compact", 0, (8, 16))
    assert [s.committed for s in run.steps] == [4, 3, 4]
    assert run.steps[0].requests[1].raw_correct_len == 1
    assert run.sts is not None and run.sts.logits.shape == (400, GAMMA)
    np.testing.assert_array_equal(run.sts.prefix_mask, sts_samples()[1])
    assert run.sts.skipped_requests == 1 and load_run(runs[1]).sts is None


def test_bad_steps_line_names_file_and_line(runs: tuple[Path, Path]) -> None:
    steps_file = runs[1] / "steps.jsonl"
    lines = steps_file.read_text().splitlines()
    steps_file.write_text(lines[0] + "\n" + '{"step": 1, "num_reqs": 2\n')
    with pytest.raises(ReportError, match=re.escape(f"{steps_file}:2:") + ".*not valid JSON"):
        load_run(runs[1])

    broken = json.loads(lines[1])
    broken["requests"][0]["confidence"] = [0.1]  # gamma is 3
    steps_file.write_text(lines[0] + "\n\n" + json.dumps(broken) + "\n")  # blank line still counts
    with pytest.raises(ReportError, match=re.escape(f"{steps_file}:3: requests[0]") + ".*confidence"):
        load_run(runs[1])

    broken = json.loads(lines[1])
    broken["num_reqs"] = 3
    steps_file.write_text(json.dumps(broken) + "\n")
    with pytest.raises(ReportError, match=re.escape(f"{steps_file}:1:") + ".*num_reqs is 3"):
        load_run(runs[1])


def test_bad_run_json_and_missing_steps(tmp_path: Path, runs: tuple[Path, Path]) -> None:
    run_json = runs[1] / "run.json"
    data = json.loads(run_json.read_text())
    run_json.write_text(json.dumps({**data, "verify_mode": "fast"}))
    with pytest.raises(ReportError, match=re.escape(str(run_json)) + ".*verify_mode"):
        load_run(runs[1])
    run_json.write_text(json.dumps({**data, "gamma": True}))
    with pytest.raises(ReportError, match="'gamma' must be int"):
        load_run(runs[1])
    (runs[0] / "steps.jsonl").unlink()
    with pytest.raises(ReportError, match="steps.jsonl: steps file not found"):
        load_run(runs[0])
    with pytest.raises(ReportError, match="not a run directory"):
        load_run(tmp_path / "nowhere")


# ------------------------------------------------------------------------------------------ tables


def test_run_summary_ratio_and_fallback_counts(runs: tuple[Path, Path]) -> None:
    lag0, lag2 = (load_run(p) for p in runs)
    first, second = run_summaries([lag0, lag2])
    assert first.verified == (10, 6, 2) and first.accepted_over_verified == (0.8, 0.5, 0.0)
    assert first.batch_range == (1, 2) and second.batch_range == (2, 2)
    # lag2 has no counts in its stats: counted from steps. verify_lens 2,2,1,3 -> draft 1 verified by 3
    # requests, draft 2 by one; correct_lens 1,1,0,1 -> 3 accepted at draft 1, none at draft 2.
    assert second.verified == (3, 1, 0) and second.accepted == (3, 0, 0)
    assert second.accepted_over_verified == (1.0, 0.0, None)


def test_bias_tables_on_constructed_steps(runs: tuple[Path, Path]) -> None:
    loaded = [load_run(p) for p in runs]
    tables = bias_tables(loaded)
    by_b = {r.group: r for r in tables["batch size B"]}
    # B=2 biases: +1, -0.5 (lag 0) and +1, +1 (lag 2); actual 4, 3, 4, 3.
    two = by_b["2"]
    assert two.count == 4
    assert two.mean_bias == pytest.approx(0.625)
    assert two.std == pytest.approx(math.sqrt((0.375**2 + 1.125**2 + 0.375**2 + 0.375**2) / 3))
    assert two.mean_abs == pytest.approx(0.875)
    assert two.relative_bias == pytest.approx(0.625 / 3.5)
    one = by_b["1"]
    assert (one.count, one.mean_bias, one.mean_abs) == (1, 2.5, 2.5) and math.isnan(one.std)
    by_lag = {r.group: r for r in tables["lag_steps"]}
    assert by_lag["0"].mean_bias == pytest.approx(1.0) and by_lag["2"].mean_bias == pytest.approx(1.0)
    # Only the lag-0 run replays graph tiers; its three steps all padded to 8 rows.
    assert [(r.group, r.count) for r in tables["tier"]] == [("8", 3)]
    assert [r.group for r in tables["policy"]] == ["greedy"]
    plot = bias_by_batch_and_lag(loaded)
    assert list(plot) == [0, 2] and list(plot[0]) == [1, 2]
    np.testing.assert_allclose(plot[2][2], [1.0, 1.0])


def test_static_steps_have_no_bias_rows(tmp_path: Path) -> None:
    static = write_run(tmp_path, "static", [step(0, [request(4, 3)], None, 4, mode="static")], mode="static")
    assert bias_tables([load_run(static)]) == {}
    assert oracle_rows([load_run(static)]) == []


def test_oracle_rows(runs: tuple[Path, Path]) -> None:
    lag0 = oracle_rows([load_run(runs[0])])[0]
    # N = 4. Step 0: min(3,4) + min(2,4) = 5; step 1: 2 + min(4,4) = 6; step 2: 4. Planned: 4, 4, 4.
    assert lag0.oracle_rows == pytest.approx(5.0)
    assert (lag0.planned_rows, lag0.rows, lag0.tier_rows) == (4.0, 4.0, 8.0)


def test_reliability_ece_on_known_bins() -> None:
    conf = np.array([0.8] * 10 + [0.2] * 10)
    event = np.array([True] * 8 + [False] * 2 + [True] * 5 + [False] * 5)
    rel = reliability(conf, event)
    assert rel.counts.sum() == 20 and rel.counts[int(0.8 * 15)] == 10
    assert rel.ece == pytest.approx(0.5 * 0.0 + 0.5 * 0.3)
    assert rel.brier == pytest.approx(np.mean((conf - event) ** 2))
    # 13 accepted vs 7 rejected: 0.8-vs-0.2 pairs win, equal confidences count half, 0.2-vs-0.8 lose.
    assert rel.auroc == pytest.approx((8 * 5 + 0.5 * 8 * 2 + 0.5 * 5 * 5) / (13 * 7))
    top = reliability(np.array([1.0]), np.array([True]))
    assert top.counts[-1] == 1 and top.ece == 0.0  # confidence 1.0 falls in the last bin
    assert math.isnan(reliability(np.array([]), np.array([], dtype=bool)).ece)


def test_calibration_conditional_uses_reached_rows_and_temperatures(tmp_path: Path) -> None:
    # Position 1 logit ln 4 (confidence 0.8), accepted in 8 of 10 rows; position 2 only where 1 accepted.
    logits = np.full((10, GAMMA), math.log(4.0))
    accept = np.zeros((10, GAMMA), dtype=bool)
    accept[:8, 0] = True
    accept[:4, 1] = True  # 4 of the 8 rows that reached position 2
    run_dir = write_run(tmp_path, "cal", [step(0, [request(4, 3)], 4.0, 4)], sts=(logits, accept))
    cal = tmp_path / "sts.json"
    cal.write_text(json.dumps({"temperatures": [2.0, 1.0, 1.0], "dataset": "held-out", "num_samples": 10,
                               "ece_before": [0.1, 0.2, 0.3], "ece_after": [0.01, 0.02, 0.03]}))
    inputs = load_inputs([run_dir], calibration=cal)
    (group,) = calibration_groups(inputs.runs, inputs.calibration)
    before, after = group.conditional["before"], group.conditional["after"]
    close = {"abs": 1e-6}  # the shards store float32 logits
    assert before[0].ece == pytest.approx(0.0, **close)
    assert after[0].ece == pytest.approx(abs(2 / 3 - 0.8), **close)  # sigmoid(ln 4 / 2) = 2/3
    assert before[1].num_samples == 8 and before[1].ece == pytest.approx(0.8 - 0.5, **close)
    assert before[2].num_samples == 4
    # Cumulative survival at position 2 is 0.8 * 0.8 = 0.64 against 4 of 10 rows.
    assert group.cumulative["before"][1].ece == pytest.approx(0.64 - 0.4, **close)

    cal.write_text(json.dumps({"temperatures": [1.0, 1.0]}))
    with pytest.raises(ReportError, match=re.escape(str(cal)) + ".*2 temperatures.*gamma=3"):
        calibration_groups(load_inputs([run_dir]).runs, read_calibration(cal), calibration_name=str(cal))


def test_residual_table_separates_tier_error(tmp_path: Path) -> None:
    profile_path, additive_path, sps_path = write_profile(tmp_path)
    inputs = load_inputs(profile=profile_path, tables=[additive_path, sps_path])
    samples = inputs.profile.fit_samples()

    flat = TierCostTable(tiers=(64,), bs_probes=(1,), step_seconds=((0.5,),))  # far too slow everywhere
    rows = {r.model: r for r in residual_table(samples, [*inputs.tables, ("tier", flat)], (8, 16))}
    additive = rows["additive"].fit
    assert additive.num_samples == len(samples) and rows["additive"].out_of_range == 0
    assert additive.elsewhere_mean_abs_error_seconds == pytest.approx(0.0, abs=1e-12)
    # Near-tier samples are M in 6..10 and 14..18; only M=16 (B=4) is off, by 1 ms.
    near = [m for _, m, _ in samples if abs(m - 8) <= 2 or abs(m - 16) <= 2]
    assert additive.num_boundary == len(near)
    assert additive.boundary_mean_abs_error_seconds == pytest.approx(0.001 / len(near))
    assert additive.rms_seconds == pytest.approx(math.sqrt(0.001**2 / len(samples)))
    # The SPS table stops at max_batch_tokens=12: larger M cannot be predicted.
    assert rows["sps_1d"].out_of_range == sum(m > 12 for _, m, _ in samples)
    assert rows["tier"].fit.r_squared < 0


# -------------------------------------------------------------------------------------- the report


def image_names(text: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)


def test_full_report_has_every_section_and_valid_pngs(tmp_path: Path, runs: tuple[Path, Path]) -> None:
    profile_path, additive_path, sps_path = write_profile(tmp_path)
    cal = tmp_path / "sts.json"
    cal.write_text(json.dumps({"temperatures": [2.0, 1.5, 1.2], "dataset": "held-out", "num_samples": 400}))
    out = tmp_path / "report"
    inputs = load_inputs(runs, calibration=cal, profile=profile_path, tables=[additive_path, sps_path],
                         bench=[write_bench(tmp_path)])
    text = write_report(inputs, out).read_text()
    for heading in ("## Runs", "## Calibration", "## Predicted tau vs actual", "## Cost model vs measurement",
                    "## Throughput"):
        assert heading in text
    assert "accepted / verified drafts" in text and "0.80 0.50 0.00" in text
    assert "oracle rows / step" in text and "tiny_compact" in text
    # Every row of a Markdown table has as many cell borders as its header: a bare "|" inside a cell (or a
    # header) would split it.
    width = None
    for line in text.splitlines():
        if not line.startswith("|"):
            width = None
            continue
        borders = len(re.findall(r"(?<!\\)\|", line))
        width = width or borders
        assert borders == width, line
    names = image_names(text)
    assert sorted(names) == sorted(["calibration_conditional_greedy-g3.png",
                                    "calibration_cumulative_greedy-g3.png", "tau_bias_by_batch.png",
                                    "cost_model_vs_measured.png", "throughput.png"])
    for name in names:
        data = (out / name).read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_SIGNATURE)
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, "report.md"])  # no temp files left


def test_acceptance_rate_never_describes_tau(tmp_path: Path, runs: tuple[Path, Path]) -> None:
    text = write_report(load_inputs(runs, bench=[write_bench(tmp_path)]), tmp_path / "out").read_text()
    assert "tau" in text
    assert "acceptance rate" not in text.lower()
    # The terminology note is stated once.
    assert text.count(TERMINOLOGY) == 1


def test_missing_inputs_drop_their_sections(tmp_path: Path) -> None:
    static = write_run(tmp_path, "static", [step(0, [request(4, 3)], None, 4, mode="static")], mode="static")
    out = tmp_path / "out"
    text = write_report(load_inputs([static]), out).read_text()
    assert "## Runs" in text
    for heading in ("## Calibration", "## Predicted tau", "## Cost model", "## Throughput"):
        assert heading not in text
    assert image_names(text) == [] and [p.name for p in out.iterdir()] == ["report.md"]

    # A compact run without STS, profile or bench: tau and the oracle rows, no calibration or cost model.
    compact = write_run(tmp_path, "compact", [step(0, [request(2, 1)], 1.8, 2)])
    text = write_report(load_inputs([compact]), tmp_path / "out2").read_text()
    assert "## Predicted tau" in text and "## Throughput" in text and "oracle rows / step" in text
    assert "## Calibration" not in text and "## Cost model" not in text and "tokens/s by package" not in text


def test_a_static_recording_without_survival_reports_what_it_can_and_says_why(tmp_path: Path) -> None:
    # As static runs recorded before they computed survival: confidence and STS shards, no survival, no tau.
    static = write_run(tmp_path, "static", [
        step(i, [request(4, 3, survival=False), request(4, 1, slot=1, survival=False)], None, 6,
             mode="static") for i in range(3)], mode="static", sts=sts_samples())
    assert load_run(static).steps[0].requests[0].survival is None
    text = write_report(load_inputs([static]), tmp_path / "out").read_text()
    assert "## Runs" in text and "## Calibration" in text and "calibration_cumulative_greedy-g3.png" in text
    assert "## Predicted tau" not in text
    assert "`static`: no planner ran (static verification), so its steps have no predicted tau" in text
    assert "`static`: the steps record confidence but no survival" in text


def test_a_draft_without_a_confidence_head_reports_what_it_can_and_says_why(tmp_path: Path) -> None:
    # No confidence head: no confidence or survival per request, no STS shards, no planner.
    plain = write_run(tmp_path, "plain", [
        step(0, [request(4, 2, confidence=False, survival=False)], None, 3, mode="static")], mode="static")
    inputs = load_inputs([plain])
    assert missing_figures(inputs.runs) == [
        "`plain`: no planner ran (static verification), so its steps have no predicted tau and it is not in "
        "the tau-vs-actual figures.",
        "`plain`: the draft has no confidence head, so the steps record no confidence or survival and the "
        "run has no calibration figures.",
        "`plain`: no STS samples (`sts/` is missing or holds no shards), so it adds nothing to the "
        "reliability diagrams."]
    text = write_report(inputs, tmp_path / "out").read_text()
    assert "What these recordings cannot show:" in text and "the draft has no confidence head" in text
    # What the steps do show: drafts 1 and 2 of 3 accepted, all three verified.
    assert "| plain | 1 1 1 | 1 1 0 | 1.00 1.00 0.00 |" in text


def test_a_complete_recording_has_nothing_missing(runs: tuple[Path, Path]) -> None:
    assert missing_figures([load_run(runs[0])]) == []


def test_failed_render_leaves_no_report(tmp_path: Path, runs: tuple[Path, Path],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from dspark.report import plots as report_plots

    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("plot failed")

    monkeypatch.setattr(report_plots, "plot_bias_by_batch", boom)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="plot failed"):
        write_report(load_inputs(runs), out)
    assert not (out / "report.md").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dspark")
    report_cli.add_report_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_writes_report_and_reports_bad_input(tmp_path: Path, runs: tuple[Path, Path],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    profile_path, additive_path, sps_path = write_profile(tmp_path)
    out = tmp_path / "out"
    args = parse(["report", str(runs[0]), str(runs[1]), "-o", str(out), "--profile", str(profile_path),
                  "--tables", str(additive_path), str(sps_path)])
    assert args.handler is report_cli.run_report
    assert report_cli.run_report(args) == 0
    assert (out / "report.md").is_file() and "wrote" in capsys.readouterr().out

    (runs[1] / "steps.jsonl").write_text("not json\n")
    assert report_cli.run_report(parse(["report", str(runs[1]), "-o", str(tmp_path / "bad")])) == 2
    err = capsys.readouterr().err
    assert f"{runs[1] / 'steps.jsonl'}:1:" in err
    assert not (tmp_path / "bad").exists()  # inputs are validated before anything is written
    assert report_cli.run_report(parse(["report", "-o", str(out)])) == 2
    assert "nothing to report" in capsys.readouterr().err
