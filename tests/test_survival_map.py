"""The calibration's monotone survival map (`dspark.runtime.planner.survival_map`): the isotonic fit against a
brute-force reference, the planner's torch evaluation against the numpy one, the map fixing a reliability
curve no temperature fits, and the calibration file's `survival_map` read, written and refused."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.formats.sts_calibration import CalibrationFileError, calibration_from_json, calibration_json
from dspark.runtime.planner.calibration_metrics import binned_ece
from dspark.runtime.planner.sts import cumulative_survival, default_grid, fit_temperatures
from dspark.runtime.planner.survival import survival_from_logits
from dspark.runtime.planner.survival_map import SurvivalMap, fit_survival_map, groups, isotonic, knot_count


def test_isotonic_is_the_least_squares_non_decreasing_fit() -> None:
    gen = np.random.default_rng(0)
    for _ in range(20):
        values, weights = gen.random(6), gen.integers(1, 5, 6).astype(np.float64)
        fit = isotonic(values, weights)
        assert (np.diff(fit) >= -1e-15).all()
        # brute force over the fits that pool contiguous blocks (the optimum is one of them)
        def loss(f: np.ndarray, values: np.ndarray = values, weights: np.ndarray = weights) -> float:
            return np.inf if (np.diff(f) < -1e-15).any() else float((weights * (f - values) ** 2).sum())

        best = min((np.concatenate([np.full(b - a, np.average(values[a:b], weights=weights[a:b]))
                                    for a, b in itertools.pairwise((0, *cuts, 6))])
                    for r in range(6) for cuts in itertools.combinations(range(1, 6), r)), key=loss)
        np.testing.assert_allclose(fit, best, atol=1e-12)


def synthetic(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits whose conditional acceptance is sigmoid(z)**2: a curve that bends, which no temperature fits."""
    gen = np.random.default_rng(seed)
    z = gen.normal(1.0, 2.0, size=(n, 4))
    accept = gen.random((n, 4)) < (1 / (1 + np.exp(-z))) ** 2
    return z, np.cumprod(accept, axis=1).astype(bool)


def test_the_map_fixes_a_curve_no_temperature_fits() -> None:
    z, y = synthetic(20000, 1)
    temps = fit_temperatures(z, y, default_grid(), 15)
    survival_map = fit_survival_map(cumulative_survival(z, temps), y, bins=10)
    z2, y2 = synthetic(20000, 2)  # held out
    for k in range(4):
        sts = binned_ece(cumulative_survival(z2, temps)[:, k], y2[:, k], 15)
        mapped = binned_ece(cumulative_survival(z2, temps, survival_map)[:, k], y2[:, k], 15)
        assert mapped < 0.6 * sts and mapped < 0.02, (k, sts, mapped)
    s = cumulative_survival(z2, temps, survival_map)
    assert ((s >= 0) & (s <= 1)).all() and (np.diff(s, axis=1) <= 0).all()  # still a survival


def test_the_planner_evaluates_the_map_as_the_fit_does() -> None:
    z, y = synthetic(3000, 3)
    survival_map = fit_survival_map(cumulative_survival(z, (1.0,) * 4), y, bins=6)
    logits = torch.from_numpy(synthetic(500, 4)[0])
    planner = survival_from_logits(logits, (1.0,) * 4, survival_map).numpy()
    reference = cumulative_survival(logits.numpy(), (1.0,) * 4, survival_map)
    np.testing.assert_allclose(planner, reference, rtol=0, atol=1e-12)
    padded = SurvivalMap(((0.0, 0.5, 1.0, 1.0),), ((0.0, 0.25, 0.5, 0.5),))  # a repeated last knot
    on_knots = padded.apply(np.array([[0.0], [0.5], [0.75], [1.0]]))[:, 0]
    np.testing.assert_allclose(on_knots, [0, 0.25, 0.375, 0.5])
    torch.testing.assert_close(padded.apply_torch(torch.tensor([[0.75], [1.0]], dtype=torch.float64)),
                               torch.tensor([[0.375], [0.5]], dtype=torch.float64))
    # a jump (two knots at one x): below it the segment before, from it on the level after
    jumps = SurvivalMap(((0.0, 0.4, 0.4, 1.0), (0.0, 0.2, 0.9, 1.0)),
                        ((0.0, 0.2, 0.6, 1.0), (0.0, 0.1, 0.3, 0.9)))
    points = np.array([[0.0, 0.0], [0.39, 0.1], [0.4, 0.2], [0.7, 0.9], [1.0, 1.0]])
    numpy_side = jumps.apply(points)
    np.testing.assert_allclose(numpy_side[:, 0], [0.0, 0.195, 0.6, 0.8, 1.0])
    double = jumps.apply_torch(torch.from_numpy(points)).numpy()
    np.testing.assert_allclose(double, numpy_side, rtol=0, atol=1e-15)
    single = jumps.apply_torch(torch.from_numpy(points).float())  # the planner's float32
    np.testing.assert_allclose(single.numpy(), numpy_side, rtol=0, atol=1e-6)
    # a jump at the last knot: a survival of 1 stays on the segment before it, as in `apply`
    last = SurvivalMap(((0.0, 0.5, 1.0, 1.0),), ((0.0, 0.4, 0.7, 0.9),))
    ends = np.array([[0.5], [0.999], [1.0]])
    np.testing.assert_allclose(last.apply(ends)[:, 0], [0.4, 0.7 - 0.3 * 0.002, 0.7])
    np.testing.assert_allclose(last.apply_torch(torch.from_numpy(ends)).numpy(), last.apply(ends), rtol=0,
                               atol=1e-15)
    # segments narrower than float32 resolves, and rises that sum past 1 in float32: still probabilities
    thin = SurvivalMap(((0.0, 0.3, 0.3 + 1e-12, 1.0 - 1e-300, 1.0),), ((0.0, 0.1, 0.7, 0.9, 1.0),))
    grid = torch.linspace(0.0, 1.0, 10001, dtype=torch.float32)[:, None]
    for survival in (grid, torch.ones(3, 1), torch.full((3, 1), 0.3)):
        mapped = thin.apply_torch(survival)
        assert torch.isfinite(mapped).all() and (mapped >= 0).all() and (mapped <= 1).all()
        np.testing.assert_allclose(mapped.double().numpy(), thin.apply(survival.double().numpy()), atol=1e-6)


