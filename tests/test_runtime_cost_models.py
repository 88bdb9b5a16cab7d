import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.runtime.planner.cost_models import (
    AdditiveCostTable,
    CostModelError,
    SpsTable,
    TierCostTable,
    cost_model_from_dict,
    load_cost_model,
    save_cost_model,
)

# A tier cliff: rows 1..64 replay in the 64-row graph, 65..96 in the 96-row one.
CLIFF = SpsTable(sample_batch_tokens=(8, 64, 65, 96), sample_steps_per_sec=(900.0, 800.0, 500.0, 480.0),
                 max_batch_tokens=96)
ADDITIVE = AdditiveCostTable(bias_seconds=0.001, bs_probes=(1, 8), alpha_seconds=(0.0, 0.0007),
                             m_probes=(4, 64), theta_seconds=(0.0002, 0.0032))


def test_sps_floor_lookup_keeps_the_tier_cliff_exact() -> None:
    assert CLIFF.lookup(64) == 800.0
    assert CLIFF.lookup(65) == 500.0  # one row past the tier: the next probe, not a blend
    assert CLIFF.lookup(63) == 900.0  # between probes 8 and 64: floor is 8, no interpolation
    assert CLIFF.lookup(96) == 480.0
    assert CLIFF.max_rows == 96 and CLIFF.kind == "sps-1d"


def test_sps_lookup_below_the_first_probe_clamps_to_it() -> None:
    assert CLIFF.lookup(1) == 900.0
    assert CLIFF.lookup(0) == 900.0


def test_sps_lookup_refuses_rows_past_max_batch_tokens() -> None:
    with pytest.raises(CostModelError, match=r"num_rows 97 is outside \[0, max_batch_tokens=96\]"):
        CLIFF.lookup(97)


@given(st.lists(st.integers(0, 96), max_size=20))
@settings(max_examples=60, deadline=None)
def test_sps_lookup_many_matches_scalar_floor_scan(rows: list[int]) -> None:
    def floor_scan(m: int) -> float:
        below = [i for i, probe in enumerate(CLIFF.sample_batch_tokens) if probe <= m]
        return CLIFF.sample_steps_per_sec[below[-1] if below else 0]

    got = CLIFF.lookup_many(np.array(rows, dtype=np.int64))
    assert got.tolist() == [floor_scan(m) for m in rows]


def test_additive_interpolates_alpha_and_theta_and_clamps_at_the_ends() -> None:
    # B=4: alpha = 0.0007 * 3/7; M=34: theta halfway = 0.0017.
    assert ADDITIVE.step_time(4, 34) == pytest.approx(0.001 + 0.0007 * 3 / 7 + 0.0017)
    assert ADDITIVE.step_time(1, 4) == pytest.approx(0.0012)
    assert ADDITIVE.step_time(100, 1000) == pytest.approx(0.001 + 0.0007 + 0.0032)  # clamped high
    assert ADDITIVE.step_time(1, 1) == pytest.approx(0.0012)  # clamped low
    got = ADDITIVE.step_time_many(8, np.array([4, 34, 64, 200]))
    assert got == pytest.approx([0.0019, 0.0034, 0.0049, 0.0049])
    assert ADDITIVE.max_rows is None and ADDITIVE.kind == "additive"


def test_draft_term_interpolates_and_is_zero_without_one() -> None:
    sps = SpsTable((4,), (100.0,), 64, draft_bs_probes=(1, 9), draft_seconds=(0.001, 0.005))
    assert sps.draft_time(5) == pytest.approx(0.003)
    assert sps.draft_time(20) == pytest.approx(0.005)
    assert sps.draft_time(0) == pytest.approx(0.001)
    add = AdditiveCostTable(0.0, (1,), (0.0,), (1,), (0.001,), draft_bs_probes=(2,), draft_seconds=(0.0004,))
    assert add.draft_time(7) == 0.0004
    assert CLIFF.draft_time(8) == 0.0 and ADDITIVE.draft_time(8) == 0.0


def test_constructor_accepts_lists_and_stays_hashable() -> None:
    table = SpsTable([4, 8], [100, 90.5], 8)  # type: ignore[arg-type]
    assert table.sample_batch_tokens == (4, 8) and table.sample_steps_per_sec == (100.0, 90.5)
    assert hash(table) == hash(SpsTable((4, 8), (100.0, 90.5), 8))


