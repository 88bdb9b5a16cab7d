"""Step-cost profiling and fitting, driven by synthetic timers (no model, no device)."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from dspark.cli.refit_tables import refitted
from dspark.formats.profile import ProfileError
from dspark.measure.profiler import (
    ProfilePlan,
    ProfileResult,
    ProfileSample,
    bin_rows,
    fit_additive,
    fit_profile,
    fit_sps_table,
    format_fit_report,
    format_sweep_report,
    leftover_tables,
    nnls,
    rows_around,
    run_profile,
    write_tables,
)
from dspark.runtime.planner.cost_models import AdditiveCostTable, SpsTable, load_cost_model


class SyntheticTimer:
    """A step-time law plus deterministic ±`noise` relative jitter; counts its calls per (B, M)."""

    def __init__(self, law, noise: float = 0.002) -> None:
        self.law = law
        self.noise = noise
        self.calls: Counter[tuple[int, int]] = Counter()

    def __call__(self, num_reqs: int, num_rows: int) -> float:
        self.calls[num_reqs, num_rows] += 1
        jitter = math.sin(1.7 * sum(self.calls.values()))
        return self.law(num_reqs, num_rows) * (1.0 + self.noise * jitter)


def linear_law(num_reqs: int, num_rows: int) -> float:
    return 1e-3 * (2.0 + 0.05 * num_reqs + 0.01 * num_rows)


TIERS = (64, 128)


def cliff_law(num_reqs: int, num_rows: int) -> float:
    """Padding to the next graph tier: a 1 ms jump each time M crosses a tier."""
    jumps = sum(1.0 for tier in TIERS if num_rows > tier)
    return 1e-3 * (2.0 + 0.05 * num_reqs + 0.005 * num_rows + jumps)


def plan(**overrides) -> ProfilePlan:
    fields = {"batch_sizes": (1, 2, 4, 8, 16, 32), "num_draft_tokens": 8, "repeats": 3, "warmup": 1}
    return ProfilePlan(**{**fields, **overrides})


# --- NNLS -------------------------------------------------------------------------------------------


def brute_force_nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares on every column subset; the best non-negative one is the NNLS optimum."""
    best, best_x = math.inf, None
    for size in range(a.shape[1] + 1):
        for subset in itertools.combinations(range(a.shape[1]), size):
            x = np.zeros(a.shape[1])
            if subset:
                x[list(subset)] = np.linalg.lstsq(a[:, list(subset)], b, rcond=None)[0]
            if np.all(x >= 0) and (residual := np.linalg.norm(a @ x - b)) < best:
                best, best_x = residual, x
    return best_x


def test_nnls_equals_brute_force_on_small_problems() -> None:
    rng = np.random.default_rng(7)
    active_constraints = 0
    for trial in range(300):
        cols = int(rng.integers(1, 6))
        rows = int(rng.integers(cols, 9))  # full column rank, so the optimum is unique and x comparable
        a = rng.normal(size=(rows, cols))
        if trial % 2:
            a = np.abs(a)  # cost-like design: non-negative columns
        b = rng.normal(size=rows)
        x = nnls(a, b)
        expected = brute_force_nnls(a, b)
        assert np.all(x >= 0)
        np.testing.assert_allclose(x, expected, atol=1e-9, err_msg=f"trial {trial}")
        active_constraints += int(np.any(expected == 0) and np.any(expected > 0))
    assert active_constraints > 50, "the problems should exercise both bound and free variables"


def test_nnls_underdetermined_reaches_the_optimal_residual() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        a, b = rng.normal(size=(3, 5)), rng.normal(size=3)
        x = nnls(a, b)
        assert np.all(x >= 0)
        expected = brute_force_nnls(a, b)
        assert np.linalg.norm(a @ x - b) <= np.linalg.norm(a @ expected - b) + 1e-9


def test_nnls_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="nnls needs"):
        nnls(np.ones((3, 2)), np.ones(4))


# --- binning and fitting ----------------------------------------------------------------------------


