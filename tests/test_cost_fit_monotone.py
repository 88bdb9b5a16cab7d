"""Cost tables are physically plausible: more rows or more requests never cost less.

The fits keep that law whatever the noise says (isotonic pooling, non-negative increments), the
table files refuse a table that breaks it, and `dspark refit-tables` re-fits an old profile's
tables without measuring anything.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dspark.cli.main import main as dspark_main
from dspark.formats.cost_tables import CostTableError, cost_table_from_json, read_cost_table
from dspark.formats.profile import ProfileResult
from dspark.measure.cost_fit import fit_additive, fit_draft_seconds, fit_sps_table, fit_tier_table
from dspark.runtime.planner.isotonic import isotonic

REPO = Path(__file__).resolve().parents[1]
TABLES = REPO / "specs" / "tables"


def non_decreasing(values: object) -> bool:
    seq = list(values)  # type: ignore[call-overload]
    return all(a <= b for a, b in itertools.pairwise(seq))


# -- isotonic regression against brute force -------------------------------------------------------

def brute_force_isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Every split of the sequence into consecutive blocks, each at its weighted mean; the feasible
    (non-decreasing) split with the least weighted squared error is the isotonic fit."""
    n, best, best_err = len(y), None, np.inf
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0, *(i + 1 for i, c in enumerate(cuts) if c), n]
        fit = np.concatenate([np.full(b - a, np.average(y[a:b], weights=w[a:b]))
                              for a, b in itertools.pairwise(bounds)])
        err = float((w * (fit - y) ** 2).sum())
        if non_decreasing(fit) and err < best_err - 1e-12:
            best, best_err = fit, err
    assert best is not None
    return best


@pytest.mark.parametrize("seed", range(30))
def test_isotonic_is_the_least_squares_non_decreasing_fit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 8))
    y, w = rng.normal(size=n), rng.uniform(0.5, 3.0, size=n)
    got = isotonic(y, w)
    assert non_decreasing(got)
    np.testing.assert_allclose(got, brute_force_isotonic(y, w), atol=1e-12)


def test_isotonic_keeps_ordered_values_and_pools_a_dip() -> None:
    assert isotonic([1.0, 2.0, 2.0, 5.0]).tolist() == [1.0, 2.0, 2.0, 5.0]
    assert isotonic([3.0, 1.0, 2.0]).tolist() == [2.0, 2.0, 2.0]
    assert isotonic([1.0, 0.0], [3.0, 1.0]).tolist() == [0.75, 0.75]
    with pytest.raises(ValueError, match="positive weight"):
        isotonic([1.0, 2.0], [1.0, 0.0])


# -- the fits ---------------------------------------------------------------------------------------

def test_additive_fit_never_prices_more_rows_or_requests_as_cheaper() -> None:
    """Samples with dips built in (theta at 96 rows below 80, alpha at B=4 below B=2) and noise."""
    rng = np.random.default_rng(0)
    theta = {16: 1.0, 32: 2.0, 48: 3.0, 64: 4.0, 80: 10.6, 96: 0.0, 112: 11.0, 128: 10.0, 256: 0.4}
    alpha = {1: 0.0, 2: 2.0, 4: 0.5, 8: 3.0}
    samples = [(b, m, (5.0 + alpha[b] + theta[m]) * 1e-3 * rng.uniform(0.95, 1.05))
               for b in alpha for m in theta if m >= b for _ in range(3)]
    table = fit_additive(samples, m_bin=16).table
    assert non_decreasing(table.theta_seconds) and non_decreasing(table.alpha_seconds)
    # and the file format accepts it
    cost_table_from_json(table.to_format().model_dump(exclude={"type"}), "fitted")


def test_additive_fit_recovers_a_monotone_law_exactly() -> None:
    alpha = {1: 0.0, 4: 0.25, 16: 1.0}
    theta = {16: 0.0, 32: 0.5, 64: 2.0, 128: 4.5}
    samples = [(b, m, 3e-3 + (alpha[b] + theta[m]) * 1e-3) for b in alpha for m in theta if m >= b]
    fit = fit_additive(samples, m_bin=16)
    assert fit.max_relative_error < 1e-9


def test_sps_table_pools_a_larger_step_measured_faster() -> None:
    samples = [(1, 8, 0.010), (2, 16, 0.009), (4, 32, 0.012), (8, 64, 0.020)]
    table = fit_sps_table(samples, max_batch_tokens=64)
    seconds = [1 / r for r in table.sample_steps_per_sec]
    assert seconds == pytest.approx([0.0095, 0.0095, 0.012, 0.020])