@pytest.mark.parametrize("make, message", [
    (lambda: AdditiveCostTable(0.0, (1,), (0.0,), (64, 192, 128), (0.1, 0.2, 0.3)),
     r"m_probes must be strictly increasing: item 2 \(128\) follows 192; sort the probes"),
    (lambda: SpsTable((4, 4), (1.0, 1.0), 8),
     r"sample_batch_tokens must be strictly increasing: item 1 \(4\) follows 4"),
    (lambda: SpsTable((0, 4), (1.0, 1.0), 8), "sample_batch_tokens item 0 is 0; .* must be >= 1"),
    (lambda: SpsTable((), (), 8), "sample_batch_tokens is empty; a table needs at least one probe"),
    (lambda: SpsTable((4, 8), (1.0,), 8),
     "sample_steps_per_sec has 1 values but sample_batch_tokens has 2 probes; give exactly one"),
    (lambda: SpsTable((4, 8), (1.0, 0.0), 8),
     r"sample_steps_per_sec item 1 is 0.0; steps per second must be > 0"),
    (lambda: SpsTable((4, 8), (1.0, -2.0), 8), r"sample_steps_per_sec item 1 is -2.0"),
    (lambda: SpsTable((4,), (1.0,), 0), "max_batch_tokens is 0; .* must be >= 1"),
    (lambda: SpsTable((4,), (float("nan"),), 8), "sample_steps_per_sec item 0 is nan"),
    (lambda: SpsTable((4.5,), (1.0,), 8), "sample_batch_tokens item 0 must be an integer, got 4.5"),
    (lambda: SpsTable((True,), (1.0,), 8), "sample_batch_tokens item 0 must be an integer, got True"),
    (lambda: AdditiveCostTable(-0.1, (1,), (0.0,), (1,), (0.1,)),
     r"bias_seconds is -0.1; seconds must be >= 0"),
    (lambda: AdditiveCostTable(0.0, (1, 2), (0.0, -1e-3), (1,), (0.1,)), r"alpha_seconds item 1 is -0.001"),
    (lambda: AdditiveCostTable(0.0, (1, 2), (0.0,), (1,), (0.1,)),
     "alpha_seconds has 1 values but bs_probes has 2 probes"),
    (lambda: AdditiveCostTable(0.0, (1,), (0.0,), (1, 2), (0.0, 0.5)),
     r"bias_seconds \+ min\(alpha_seconds\) \+ min\(theta_seconds\) is 0"),
    (lambda: SpsTable((4,), (1.0,), 8, draft_bs_probes=(1,)),
     "draft_bs_probes is given but draft_seconds is empty; give both draft lists or neither"),
    (lambda: SpsTable((4,), (1.0,), 8, draft_bs_probes=(1, 2), draft_seconds=(0.1,)),
     "draft_seconds has 1 values but draft_bs_probes has 2 probes"),
    (lambda: SpsTable((4,), (1.0,), 8, draft_bs_probes=(2, 1), draft_seconds=(0.1, 0.1)),
     "draft_bs_probes must be strictly increasing: item 1 \\(1\\) follows 2"),
])
def test_validation_errors_name_the_field_and_the_fix(make, message: str) -> None:
    with pytest.raises(CostModelError, match=message):
        make()


def test_cost_model_error_is_a_value_error() -> None:
    assert issubclass(CostModelError, ValueError)


def test_json_round_trip_is_exact(tmp_path: Path) -> None:
    with_draft = AdditiveCostTable(0.0013, (1, 8, 32), (0.0, 1 / 3, 0.7), (4, 64), (0.1, 0.2),
                                   draft_bs_probes=(1, 32), draft_seconds=(0.002, 0.004))
    for table in (CLIFF, ADDITIVE, with_draft):
        path = save_cost_model(table, tmp_path / f"{table.kind}.json")
        assert load_cost_model(path) == table
        assert "type" not in json.loads(path.read_text())
    assert "draft_bs_probes" not in CLIFF.to_json()
    assert with_draft.to_json()["draft_seconds"] == [0.002, 0.004]
    assert isinstance(CLIFF.to_json()["sample_batch_tokens"], list)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # no temp files left


def test_save_replaces_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "cost.json"
    path.write_text("stale")
    save_cost_model(ADDITIVE, path)
    assert load_cost_model(path) == ADDITIVE
    assert path.read_text().startswith('{\n  "bias_seconds"')  # indent=2


def test_a_file_in_the_sglang_format_loads(tmp_path: Path) -> None:
    sps = tmp_path / "sps.json"
    sps.write_text('{"sample_batch_tokens": [8, 16, 32], "sample_steps_per_sec": [250.5, 240, 190.25],\n'
                   ' "max_batch_tokens": 32}\n')
    table = load_cost_model(sps)
    assert isinstance(table, SpsTable) and table.sample_steps_per_sec == (250.5, 240.0, 190.25)
    additive = tmp_path / "additive.json"
    additive.write_text(json.dumps({"bias_seconds": 0.0021, "bs_probes": [1, 4, 16],
                                    "alpha_seconds": [0.0, 0.0001, 0.0006], "m_probes": [64, 128],
                                    "theta_seconds": [0.0003, 0.0009]}))
    loaded = load_cost_model(additive)
    assert isinstance(loaded, AdditiveCostTable) and loaded.step_time(4, 96) == pytest.approx(0.0028)


