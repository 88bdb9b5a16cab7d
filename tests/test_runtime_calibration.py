"""STS calibration: metrics against brute force, the planner's survival on recorded logits, the sequential
fit, the calibration file it writes, and `dspark calibrate` (shard IO: tests/test_formats_sts_shards.py)."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark import atomic
from dspark.cli.calibrate import add_calibrate_parser, run_calibrate
from dspark.formats.sts_calibration import calibration_json, read_calibration
from dspark.formats.sts_shards import StsData, write_shard
from dspark.measure.calibration import (
    calibration_payload,
    fit_sts,
    format_fit_report,
    save_calibration,
)
from dspark.measure.scores import confidence, survival
from dspark.runtime.planner.calibration_metrics import brier, ece, roc_auc
from dspark.runtime.planner.sts import CalibrationError, default_grid
from dspark.runtime.planner.survival import survival_from_logits
from dspark.runtime.planner.survival_map import knot_count

FACTORS = (2.0, 0.5, 3.0)
GRID_STEP = math.log(10 ** 0.05)  # ratio between neighbours of the default 41-point grid over [0.1, 10]


def synthetic(n: int, factors: tuple[float, ...] = FACTORS, seed: int = 0) -> StsData:
    """True conditional acceptance sigmoid(z_true); the head reports z_true * a_k, so T_k = a_k fixes it."""
    rng = np.random.default_rng(seed)
    z_true = rng.normal(1.5, 2.5, size=(n, len(factors)))
    # The prefix continues past draft k with probability sigmoid(z_true[k]) and stops at the first failure.
    continues = rng.random(z_true.shape) < 1.0 / (1.0 + np.exp(-z_true))
    return StsData(z_true * np.array(factors), np.cumprod(continues, axis=1).astype(bool))


# ------------------------------------------------------------------------------------------- metrics


def brute_ece(p: np.ndarray, y: np.ndarray, bins: int) -> float:
    total = 0.0
    for i in range(bins):
        lo, hi = i / bins, (i + 1) / bins
        members = [j for j in range(len(p)) if lo <= p[j] < hi or (i == bins - 1 and p[j] == 1.0)]
        if members:
            gap = abs(np.mean([float(y[j]) for j in members]) - np.mean([p[j] for j in members]))
            total += len(members) / len(p) * gap
    return total


@pytest.mark.parametrize("bins", [1, 7, 15])
def test_ece_matches_a_brute_force_binning_including_edges(bins: int) -> None:
    rng = np.random.default_rng(bins)
    edges = [i / bins for i in range(bins + 1)]  # bin boundaries exactly, 0.0 and 1.0 included
    p = np.concatenate([rng.random(300), edges, edges])
    y = rng.random(p.shape[0]) < p
    assert ece(p, y, bins) == pytest.approx(brute_ece(p, y, bins), abs=1e-12)
    assert ece(p, y.astype(int), bins) == ece(p, y, bins)


def test_ece_is_the_gap_per_bin() -> None:
    # A bin of predictions 0.3 with 30% positives is calibrated; a bin at 0.9 with none is off by 0.9.
    assert ece([0.3] * 10, [1, 1, 1] + [0] * 7) == pytest.approx(0.0, abs=1e-15)
    assert ece([0.9] * 4, [0] * 4) == pytest.approx(0.9)
    assert ece([0.3] * 10 + [0.9] * 10, [1, 1, 1] + [0] * 17) == pytest.approx(0.45)


def test_brier_matches_its_definition() -> None:
    rng = np.random.default_rng(1)
    p, y = rng.random(50), rng.random(50) < 0.5
    assert brier(p, y) == pytest.approx(sum((pi - yi) ** 2 for pi, yi in zip(p, y, strict=True)) / 50)
    assert brier([1.0, 0.0], [True, False]) == 0.0


def test_roc_auc_matches_the_pairwise_count_with_ties() -> None:
    rng = np.random.default_rng(2)
    for trial in range(5):
        scores = rng.integers(0, 4 + trial, size=60).astype(float)  # few distinct values: many ties
        labels = rng.random(60) < 0.4
        pos, neg = scores[labels], scores[~labels]
        pairs = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in itertools.product(pos, neg))
        assert roc_auc(scores, labels) == pytest.approx(pairs / (len(pos) * len(neg)), abs=1e-12)
    assert roc_auc([0.1, 0.2, 0.3], [0, 1, 1]) == 1.0
    assert roc_auc([0.5, 0.5], [0, 1]) == 0.5


def test_roc_auc_is_none_not_nan_with_one_class() -> None:
    assert roc_auc([0.1, 0.9], [1, 1]) is None
    assert roc_auc([0.1, 0.9], [False, False]) is None


@pytest.mark.parametrize("call", [
    lambda: ece([0.5, 1.2], [0, 1]),
    lambda: ece([0.5, 0.5], [0, 2]),
    lambda: ece([0.5], [0, 1]),
    lambda: ece([0.5], [1], num_bins=0),
    lambda: brier([float("nan")], [1]),
    lambda: roc_auc([], []),
])
def test_metrics_reject_malformed_input(call) -> None:
    with pytest.raises(ValueError):
        call()


# ------------------------------------------------------------------------------------------ survival


def test_survival_is_the_cumulative_product_of_tempered_sigmoids() -> None:
    z = np.array([[0.5, -1.0, 2.0], [3.0, 0.0, -0.25]])
    temps = [2.0, 0.5, 1.5]
    for r in range(2):
        running = 1.0
        for k in range(3):
            conditional = 1.0 / (1.0 + math.exp(-z[r, k] / temps[k]))
            running *= conditional
            # The planner's function computes it (in float32 for the planner's float32 logits).
            assert survival(z, temps)[r, k] == pytest.approx(running, rel=1e-6)
            assert confidence(z, temps)[r, k] == pytest.approx(conditional, rel=1e-6)
    planner = survival_from_logits(torch.from_numpy(z), temps).double().numpy()
    assert np.array_equal(survival(z, temps), planner)


def test_survival_is_stable_for_extreme_logits() -> None:
    z = np.array([[1000.0, -1000.0, 5.0], [-800.0, 800.0, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow would warn
        s = survival(z, [0.1, 0.1, 1.0])
    assert np.isfinite(s).all() and s[0, 0] == 1.0 and s[0, 1] == 0.0 and s[1, 0] == 0.0
    assert (np.diff(s, axis=1) <= 0).all()


@pytest.mark.parametrize("temps", [[1.0, 0.0, 1.0], [1.0, -2.0, 1.0], [1.0, 1.0], [1.0, math.inf, 1.0]])
def test_survival_rejects_bad_temperatures(temps) -> None:
    with pytest.raises(ValueError, match="temperatures"):
        survival(np.zeros((2, 3)), temps)


# ----------------------------------------------------------------------------------------------- fit


def test_fit_recovers_the_known_miscalibration_factors() -> None:
    data = synthetic(40_000)
    fit = fit_sts(data)
    assert fit.num_samples == 40_000 and fit.gamma == 3
    for k, a in enumerate(FACTORS):
        assert abs(math.log(fit.temperatures[k] / a)) <= GRID_STEP, (k, fit.temperatures[k], a)
        assert fit.ece_after[k] <= 0.02
        assert fit.ece_before[k] >= 0.03 and fit.ece_before[k] > 2.5 * fit.ece_after[k]
        assert fit.brier_after[k] < fit.brier_before[k]
        assert fit.conditional_ece_after[k] < fit.conditional_ece_before[k]
        assert fit.reach_rate[k] == pytest.approx(data.prefix_mask[:, k].mean())
        # calibrated survival averages to the observed reach rate
        assert fit.mean_survival_after[k] == pytest.approx(fit.reach_rate[k], abs=0.02)
    # A temperature is monotone on one position, so position 0's ranking cannot change (up to the few
    # neighbouring scores that the survival's float32 rounds together or apart).
    assert fit.auc_after[0] == pytest.approx(fit.auc_before[0], abs=1e-6)
    assert fit.conditional_rows[0] == 40_000 and fit.conditional_rows[1] == data.prefix_mask[:, 0].sum()


def test_each_temperature_is_the_grid_minimiser_given_the_earlier_ones() -> None:
    data = synthetic(3_000, factors=(1.7, 0.8, 2.5, 1.2), seed=5)
    grid = default_grid(17, 0.2, 5.0)
    fit = fit_sts(data, grid=grid, num_bins=10)
    for k in range(data.gamma):
        eces = [ece(survival(data.logits[:, :k + 1], [*fit.temperatures[:k], t])[:, k],
                    data.prefix_mask[:, k], 10) for t in grid]
        assert fit.temperatures[k] == grid[int(np.argmin(eces))]
        assert fit.ece_after[k] == pytest.approx(min(eces), abs=1e-15)
    assert fit.ece_before == pytest.approx(
        [ece(survival(data.logits, [1.0] * 4)[:, k], data.prefix_mask[:, k], 10) for k in range(4)])
    # Left to right: later positions never change an earlier position's temperature.
    head = fit_sts(StsData(data.logits[:, :2], data.prefix_mask[:, :2]), grid=grid, num_bins=10)
    assert head.temperatures == fit.temperatures[:2]


def test_ties_keep_the_smaller_temperature() -> None:
    rng = np.random.default_rng(3)
    z = np.stack([rng.normal(0, 2, 500), np.zeros(500)], axis=1)
    # sigmoid(0 / T) = 0.5 for every T: position 1's survival, hence its ECE, is the same across the grid.
    mask = np.cumprod(rng.random((500, 2)) < 0.6, axis=1).astype(bool)
    fit = fit_sts(StsData(z, mask), grid=[3.0, 0.7, 1.5, 0.4])  # given unsorted on purpose
    assert fit.temperatures[1] == 0.4
    assert fit.grid == (0.4, 0.7, 1.5, 3.0)
    mask3 = np.cumprod(rng.random((50, 3)) < 0.6, axis=1).astype(bool)
    all_zero = fit_sts(StsData(np.zeros((50, 3)), mask3))
    assert all_zero.temperatures == (0.1, 0.1, 0.1)


def test_fit_rejects_bad_settings() -> None:
    data = synthetic(100)
    for grid in ([], [1.0, -1.0], [float("nan")]):
        with pytest.raises(CalibrationError, match="grid"):
            fit_sts(data, grid=grid)
    with pytest.raises(CalibrationError, match="num_bins"):
        fit_sts(data, num_bins=0)
    with pytest.raises(CalibrationError, match="no recorded rows"):
        fit_sts(StsData(np.zeros((0, 2)), np.zeros((0, 2), dtype=bool)))
    with pytest.raises(CalibrationError, match="t_min"):
        default_grid(41, 0.0, 10.0)


# -------------------------------------------------------------------------------- calibration JSON


def test_calibration_json_round_trip_with_sglang_fields(tmp_path: Path) -> None:
    fit = fit_sts(synthetic(2_000))
    out = save_calibration(tmp_path / "sts.json", fit, "gsm8k",
                           extra={"fingerprint": {"draft": "abc123"}, "policy": "greedy"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sts.json"]  # no temp file left behind
    raw = json.loads(out.read_text())
    # The five fields SGLang's DSparkStsCalibration reads, with its types, first.
    assert list(raw)[:5] == ["temperatures", "dataset", "num_samples", "ece_before", "ece_after"]
    assert raw["temperatures"] == list(fit.temperatures)
    assert all(type(t) is float for t in raw["temperatures"])
    assert raw["dataset"] == "gsm8k" and type(raw["num_samples"]) is int and raw["num_samples"] == 2_000
    assert raw["ece_before"] == list(fit.ece_before) and raw["ece_after"] == list(fit.ece_after)
    assert raw["brier_after"] == list(fit.brier_after) and raw["auc_after"] == list(fit.auc_after)
    assert raw["num_bins"] == 15 and raw["grid"] == list(fit.grid) and len(raw["grid"]) == 41
    assert raw["fingerprint"] == {"draft": "abc123"} and raw["policy"] == "greedy"
    assert calibration_json(read_calibration(out)) == raw == calibration_payload(fit, "gsm8k", {
        "policy": "greedy", "fingerprint": {"draft": "abc123"}})


def test_auc_none_is_written_as_null(tmp_path: Path) -> None:
    # Nobody reaches draft 1: one class only, AUC undefined.
    data = StsData(np.random.default_rng(0).normal(size=(40, 2)), np.zeros((40, 2), dtype=bool))
    out = save_calibration(tmp_path / "sts.json", fit_sts(data), "x")
    assert json.loads(out.read_text())["auc_after"] == [None, None]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path, monkeypatch) -> None:
    fit = fit_sts(synthetic(500))
    target = tmp_path / "sts.json"
    target.write_text("old")

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        save_calibration(target, fit, "x")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sts.json"]


def test_extra_adds_only_the_policy_and_fingerprint_and_only_strict_json(tmp_path: Path) -> None:
    fit = fit_sts(synthetic(200))
    with pytest.raises(CalibrationError, match=r"extra keys \['temperatures'\] are not fields"):
        save_calibration(tmp_path / "a.json", fit, "x", extra={"temperatures": [1.0]})
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        save_calibration(tmp_path / "a.json", fit, "x", extra={"fingerprint": {"bad": float("nan")}})
    with pytest.raises(CalibrationError, match="dataset must be a string"):
        save_calibration(tmp_path / "a.json", fit, 3)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------- report


def test_report_has_a_row_per_position_and_never_says_acceptance_rate() -> None:
    fit = fit_sts(synthetic(2_000))
    report = format_fit_report(fit)
    rows = [line for line in report.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r.split()[0]) for r in rows] == [0, 1, 2]
    for k, row in enumerate(rows):
        assert f"{fit.temperatures[k]:.4f}" in row and f"{fit.ece_after[k]:.4f}" in row and "→" in row
    assert "acceptance rate" not in report.lower() and "edge of the grid" not in report
    # Raw logits 50x too sharp need T = 50, beyond the default grid: the report says so.
    edge = fit_sts(synthetic(2_000, factors=(50.0,)))
    assert edge.temperatures == (10.0,) and "edge of the grid for position(s) [0]" in format_fit_report(edge)


def test_report_names_the_recorded_policy_of_the_labels() -> None:
    fit = fit_sts(synthetic(500))
    assert "greedy prefix matches" in format_fit_report(fit, "greedy")
    sampled = format_fit_report(fit, "sample:temperature=0.8,top_p=0.95,top_k=0")
    assert "acceptance events of sample:temperature=0.8" in sampled and "greedy" not in sampled
    assert "unknown" in format_fit_report(fit)


# ------------------------------------------------------------------------------------------------ CLI


def calibrate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dspark")
    add_calibrate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["calibrate", *argv])
    assert args.command == "calibrate"
    return run_calibrate(args)


def test_cli_fits_prints_and_writes(tmp_path: Path, capsys) -> None:
    data = synthetic(4_000)
    shards = tmp_path / "mtbench"
    write_shard(shards / "r.0.pt", data.logits[:1_000], data.prefix_mask[:1_000])
    write_shard(shards / "r.1.pt", data.logits[1_000:], data.prefix_mask[1_000:])
    out = tmp_path / "out" / "sts.json"
    assert calibrate([str(shards), "-o", str(out), "--grid-points", "21", "--bins", "10"]) == 0
    printed = capsys.readouterr().out
    written = read_calibration(out)
    assert written.dataset == "mtbench" and written.num_samples == 4_000
    assert written.num_bins == 10 and written.grid is not None and len(written.grid) == 21
    assert f"{written.temperatures[2]:.4f}" in printed and str(out) in printed
    assert calibrate([str(shards / "r.0.pt"), "-o", str(out), "--dataset", "named"]) == 0
    assert read_calibration(out).dataset == "named"
    # with the survival map: the file carries it, and the metrics "after" are the planner's, map included
    assert read_calibration(out).survival_map is None
    assert calibrate([str(shards), "-o", str(out), "--survival-map", "8"]) == 0
    mapped = read_calibration(out)
    assert mapped.survival_map is not None and len(mapped.survival_map.x[0]) == knot_count(8)
    from dspark.runtime.planner.survival_map import SurvivalMap

    planner = SurvivalMap.from_knots(mapped.survival_map).apply(survival(data.logits, mapped.temperatures))
    assert mapped.ece_after == pytest.approx([ece(planner[:, k], data.prefix_mask[:, k]) for k in range(3)])
    assert f"monotone survival map of {knot_count(8)} knots" in capsys.readouterr().out


def test_cli_carries_the_recordings_policy_and_fingerprint(tmp_path: Path, capsys) -> None:
    data = synthetic(500)
    shards = tmp_path / "run" / "sts"
    write_shard(shards / "shard-00000.pt", data.logits, data.prefix_mask)
    (shards / "meta.json").write_text(json.dumps({"policy": "greedy", "fingerprint": {"draft": "d"}}))
    out = tmp_path / "sts.json"
    assert calibrate([str(shards), "-o", str(out)]) == 0
    written = read_calibration(out)
    assert (written.policy, written.fingerprint, written.dataset) == ("greedy", {"draft": "d"}, "run")
    assert "greedy prefix matches" in capsys.readouterr().out
    other = tmp_path / "other" / "sts"
    write_shard(other / "shard-00000.pt", data.logits, data.prefix_mask)
    (other / "meta.json").write_text(json.dumps({"policy": "sample:temperature=0.8,top_p=1.0,top_k=0"}))
    assert calibrate([str(shards), str(other), "-o", str(tmp_path / "mixed.json")]) == 2
    assert "different policies or deployments" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [[], ["--t-min", "0"], ["--bins", "0"], ["--grid-points", "0"],
                                   ["--survival-map", "-1"]])
def test_cli_bad_input_exits_2_and_writes_nothing(tmp_path: Path, capsys, flags: list[str]) -> None:
    shards = tmp_path / "shards"
    write_shard(shards / "a.pt", np.zeros((4, 2)), np.zeros((4, 2), dtype=bool))
    if not flags:  # the bad input is a shard
        torch.save({"logits": torch.zeros(4, 2)}, shards / "b.pt")
    out = tmp_path / "sts.json"
    assert calibrate([str(shards), "-o", str(out), *flags]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("dspark calibrate: error:") and captured.out == ""
    if not flags:
        assert str(shards / "b.pt") in captured.err
    assert not out.exists()