@pytest.mark.parametrize(("num_rows", "m_bin", "expected"), [
    (1, 64, 1), (31, 64, 1), (32, 64, 64), (95, 64, 64), (96, 64, 128), (160, 64, 192), (7, 1, 7),
    (24, 16, 32), (23, 16, 16),
])
def test_bin_rows(num_rows: int, m_bin: int, expected: int) -> None:
    assert bin_rows(num_rows, m_bin) == expected


def test_bin_rows_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="m_bin"):
        bin_rows(10, 0)
    with pytest.raises(ValueError, match="num_rows"):
        bin_rows(0, 64)


def test_fit_additive_recovers_a_known_additive_law() -> None:
    bias = 1.5e-3
    alpha = {1: 0.0, 2: 0.1e-3, 4: 0.35e-3, 8: 0.9e-3}
    theta = {16: 0.0, 32: 0.2e-3, 48: 0.2e-3, 64: 0.5e-3, 96: 1.1e-3, 128: 1.6e-3}
    timer = SyntheticTimer(lambda b, m: bias + alpha[b] + theta[m], noise=5e-4)
    samples = [(b, m, timer(b, m)) for b in alpha for m in theta]
    fit = fit_additive(samples, m_bin=16)
    table = fit.table
    assert table.bs_probes == tuple(alpha) and table.m_probes == tuple(theta)
    assert table.bias_seconds == pytest.approx(bias, abs=2e-6)
    np.testing.assert_allclose(table.alpha_seconds, list(alpha.values()), atol=3e-6)
    np.testing.assert_allclose(table.theta_seconds, list(theta.values()), atol=3e-6)
    assert fit.r_squared > 0.999
    assert fit.max_relative_error < 2e-3


def test_fit_additive_clamps_coefficients_that_noise_makes_negative() -> None:
    # B=2 measured faster than B=1: unconstrained least squares would give alpha(2) < 0, which the
    # table rejects; NNLS pins it at 0 instead.
    samples = [(1, 1, 2.0e-3), (1, 8, 2.4e-3), (2, 2, 1.9e-3), (2, 16, 2.3e-3)]
    fit = fit_additive(samples, m_bin=8)
    assert min(fit.table.alpha_seconds) == 0.0 and min(fit.table.theta_seconds) == 0.0
    assert fit.table.alpha_seconds[1] == 0.0
    assert all(v >= 0 for v in (fit.table.bias_seconds, *fit.table.theta_seconds))


def test_fit_residuals_use_the_tables_interpolation_at_unbinned_rows() -> None:
    samples = [(1, 1, 1.0e-3), (1, 20, 1.5e-3), (1, 64, 2.0e-3), (2, 40, 1.9e-3)]
    fit = fit_additive(samples, m_bin=64)
    for residual in fit.residuals:
        assert residual.predicted_seconds == fit.table.step_time(residual.num_reqs, residual.num_rows)
    # (1, 20) shares the zero bin with (1, 1) yet is predicted on the line between the M=1 and M=64
    # probes, which is what the planner will use.
    by_rows = {r.num_rows: r for r in fit.residuals}
    assert by_rows[1].predicted_seconds < by_rows[20].predicted_seconds < by_rows[64].predicted_seconds


def test_fit_rejects_impossible_samples() -> None:
    with pytest.raises(ValueError, match="no samples"):
        fit_additive([])
    with pytest.raises(ValueError, match="finite and > 0"):
        fit_additive([(1, 4, 0.0)])
    with pytest.raises(ValueError, match="1 <= B <= M"):
        fit_sps_table([(4, 2, 1e-3)], max_batch_tokens=8)


def test_fit_sps_table_sorts_and_pools_duplicate_rows() -> None:
    table = fit_sps_table([(4, 32, 4e-3), (1, 8, 2e-3), (4, 32, 5e-3), (4, 32, 9e-3)], max_batch_tokens=32)
    assert table.sample_batch_tokens == (8, 32)
    assert table.sample_steps_per_sec == pytest.approx((500.0, 200.0))


# --- the measurement protocol -----------------------------------------------------------------------


