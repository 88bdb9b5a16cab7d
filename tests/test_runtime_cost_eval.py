"""Cost models judged by the budgets they make the planner choose (dspark.measure.cost_eval)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.cli.cost_eval import add_cost_eval_parser, run_cost_eval
from dspark.formats.profile import ProfileError, ProfilePlan, ProfileResult, ProfileSample
from dspark.measure.cost_eval import (
    MeasuredSteps,
    evaluate_cost_models,
    fit_all_models,
    format_cost_eval,
)
from dspark.measure.cost_fit import fit_additive, fit_tier_table
from dspark.measure.residuals import model_fit_quality
from dspark.measure.tiers import TIER_RADIUS
from dspark.runtime.planner.budget import ScheduleConfig
from dspark.runtime.planner.cost_models import AdditiveCostTable, TierCostTable

REPO = Path(__file__).resolve().parents[1]
TIERS = (8, 16, 32, 64)


def tier_law(num_reqs: int, num_rows: int) -> float:
    """Graph replay: the step costs its tier, plus a per-request term."""
    tier = min(t for t in TIERS if t >= num_rows)
    return 0.001 + 0.0001 * num_reqs + 0.00005 * tier


def linear_law(num_reqs: int, num_rows: int) -> float:
    return 0.002 + 0.0002 * num_reqs + 0.00004 * num_rows


def profile_of(law, rows_of, meta: dict[str, str] | None = None, batch_sizes=(1, 2, 4, 8)) -> ProfileResult:
    """A profile whose every sample is `law` exactly, measured at `rows_of(B)` besides the static B·N."""
    plan = ProfilePlan(batch_sizes=batch_sizes, num_draft_tokens=8, max_rows=64, m_bin=8)
    static = tuple(ProfileSample(b, b * 8, (law(b, b * 8),) * 3) for b in plan.static_batch_sizes)
    grid = tuple(ProfileSample(b, m, (law(b, m),))
                 for b in plan.batch_sizes for m in rows_of(b) if m != b * 8)
    return ProfileResult(plan, static, grid, meta or {})


def dense_rows(num_reqs: int) -> range:
    return range(num_reqs, min(num_reqs * 8, 64) + 1)


TIERED = profile_of(tier_law, dense_rows, {"tiers": ",".join(map(str, TIERS))})


def synthetic_survival(n: int = 400, gamma: int = 7, seed: int = 1) -> np.ndarray:
    confidence = np.random.default_rng(seed).beta(3.0, 1.2, size=(n, gamma))
    return np.cumprod(confidence, axis=1)


def near_a_tier(num_rows: int) -> bool:
    return any(abs(num_rows - t) <= TIER_RADIUS for t in TIERS)


# --- fit_tier_table --------------------------------------------------------------------------------------


def test_tier_fit_recovers_the_tier_law_where_the_additive_fit_misses_the_cliffs() -> None:
    fit = fit_tier_table(TIERED, TIERS)
    for num_reqs, num_rows, _ in TIERED.fit_samples():
        assert fit.table.step_time(num_reqs, num_rows) == tier_law(num_reqs, num_rows)
    assert fit.r_squared == 1.0 and fit.rms_seconds == 0.0 and fit.max_relative_error == 0.0
    assert len(fit.residuals) == len(TIERED.fit_samples())

    additive = fit_additive(TIERED.fit_samples(), m_bin=8)
    assert additive.r_squared < 0.99
    worst = max(additive.residuals, key=lambda r: abs(r.residual_seconds))
    assert near_a_tier(worst.num_rows), (worst.num_reqs, worst.num_rows)
    quality = model_fit_quality(additive.table, TIERED.fit_samples(), TIERS)
    assert quality.boundary_mean_abs_error_seconds > 1.5 * quality.elsewhere_mean_abs_error_seconds
    assert quality.num_boundary == sum(near_a_tier(m) for _, m, _ in TIERED.fit_samples())


def test_tier_fit_fills_unmeasured_cells_from_the_nearest_batch_size_of_the_same_tier() -> None:
    fit = fit_tier_table(TIERED, TIERS)
    # B=1 never exceeds 8 rows, B=2 16, B=4 32: their higher tiers are copied within the column.
    assert set(fit.filled) == {(1, 16, 2), (1, 32, 4), (2, 32, 4), (1, 64, 8), (2, 64, 8), (4, 64, 8)}
    assert fit.table.step_time(1, 20) == tier_law(4, 20)
    assert "tier 32: no sample at B=1, 2; copied from B=4" in fit.notes


def test_tier_fit_takes_the_median_of_the_samples_in_a_tier() -> None:
    # Rows 9..16 measured at 1, 2 and 9 ms: the tier's cell is their median, not their mean.
    seconds = {9: 0.001, 12: 0.002, 16: 0.009, 4: 0.0005}
    plan = ProfilePlan(batch_sizes=(2,), num_draft_tokens=8, max_rows=16)
    result = ProfileResult(plan, (ProfileSample(2, 16, (seconds[16],)),),
                           tuple(ProfileSample(2, m, (s,)) for m, s in seconds.items() if m != 16))
    fit = fit_tier_table(result, (8, 16))
    assert fit.table.step_seconds == ((0.0005, 0.002),) and fit.filled == ()


def test_tier_fit_errors_and_notes() -> None:
    with pytest.raises(ValueError, match=r"tiers 128 \(M in \(64, 128\]\) have no profiled sample"):
        fit_tier_table(TIERED, (*TIERS, 128))
    with pytest.raises(ValueError, match=r"tiers must be strictly increasing: item 1 \(8\) follows 16"):
        fit_tier_table(TIERED, (16, 8))
    with pytest.raises(ValueError, match="tiers is empty"):
        fit_tier_table(TIERED, ())
    fit = fit_tier_table(TIERED, (8, 16))
    assert fit.table.max_rows == 16
    assert any("samples above the last tier 16" in note for note in fit.notes)
    assert all(r.num_rows <= 16 for r in fit.residuals)


# --- measured step times ---------------------------------------------------------------------------------


def test_measured_steps_never_interpolate_across_a_tier_boundary() -> None:
    steps = MeasuredSteps(2, (4, 8, 12, 16), (1.0, 2.0, 5.0, 6.0), tiers=(8, 16))
    got = steps.seconds_at([3, 4, 6, 8, 10, 14, 16, 17])
    assert got[1] == 1.0 and got[2] == 1.5 and got[3] == 2.0 and got[5] == 5.5 and got[6] == 6.0
    # 3 and 17 are outside the measurements; 10 lies between 8 (tier 8) and 12 (tier 16).
    assert np.isnan(got[[0, 4, 7]]).all()
    plain = MeasuredSteps(2, (4, 8, 12, 16), (1.0, 2.0, 5.0, 6.0))
    assert plain.seconds_at([10])[0] == 3.5
    with pytest.raises(ValueError, match="measured rows must be strictly increasing"):
        MeasuredSteps(2, (8, 4), (1.0, 1.0))


def test_a_profile_reads_its_tiers_from_the_meta() -> None:
    assert TIERED.tiers == TIERS
    assert profile_of(linear_law, dense_rows).tiers == ()
    with pytest.raises(ProfileError, match="meta.tiers is '8,x'; expected comma-separated"):
        profile_of(linear_law, dense_rows, {"tiers": "8,x"})
    with pytest.raises(ProfileError, match="strictly increasing"):
        profile_of(linear_law, dense_rows, {"tiers": "16,8"})


# --- evaluate_cost_models --------------------------------------------------------------------------------


def test_on_a_tiered_profile_the_tier_model_has_no_regret_and_the_additive_one_does() -> None:
    models = fit_all_models(TIERED, m_bin=8)
    assert set(models) == {"sps-1d", "additive", "tier"}
    report = evaluate_cost_models(TIERED, models, synthetic_survival(), ScheduleConfig(gamma=7),
                                  draws_per_batch=24, seed=3)
    tier, additive = report.model("tier"), report.model("additive")
    # The fitted tier table equals the measured law at every M, so it picks the measured optimum.
    assert tier.regret.max == 0.0 and tier.regret.count == 4 * 24
    assert additive.regret.mean >= tier.regret.mean and additive.regret.max > 1.0
    for b in report.batches:
        assert tier.batch(b.num_reqs).mean_rows == b.optimal_mean_rows
    assert [(b.num_reqs, b.min_rows, b.max_rows) for b in report.batches] == [
        (1, 1, 8), (2, 2, 16), (4, 4, 32), (8, 8, 64)]
    assert tier.fit.r_squared == 1.0 and additive.fit.boundary_mean_abs_error_seconds > 0


def test_regret_is_zero_when_the_model_equals_the_measured_law_between_measurements() -> None:
    # Sparse rows and no tiers: the measured side interpolates, as the additive table does.
    sparse = profile_of(linear_law, lambda b: (b, 2 * b, 5 * b, min(8 * b, 64)))
    exact = AdditiveCostTable(0.002, (1, 8), (0.0002, 0.0016), (1, 64), (0.00004, 0.00256))
    assert exact.step_time(3, 17) == pytest.approx(linear_law(3, 17))
    wrong = AdditiveCostTable(0.0, (1, 8), (0.0, 0.0), (1, 64), (0.0001, 0.05))  # rows far too dear
    report = evaluate_cost_models(sparse, {"exact": exact, "wrong": wrong}, synthetic_survival(),
                                  ScheduleConfig(gamma=7), draws_per_batch=16)
    assert report.model("exact").regret.max < 1e-9
    assert report.model("wrong").regret.mean > 1.0
    # Without tiers no sample is near one: the whole fit error is "elsewhere".
    fit = report.model("exact").fit
    assert report.tiers == () and fit.boundary_mean_abs_error_seconds is None and fit.num_boundary == 0
    assert fit.num_elsewhere == fit.num_samples and fit.elsewhere_mean_abs_error_seconds < 1e-12


def test_budgets_stop_where_the_measurements_cannot_be_read() -> None:
    # B=8 measured at 8..16 and 30..64 only: rows 17..29 lie in tier 32 with no measurement of that tier
    # below them (the one at 16 belongs to tier 16), so they cannot be read.
    gappy = profile_of(tier_law, lambda b: [m for m in dense_rows(b) if b != 8 or not 16 < m < 30],
                       {"tiers": ",".join(map(str, TIERS))})
    models = {"tier": fit_tier_table(gappy, TIERS).table}
    report = evaluate_cost_models(gappy, models, synthetic_survival(), ScheduleConfig(gamma=7),
                                  draws_per_batch=4)
    assert [b.max_rows for b in report.batches if b.num_reqs == 8] == [16]
    assert any("B=8: budgets stop at M=16; M=17 has no measurement" in note for note in report.notes)
    assert report.model("tier").batch(8).mean_rows <= 16


def test_draws_are_seeded_and_draft_terms_are_left_out() -> None:
    table = fit_tier_table(TIERED, TIERS).table
    with_draft = TierCostTable(table.tiers, table.bs_probes, table.step_seconds, draft_bs_probes=(1,),
                               draft_seconds=(0.05,))
    cfg = ScheduleConfig(gamma=7)
    first = evaluate_cost_models(TIERED, {"t": with_draft}, synthetic_survival(), cfg, draws_per_batch=8,
                                 seed=5)
    again = evaluate_cost_models(TIERED, {"t": table}, synthetic_survival(), cfg, draws_per_batch=8,
                                 seed=5)
    assert first.models[0].by_batch == again.models[0].by_batch
    assert any("draft terms of ['t'] are left out" in note for note in first.notes)


def test_bad_arguments_are_errors() -> None:
    cfg = ScheduleConfig(gamma=7)
    with pytest.raises(ValueError, match="models is empty"):
        evaluate_cost_models(TIERED, {}, synthetic_survival(), cfg)
    with pytest.raises(TypeError, match=r"models\['x'\] must be an SpsTable"):
        evaluate_cost_models(TIERED, {"x": object()}, synthetic_survival(), cfg)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="draws_per_batch must be an integer >= 1"):
        evaluate_cost_models(TIERED, fit_all_models(TIERED), synthetic_survival(), cfg, draws_per_batch=0)
    with pytest.raises(ValueError, match=r"survival must be \[B, gamma=7\]"):
        evaluate_cost_models(TIERED, fit_all_models(TIERED), synthetic_survival(gamma=3), cfg)
    rising = synthetic_survival()[:, ::-1]  # a negative-stride view, which torch cannot wrap as is
    with pytest.raises(ValueError, match="non-increasing"):
        evaluate_cost_models(TIERED, fit_all_models(TIERED), rising, cfg)


def test_the_real_cpu_profile_gives_a_well_formed_report() -> None:
    result = ProfileResult.load(REPO / "specs/tables/tiny_cpu_tiers/profile.json")
    models = fit_all_models(result, m_bin=16)
    report = evaluate_cost_models(result, models, torch.from_numpy(synthetic_survival()),
                                  ScheduleConfig(gamma=result.plan.num_draft_tokens - 1), draws_per_batch=6)
    assert [m.name for m in report.models] == ["sps-1d", "additive", "tier"]
    assert report.tiers == result.tiers and len(report.batches) == len(result.plan.batch_sizes)
    for model in report.models:
        assert 0.0 <= model.regret.p50 <= model.regret.p90 <= model.regret.max <= 100.0
        assert all(0.0 <= entry.regret.mean <= 100.0 for entry in model.by_batch)
        assert model.fit.num_samples + model.fit.num_outside == len(result.fit_samples())
    text = format_cost_eval(report)
    for expected in ("sps-1d", "additive", "tier", "regret %", "boundary ms (n)"):
        assert expected in text
    assert json.loads(json.dumps(report.to_json()))["models"][2]["kind"] == "tier"


# --- dspark cost-eval ------------------------------------------------------------------------------------


def cli(tmp_path: Path, *argv: str) -> int:
    parser = argparse.ArgumentParser(prog="dspark")
    add_cost_eval_parser(parser.add_subparsers(dest="command"))
    return run_cost_eval(parser.parse_args(["cost-eval", *argv]))


def write_shard(path: Path, logits: torch.Tensor) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"logits": logits, "prefix_mask": torch.zeros(logits.shape, dtype=torch.bool)}, path)


def test_cli_reads_shards_and_prints_json(tmp_path: Path, capsys) -> None:
    TIERED.save(tmp_path / "profile.json")
    generator = torch.Generator().manual_seed(0)
    write_shard(tmp_path / "sts/shard-00000.pt", torch.randn(40, 7, generator=generator) + 2)
    write_shard(tmp_path / "sts/shard-00001.pt", torch.randn(30, 7, generator=generator) + 2)
    (tmp_path / "sts/meta.json").write_text("{}")  # not a shard: skipped
    code = cli(tmp_path, str(tmp_path / "profile.json"), "--sts", str(tmp_path / "sts"), "--m-bin", "8",
               "--draws", "4", "--temperatures", "1,1,1,1.5,1.5,2,2", "--json")
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in report["models"]] == ["sps-1d", "additive", "tier"]
    assert report["draws_per_batch"] == 4 and report["tiers"] == list(TIERS)
    assert cli(tmp_path, str(tmp_path / "profile.json"), "--sts", str(tmp_path / "sts/shard-00000.pt"),
               "--draws", "2", "--max-verify-len", "4") == 0
    assert "regret %" in capsys.readouterr().out


@pytest.mark.parametrize("setup, argv, message", [
    (lambda d: None, ["--sts", "missing"], "missing: no such shard file or directory"),
    (lambda d: (d / "empty").mkdir(), ["--sts", "empty"], "empty: directory holds no .pt shards"),
    (lambda d: write_shard(d / "a.pt", torch.zeros(4, 7)), ["--sts", "a.pt", "--temperatures", "1,2"],
     "--temperatures has 2 values but the shards have gamma=7"),
    (lambda d: (write_shard(d / "a.pt", torch.zeros(4, 7)), write_shard(d / "b.pt", torch.zeros(4, 3))),
     ["--sts", "a.pt", "b.pt"], "b.pt: gamma 3 differs from the earlier shards' gamma 7"),
    (lambda d: torch.save([1, 2], d / "list.pt"), ["--sts", "list.pt"],
     "list.pt: holds a list; expected the recorder's dict"),
    (lambda d: (d / "junk.pt").write_text("junk"), ["--sts", "junk.pt"],
     "junk.pt: cannot read the shard"),
    (lambda d: write_shard(d / "a.pt", torch.zeros(4, 7)), ["--sts", "a.pt", "--min-verify-len", "9"],
     "min_verify_len=9 exceeds the cap"),
])
def test_cli_bad_input_exits_2_with_a_message(tmp_path: Path, capsys, monkeypatch, setup, argv,
                                              message) -> None:
    TIERED.save(tmp_path / "profile.json")
    setup(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert cli(tmp_path, "profile.json", *argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dspark: error: ") and message in err


def test_cli_bad_profile_exits_2(tmp_path: Path, capsys) -> None:
    write_shard(tmp_path / "a.pt", torch.zeros(4, 7))
    (tmp_path / "profile.json").write_text('{"format": "other"}')
    assert cli(tmp_path, str(tmp_path / "profile.json"), "--sts", str(tmp_path / "a.pt")) == 2
    assert "not a profile result" in capsys.readouterr().err


def test_cli_refuses_the_profile_of_a_static_build(tmp_path: Path, capsys) -> None:
    static_only = profile_of(linear_law, lambda b: ())  # a static build measures only B x N
    assert static_only.static and not static_only.grid
    static_only.save(tmp_path / "profile.json")
    write_shard(tmp_path / "a.pt", torch.zeros(4, 7))
    assert cli(tmp_path, str(tmp_path / "profile.json"), "--sts", str(tmp_path / "a.pt")) == 2
    err = capsys.readouterr().err
    assert "profile of a static or cap-accept build" in err and "profile a compact build" in err