def test_tier_table_has_no_dip_along_tiers_or_batch_sizes() -> None:
    profile = ProfileResult.load(TABLES / "tiny_cpu_tiers" / "profile.json")
    grid = np.array(fit_tier_table(profile, profile.tiers).table.step_seconds)
    assert all(non_decreasing(row) for row in grid) and all(non_decreasing(col) for col in grid.T)


def test_draft_times_are_pooled_where_they_dip() -> None:
    assert fit_draft_seconds([1.0, 3.0, 2.0, 4.0]) == (1.0, 2.5, 2.5, 4.0)


# -- the file format refuses tables that break the law ------------------------------------------------

ADDITIVE = {"bias_seconds": 0.003, "bs_probes": [1, 2], "alpha_seconds": [0.0, 0.001],
            "m_probes": [1, 80, 96], "theta_seconds": [0.0, 0.0106, 0.0]}


@pytest.mark.parametrize(("table", "field", "where"), [
    (ADDITIVE, "theta_seconds", "m_probes[1] = 80 and 0 at m_probes[2] = 96"),
    ({**ADDITIVE, "alpha_seconds": [0.001, 0.0], "theta_seconds": [0.0, 0.001, 0.002]}, "alpha_seconds",
     "bs_probes[1] = 2"),
    ({"sample_batch_tokens": [8, 16], "sample_steps_per_sec": [245.0, 250.0], "max_batch_tokens": 16},
     "sample_steps_per_sec", "must not increase"),
    ({"tiers": [8, 16], "bs_probes": [1, 2], "step_seconds": [[0.002, 0.001], [0.003, 0.004]]},
     "row 0", "tiers[1] = 16"),
    ({"tiers": [8, 16], "bs_probes": [1, 2], "step_seconds": [[0.003, 0.004], [0.002, 0.005]]},
     "column 0", "bs_probes[1] = 2"),
    ({**ADDITIVE, "theta_seconds": [0.0, 0.001, 0.002], "draft_bs_probes": [1, 8],
      "draft_seconds": [0.002, 0.001]}, "draft_seconds", "draft_bs_probes[1] = 8"),
])
def test_a_table_that_prices_more_work_as_cheaper_is_refused(table: dict, field: str, where: str,
                                                             tmp_path: Path) -> None:
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    with pytest.raises(CostTableError) as err:
        read_cost_table(path)
    message = str(err.value)
    assert str(path) in message and field in message and where in message and "dspark refit-tables" in message


# -- dspark refit-tables ------------------------------------------------------------------------------

def test_refit_tables_rewrites_an_old_profiles_tables_monotone(tmp_path: Path, capsys) -> None:
    directory = tmp_path / "tiers"
    shutil.copytree(TABLES / "tiny_cpu_tiers", directory)
    old = json.loads((directory / "additive.json").read_text())
    old["theta_seconds"][7], old["draft_seconds"][2] = 0.0, 0.0  # the dips an unconstrained fit left
    (directory / "additive.json").write_text(json.dumps(old))
    tier = json.loads((directory / "tier.json").read_text())
    sps = json.loads((directory / "sps_1d.json").read_text())
    for data in (tier, sps):
        data["draft_seconds"][2] = 0.0
    (directory / "tier.json").write_text(json.dumps(tier))
    (directory / "sps_1d.json").write_text(json.dumps(sps))
    with pytest.raises(CostTableError):
        read_cost_table(directory / "additive.json")

    assert dspark_main(["refit-tables", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "wrote additive.json" in out and "wrote tier.json" in out and "→" in out  # the pooled draft time
    for name in ("sps_1d.json", "additive.json", "tier.json"):
        table = read_cost_table(directory / name)
        assert table.fingerprint == read_cost_table(TABLES / "tiny_cpu_tiers" / name).fingerprint
        assert non_decreasing(table.draft_seconds)
    original = TABLES / "tiny_cpu_tiers" / "profile.json"
    assert (directory / "profile.json").read_bytes() == original.read_bytes()


def test_refit_tables_refuses_what_it_cannot_refit(tmp_path: Path, capsys) -> None:
    assert dspark_main(["refit-tables", str(tmp_path)]) == 2
    assert "profile.json" in capsys.readouterr().err
    directory = tmp_path / "mixed"
    shutil.copytree(TABLES / "tiny_cpu", directory)
    sps = json.loads((directory / "sps_1d.json").read_text())
    sps["draft_seconds"] = sps["draft_seconds"][:-1]
    (directory / "sps_1d.json").write_text(json.dumps(sps))
    assert dspark_main(["refit-tables", str(directory)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dspark: error: ") and "not one profile's" in err