def test_type_key_is_accepted_when_it_agrees() -> None:
    table = cost_model_from_dict({"type": "sps-1d", **CLIFF.to_json()}, "spec cost_model")
    assert table == CLIFF
    assert cost_model_from_dict({"type": "additive", **ADDITIVE.to_json()}, "x") == ADDITIVE


@pytest.mark.parametrize("data, message", [
    ({**CLIFF.to_json(), "max_tokens": 3, "file": "x"},
     r"cost.json: unknown cost-model keys \['file', 'max_tokens'\]; sps-1d tables use"),
    ({"type": "additive", **CLIFF.to_json()},
     r"cost.json: type is 'additive' but the keys \['sample_batch_tokens', .*\] are those of an 'sps-1d' "
     "table; fix the type or the keys"),
    ({"type": "linear", **CLIFF.to_json()},
     "cost.json: type must be 'sps-1d', 'additive' or 'tier', got 'linear'"),
    ({**CLIFF.to_json(), "bias_seconds": 0.1}, r"cost.json: mixes sps-1d keys .* and additive keys \['bias_"),
    ({}, "cost.json: cannot tell the cost-model kind"),
    ({"type": "sps-1d"}, r"cost.json: the sps-1d table is missing \['sample_batch_tokens', "),
    ({"sample_batch_tokens": [4], "sample_steps_per_sec": [1.0]},
     r"cost.json: the sps-1d table is missing \['max_batch_tokens'\]"),
    ({**CLIFF.to_json(), "sample_steps_per_sec": [1.0, 0.0, 1.0, 1.0]},
     "cost.json: sample_steps_per_sec item 1 is 0.0"),
    ({**ADDITIVE.to_json(), "m_probes": "64"}, "cost.json: m_probes must be a list of integers"),
    ([1, 2], "cost.json: a cost model must be a JSON object, got list"),
])
def test_dict_errors_name_the_place_and_the_keys(data, message: str) -> None:
    with pytest.raises(CostModelError, match=message):
        cost_model_from_dict(data, "cost.json")


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    with pytest.raises(CostModelError, match=f"{missing}: cannot read the cost-model file"):
        load_cost_model(missing)
    broken = tmp_path / "broken.json"
    broken.write_text('{"sample_batch_tokens": [4,\n')
    with pytest.raises(CostModelError, match=f"{broken}: not valid JSON at line 2"):
        load_cost_model(broken)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**CLIFF.to_json(), "extra": 1}))
    with pytest.raises(CostModelError, match=f"{bad}: unknown cost-model keys \\['extra'\\]"):
        load_cost_model(bad)


# --- tier table ------------------------------------------------------------------------------------------

# Tiers 8 / 16 / 32; B probes 1 and 5. Every step in (8, 16] replays the 16-row graph.
TIER = TierCostTable(tiers=(8, 16, 32), bs_probes=(1, 5),
                     step_seconds=((0.001, 0.002, 0.004), (0.003, 0.006, 0.012)))


def test_tier_lookup_is_flat_within_a_tier_and_jumps_at_the_boundary() -> None:
    assert TIER.step_time(1, 9) == TIER.step_time(1, 12) == TIER.step_time(1, 16) == 0.002
    assert TIER.step_time(1, 8) == 0.001 and TIER.step_time(1, 0) == 0.001
    assert TIER.step_time(1, 17) == 0.004  # one row past the tier: the next tier's time, not a blend
    assert TIER.tier_of(16) == 16 and TIER.tier_of(17) == 32 and TIER.tier_of(1) == 8
    got = TIER.step_time_many(5, np.array([1, 8, 9, 16, 17, 32]))
    assert got.tolist() == [0.003, 0.003, 0.006, 0.006, 0.012, 0.012]
    assert TIER.max_rows == 32 and TIER.kind == "tier"


def test_tier_interpolates_along_b_within_one_column_and_clamps() -> None:
    # B=2 is a quarter of the way from probe 1 to probe 5, in each tier's own column.
    assert TIER.step_time(2, 12) == pytest.approx(0.002 + 0.25 * 0.004)
    assert TIER.step_time(3, 20) == pytest.approx(0.004 + 0.5 * 0.008)
    assert TIER.step_time(3, 16) < TIER.step_time(3, 17)  # interpolation never blends the tiers
    assert TIER.step_time(0, 4) == 0.001 and TIER.step_time(64, 4) == 0.003  # clamped at the probes
    assert TIER.step_time(5, 30) == 0.012  # exactly at a probe: that probe's value, no rounding