def test_run_profile_measures_the_plan_and_excludes_warmup() -> None:
    p = plan(extra_rows=rows_around(TIERS))
    law_calls: Counter[tuple[int, int]] = Counter()

    def timer(num_reqs: int, num_rows: int) -> float:
        law_calls[num_reqs, num_rows] += 1
        # The first (warmup) step of every shape is a slow outlier, like a first graph replay.
        return 1.0 if law_calls[num_reqs, num_rows] == 1 else linear_law(num_reqs, num_rows)

    result = run_profile(timer, p, progress=False)
    assert [(s.num_reqs, s.num_rows) for s in result.static] == [(b, 8 * b) for b in p.batch_sizes]
    for sample in (*result.static, *result.grid):
        assert len(sample.seconds) == p.repeats
        assert sample.median_seconds == pytest.approx(linear_law(sample.num_reqs, sample.num_rows))
        b, m = sample.num_reqs, sample.num_rows
        assert b * p.min_verify_len <= m <= b * p.num_draft_tokens
    assert set(law_calls.values()) == {p.warmup + p.repeats}
    assert len(law_calls) == len(result.static) + len(result.grid) == len(p.points())
    # The tier neighbourhoods are measured for every batch size whose row range contains them.
    assert {(32, m) for m in range(126, 131)} <= set(law_calls)


def test_run_profile_rejects_a_timer_that_returns_no_time() -> None:
    with pytest.raises(ValueError, match="wall seconds"):
        run_profile(lambda b, m: 0.0, plan(batch_sizes=(1,)), progress=False)


def test_grid_rows_span_the_verify_range_and_honour_max_rows() -> None:
    p = plan(batch_sizes=(1, 2, 4, 8, 16), min_verify_len=2, grid_density=4, extra_rows=(3, 5, 100),
             max_rows=40)
    assert p.grid_rows(1) == (2, 3, 4, 5, 6)  # linspace(2, 8, 4) without the static 8, plus extras 3, 5
    assert p.grid_rows(4) == (8, 16, 24)
    assert p.grid_rows(16) == (32, 35, 37, 40)  # capped at max_rows; the static 128 is never reached
    for b in p.batch_sizes:
        rows = p.grid_rows(b)
        assert rows == tuple(sorted(set(rows)))
        assert all(2 * b <= m <= min(8 * b, 40) and m != 8 * b for m in rows)
    assert 5 in p.grid_rows(1) and 3 not in p.grid_rows(2) and 100 not in p.grid_rows(16)
    assert p.static_batch_sizes == (1, 2, 4)  # 8·8 = 64 rows exceed max_rows=40
    assert p.max_batch_tokens == 40
    assert plan().max_batch_tokens == 32 * 8