def test_a_position_without_enough_labels_keeps_its_map() -> None:
    z, y = synthetic(400, 5)
    known = np.ones_like(y)
    known[:, 3] = False
    previous = SurvivalMap.identity(4, knot_count(10))
    fitted = fit_survival_map(cumulative_survival(z, (1.0,) * 4), y, known, bins=10, min_known=50,
                              previous=previous)
    assert fitted.x[3] == previous.x[3] and fitted.x[0] != previous.x[0]


GOOD = {"version": 1, "x": [[0, 0.5, 1], [0, 0.4, 1]], "y": [[0, 0.3, 0.9], [0, 0.2, 0.7]]}


def test_the_calibration_file_carries_the_map() -> None:
    contents = calibration_from_json({"temperatures": [1.0, 0.7], "survival_map": GOOD}, "sts.json")
    survival_map = SurvivalMap.from_knots(contents.survival_map)
    assert survival_map.apply(np.array([[0.5, 0.4]])).tolist() == [[0.3, 0.2]]
    again = calibration_from_json(calibration_json(contents), "again")
    assert again == contents


@pytest.mark.parametrize(("change", "message"), [
    ({"version": 2}, "version 2 is not one this dspark reads"),
    ({"x": [[0, 0.5, 1]], "y": [[0, 0.3, 0.9]]}, "survival_map has 1 entries but there are 2 temperatures"),
    ({"x": [[0, 0.5, 0.9], [0, 0.4, 1]]}, "x must start at 0 and end at 1"),
    ({"y": [[0, 0.3, 0.2], [0, 0.2, 0.7]]}, "non-decreasing"),
    ({"y": [[0, 0.3, 1.2], [0, 0.2, 0.7]]}, r"y must lie in \[0, 1\]"),
    ({"x": [[0, 1], [0, 0.4, 1]]}, "the same count at every position"),
])
def test_a_broken_map_is_refused_with_what_to_do(change: dict, message: str) -> None:
    with pytest.raises(CalibrationFileError, match=message) as err:
        calibration_from_json({"temperatures": [1.0, 0.7], "survival_map": {**GOOD, **change}}, "sts.json")
    assert str(err.value).startswith("sts.json: ")


def test_the_report_scores_a_file_with_its_survival_map() -> None:
    from dspark.formats.sts_calibration import CalibrationFileContents
    from dspark.report.reliability import calibration_groups

    z, y = synthetic(3000, 6)
    temps = (1.0, 1.0, 1.0, 1.0)
    survival_map = fit_survival_map(cumulative_survival(z, temps), y, bins=10)

    class Sts:  # the report's pooled rows of one run
        policy, logits, prefix_mask, skipped_requests = "greedy", z, y, 0

    class Run:
        path, gamma, sts = Path("run"), 4, Sts()

    plain = CalibrationFileContents(temperatures=temps)
    mapped = CalibrationFileContents(temperatures=temps, survival_map=survival_map.to_knots())
    (without,), (with_map,) = calibration_groups([Run()], plain), calibration_groups([Run()], mapped)
    s = cumulative_survival(z, temps, survival_map)
    assert with_map.cumulative["after"][3].ece == pytest.approx(binned_ece(s[:, 3], y[:, 3], 15))
    assert with_map.cumulative["after"][3].ece < without.cumulative["after"][3].ece


def test_groups_refine_the_quantiles_where_the_survivals_crowd() -> None:
    gen = np.random.default_rng(8)
    s = np.concatenate([gen.random(3000), 1 - 0.03 * gen.random(17000)])  # 85 % of the rows above 0.97
    group = groups(s, 10)
    count = np.bincount(group)
    assert count.min() >= 200 and count.shape[0] <= knot_count(10) - 2
    below = s < 0.9
    widths = [np.ptp(s[group == g]) for g in np.unique(group[below])]
    # quantile groups alone: one group spans 0 to 0.85; refined, a fifteenth (two where one held too few)
    assert max(widths) <= 2 / 15, widths
    small = gen.random(100)  # few rows: groups of at least a tenth each, quantile groups as before
    assert np.bincount(groups(small, 10)).min() >= 10


def test_the_map_fits_a_bend_where_most_survivals_are_near_one() -> None:
    """Easy text puts most drafts' survival near 1; the curve's bend lies in the few rows below."""
    def rows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        gen = np.random.default_rng(seed)
        s = np.where(gen.random(n) < 0.15, gen.random(n), 1 - 0.03 * gen.random(n))
        truth = s - 0.15 * np.sin(np.pi * s)  # monotone, below the diagonal in the middle
        return s[:, None], (gen.random(n) < truth)[:, None]
    s, y = rows(30000, 9)
    survival_map = fit_survival_map(s, y, bins=10)
    grid = np.linspace(0.1, 0.9, 17)[:, None]
    truth = grid[:, 0] - 0.15 * np.sin(np.pi * grid[:, 0])
    assert np.abs(survival_map.apply(grid)[:, 0] - truth).mean() < 0.025  # quantile groups alone: 0.045
    s2, y2 = rows(30000, 10)
    assert binned_ece(survival_map.apply(s2)[:, 0], y2[:, 0], 15) < 0.01