def test_tier_rows_past_the_last_tier_are_infeasible() -> None:
    with pytest.raises(CostModelError, match=r"num_rows 33 is outside \[0, last tier=32\]; .* capture"):
        TIER.step_time(1, 33)
    with pytest.raises(CostModelError, match="num_rows 40 is outside"):
        TIER.step_time_many(1, np.array([4, 40]))
    with pytest.raises(CostModelError, match="num_rows must be an integer >= 0, got -1"):
        TIER.step_time(1, -1)


def test_tier_json_round_trip_with_and_without_a_draft_term(tmp_path: Path) -> None:
    with_draft = TierCostTable([16, 64], [1, 8], [[0.001, 0.002], [0.003, 0.004]],  # type: ignore[arg-type]
                               draft_bs_probes=(1, 8), draft_seconds=(0.0005, 0.0009))
    assert with_draft.step_seconds == ((0.001, 0.002), (0.003, 0.004))  # lists became tuples
    assert with_draft.draft_time(8) == 0.0009 and TIER.draft_time(3) == 0.0
    for table in (TIER, with_draft):
        path = save_cost_model(table, tmp_path / f"{len(table.tiers)}.json")
        data = json.loads(path.read_text())
        assert data["step_seconds"][0] == list(table.step_seconds[0]) and "type" not in data
        assert load_cost_model(path) == table
    assert cost_model_from_dict({"type": "tier", **TIER.to_json()}, "spec") == TIER
    assert hash(TIER) == hash(cost_model_from_dict(TIER.to_json(), "x"))


@pytest.mark.parametrize("make, message", [
    (lambda: TierCostTable((8, 8), (1,), ((1.0, 1.0),)), r"tiers must be strictly increasing: item 1 \(8\)"),
    (lambda: TierCostTable((), (1,), ((),)), "tiers is empty"),
    (lambda: TierCostTable((8,), (2, 1), ((1.0,), (1.0,))), "bs_probes must be strictly increasing"),
    (lambda: TierCostTable((8, 16), (1, 2), ((1.0, 1.0),)),
     "step_seconds has 1 rows but bs_probes has 2 probes; give one row"),
    (lambda: TierCostTable((8, 16), (1, 2), ((1.0, 1.0), (1.0,))),
     r"step_seconds row 1 \(B=2\) has 1 values but tiers has 2; give one value per tier"),
    (lambda: TierCostTable((8, 16), (1,), ((1.0, 0.0),)),
     r"step_seconds row 0 \(B=1\) item 1 \(tier 16\) is 0.0; step seconds must be > 0"),
    (lambda: TierCostTable((8,), (1,), ((float("inf"),),)), "step_seconds row 0 item 0 is inf"),
    (lambda: TierCostTable((8,), (1,), (1.0,)), "step_seconds row 0 must be a list of numbers"),
    (lambda: TierCostTable((8,), (1,), "x"), "step_seconds must be a list of rows"),
    (lambda: TierCostTable((8,), (1,), ((1.0,),), draft_bs_probes=(1,)),
     "draft_bs_probes is given but draft_seconds is empty"),
])
def test_tier_validation_errors_name_the_field_and_the_fix(make, message: str) -> None:
    with pytest.raises(CostModelError, match=message):
        make()


@pytest.mark.parametrize("data, message", [
    ({"type": "additive", **TIER.to_json()},
     r"type is 'additive' but the keys \['tiers', 'step_seconds'\] are those of a 'tier' table"),
    ({**TIER.to_json(), "m_probes": [1]}, r"mixes additive keys \['m_probes'\] and tier keys \['tiers', "),
    ({"bs_probes": [1], "step_seconds": [[1.0]]}, r"the tier table is missing \['tiers'\]"),
    ({"bs_probes": [1]}, "cannot tell the cost-model kind; give one of .* the tier keys"),
    ({"type": "tier", "bs_probes": [1]}, r"the tier table is missing \['tiers', 'step_seconds'\]"),
    ({**TIER.to_json(), "tier_seconds": 1},
     r"unknown cost-model keys \['tier_seconds'\]; .* tier tables use"),
])
def test_tier_dict_errors(data, message: str) -> None:
    with pytest.raises(CostModelError, match=message):
        cost_model_from_dict(data, "cost.json")


def test_shared_bs_probes_key_still_detects_an_additive_table() -> None:
    assert cost_model_from_dict(ADDITIVE.to_json(), "x") == ADDITIVE