def test_rows_around() -> None:
    assert rows_around((2, 64), radius=2) == (1, 2, 3, 4, 62, 63, 64, 65, 66)
    with pytest.raises(ValueError, match="radius"):
        rows_around((64,), radius=-1)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"batch_sizes": ()}, "batch_sizes is empty"),
    ({"batch_sizes": (1, 2, 2)}, "distinct integers >= 1"),
    ({"batch_sizes": (0, 2)}, "distinct integers >= 1"),
    ({"num_draft_tokens": 0}, "num_draft_tokens"),
    ({"min_verify_len": 9}, r"min_verify_len must be in \[1, N=8\]"),
    ({"min_verify_len": 0}, "min_verify_len"),
    ({"grid_density": 1}, "grid_density must be >= 2"),
    ({"repeats": 0}, "repeats must be >= 1"),
    ({"warmup": -1}, "warmup must be >= 0"),
    ({"m_bin": 0}, "m_bin must be >= 1"),
    ({"extra_rows": (0, 4)}, "extra_rows must be >= 1"),
    ({"max_rows": 16, "min_verify_len": 1}, r"batch sizes \[32\] need at least"),
    ({"batch_sizes": (4, 8), "max_rows": 16}, "static sweep would be empty"),
])
def test_profile_plan_validation(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan(**overrides)


def test_profile_plan_is_canonical() -> None:
    assert plan(batch_sizes=[4, 1, 2]).batch_sizes == (1, 2, 4)
    assert plan(batch_sizes=[4, 1, 2]) == plan(batch_sizes=(1, 2, 4))


# --- tier cliffs: what each table can and cannot represent ------------------------------------------


def test_tier_cliff_sps_reproduces_static_sweep_while_additive_error_sits_at_the_cliff() -> None:
    result = run_profile(SyntheticTimer(cliff_law), plan(extra_rows=rows_around(TIERS)), progress=False)
    sps, fit = fit_profile(result)

    for sample in result.static:
        assert sps.lookup(sample.num_rows) == 1.0 / sample.median_seconds

    near_cliff = {m for tier in TIERS for m in range(tier + 1, tier + 3)}
    worst = sorted(fit.residuals, key=lambda r: abs(r.residual_seconds), reverse=True)[:4]
    assert all(r.num_rows in near_cliff for r in worst), [(r.num_reqs, r.num_rows) for r in worst]
    at_cliff = [abs(r.residual_seconds) for r in fit.residuals if r.num_rows in near_cliff]
    elsewhere = [abs(r.residual_seconds) for r in fit.residuals if r.num_rows not in near_cliff]
    assert np.mean(at_cliff) > 4 * np.mean(elsewhere)

    # Without the cliff the same plan fits well: the error above is the cliff, not the protocol.
    smooth = fit_profile(run_profile(SyntheticTimer(linear_law), plan(), progress=False))[1]
    assert smooth.r_squared > 0.99 > fit.r_squared


def test_format_fit_report_lists_sweep_fit_and_flags_largest_residuals() -> None:
    result = run_profile(SyntheticTimer(cliff_law), plan(extra_rows=rows_around(TIERS)), progress=False)
    sps, fit = fit_profile(result)
    report = format_fit_report(result, sps, fit, flag_top=3)
    assert "static sweep" in report and "R²" in report
    assert f"bias   {fit.table.bias_seconds * 1e3:.4f} ms" in report
    flagged = [line.split() for line in report.splitlines() if line.endswith("<<")]
    assert len(flagged) == 3
    worst = max(fit.residuals, key=lambda r: abs(r.residual_seconds))
    assert [str(worst.num_reqs), str(worst.num_rows)] in [row[:2] for row in flagged]
    assert f"{'32':>6} {'256':>7}" in report  # static row B=32, M=256


# --- persistence ------------------------------------------------------------------------------------


def test_profile_result_json_round_trip(tmp_path: Path) -> None:
    result = run_profile(SyntheticTimer(linear_law), plan(max_rows=200, extra_rows=(63, 65)), progress=False,
                         meta={"device": "synthetic"})
    path = tmp_path / "profile.json"
    result.save(path)
    loaded = ProfileResult.load(path)
    assert loaded == result
    assert fit_profile(loaded)[1].table == fit_profile(result)[1].table


def test_profile_result_load_errors(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a profile result"):
        ProfileResult.load(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        ProfileResult.load(path)
    with pytest.raises(ProfileError, match=r"plan: unknown field\(s\) \['gamma'\]"):
        ProfilePlan.from_json({**plan().to_json(), "gamma": 3})
    with pytest.raises(ValueError, match="no measurements"):
        ProfileSample(1, 8, ())


def test_write_tables_round_trips_through_load_cost_model(tmp_path: Path) -> None:
    result = run_profile(SyntheticTimer(cliff_law), plan(), progress=False)
    sps, fit = fit_profile(result)
    out = tmp_path / "tables"
    written = write_tables(out, sps, fit, result)
    assert sorted(p.name for p in out.iterdir()) == ["additive.json", "profile.json", "sps_1d.json"]
    assert written["sps_1d.json"] == out / "sps_1d.json"
    loaded_sps = load_cost_model(out / "sps_1d.json")
    loaded_additive = load_cost_model(out / "additive.json")
    assert isinstance(loaded_sps, SpsTable) and loaded_sps == sps
    assert isinstance(loaded_additive, AdditiveCostTable) and loaded_additive == fit.table
    assert ProfileResult.load(out / "profile.json") == result

    # Re-writing replaces the tables in place and leaves no staging files behind.
    write_tables(out, sps, fit.table)
    assert sorted(p.name for p in out.iterdir()) == ["additive.json", "profile.json", "sps_1d.json"]


def test_additive_fit_never_prices_the_cheapest_corner_at_zero() -> None:
    # The corner (B=1, smallest bin) is not measured and the three samples ask for a negative
    # bias (b = s1 + s2 - s3 < 0); the fit keeps it at half the fastest step instead of zero.
    samples = [(1, 64, 0.010), (2, 2, 0.010), (2, 64, 0.030)]
    fit = fit_additive(samples, m_bin=64)
    assert fit.table.bias_seconds >= 0.005
    assert fit.table.step_time(1, 2) > 0


# --- profiles without a grid (static and cap-accept builds) -----------------------------------------


def test_a_plan_whose_requests_all_run_n_rows_measures_the_static_sweep_only(tmp_path: Path) -> None:
    p = plan(min_verify_len=8)  # what `dspark profile` plans for a static build: floor = cap = N
    assert all(p.grid_rows(b) == () for b in p.batch_sizes)
    result = run_profile(SyntheticTimer(linear_law), p, progress=False, meta={"verify_mode": "static"})
    assert result.grid == () and [s.num_rows for s in result.static] == [8 * b for b in p.batch_sizes]
    sps = fit_sps_table(result.static_samples(), result.max_batch_tokens)
    report = format_sweep_report(result, sps)
    assert "static sweep (N=8" in report and "no additive or tier table: a static build" in report
    assert f"{'32':>6} {'256':>7}" in report and "residuals" not in report
    out = tmp_path / "tables"
    written = write_tables(out, sps, None, result, fingerprint={"verify_mode": "static"})
    assert sorted(written) == sorted(p.name for p in out.iterdir()) == ["profile.json", "sps_1d.json"]
    assert load_cost_model(out / "sps_1d.json") == sps and ProfileResult.load(out / "profile.json") == result
    assert leftover_tables(out, written) == []
    (out / "tier.json").write_text("{}")
    assert leftover_tables(out, written) == [out / "tier.json"]


def test_refitting_the_committed_profiles_reproduces_the_committed_tables(tmp_path: Path) -> None:
    """The tables in specs/tables/ are what `dspark profile` fits from the profile.json beside them."""
    repo = Path(__file__).resolve().parents[1]
    profiles = sorted(repo.glob("specs/tables/*/profile.json"))
    assert profiles
    for path in profiles:
        committed = path.parent
        sps_json = json.loads((committed / "sps_1d.json").read_text())
        # `dspark refit-tables`'s fit (`dspark profile`'s own, with the draft and decode terms and any
        # context term carried over): every table for a compact build, the 1D table alone for a static one
        tables, result, _ = refitted(committed)
        out = tmp_path / committed.name
        written = write_tables(out, tables.sps, tables.additive, result, tables.tier, sps_json["fingerprint"])
        tables = {"sps_1d.json", "additive.json", "tier.json"}
        assert set(written) - {"profile.json"} == {p.name for p in committed.iterdir() if p.name in tables}
        for name in written:
            again, before = (out / name).read_text(), (committed / name).read_text()
            if name != "additive.json":
                assert again == before, f"{committed.name}/{name}"
                continue
            # A least-squares solve: its last bits follow the LAPACK of the machine that fitted it (the
            # H200 table was fitted there), so its numbers are compared to 1e-12 and the rest exactly.
            again_json, before_json = json.loads(again), json.loads(before)
            assert again_json.keys() == before_json.keys()
            for key, value in before_json.items():
                if key.startswith("context_") and key.endswith("seconds"):  # one list per context
                    value, again_json[key] = np.ravel(value).tolist(), np.ravel(again_json[key]).tolist()
                expected = pytest.approx(value, rel=1e-12, abs=1e-15) if key.endswith("seconds") else value
                assert again_json[key] == expected, f"{committed.name}/{name}: {key}"
