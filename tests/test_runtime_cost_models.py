import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.formats.cost_tables import CostTableError, write_cost_table
from dspark.runtime.planner.cost_models import (
    AdditiveCostTable,
    CostModelError,
    SpsTable,
    TierCostTable,
    cost_model_from_dict,
    load_cost_model,
)

REPO = Path(__file__).resolve().parents[1]

# A tier cliff: rows 1..64 replay in the 64-row graph, 65..96 in the 96-row one.
CLIFF = SpsTable(sample_batch_tokens=(8, 64, 65, 96), sample_steps_per_sec=(900.0, 800.0, 500.0, 480.0),
                 max_batch_tokens=96)
ADDITIVE = AdditiveCostTable(bias_seconds=0.001, bs_probes=(1, 8), alpha_seconds=(0.0, 0.0007),
                             m_probes=(4, 64), theta_seconds=(0.0002, 0.0032))
# Tiers 8 / 16 / 32; B probes 1 and 5. Every step in (8, 16] replays the 16-row graph.
TIER = TierCostTable(tiers=(8, 16, 32), bs_probes=(1, 5),
                     step_seconds=((0.001, 0.002, 0.004), (0.003, 0.006, 0.012)))


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
    (lambda: SpsTable((4, 4), (1.0, 1.0), 8),
     r"sps-1d table: sample_batch_tokens: .* strictly increasing, but item 1 \(4\) follows 4"),
    (lambda: SpsTable((4, 16), (1.0, 1.0), 8), "max_batch_tokens: is 8 but sample_batch_tokens reaches 16"),
    (lambda: AdditiveCostTable(0.0, (1,), (0.0,), (1, 2), (0.0, 0.5)),
     r"bias_seconds \+ min\(alpha_seconds\) \+ min\(theta_seconds\) is 0"),
    (lambda: TierCostTable((8, 16), (1,), ((1.0, 0.0),)), "step_seconds: row 0 has a step time ≤ 0"),
])
def test_a_table_built_in_code_passes_the_format_validation(make, message: str) -> None:
    # The same rules as a table file (dspark.formats.cost_tables; tests/test_formats_cost_tables.py).
    with pytest.raises(CostTableError, match=message):
        make()


def test_evaluation_errors_are_value_errors_apart_from_format_errors() -> None:
    assert issubclass(CostModelError, ValueError) and not issubclass(CostModelError, CostTableError)
    with pytest.raises(CostModelError, match="num_reqs must be an integer >= 0, got -1"):
        ADDITIVE.step_time(-1, 4)


def test_format_round_trip_is_exact(tmp_path: Path) -> None:
    with_draft = AdditiveCostTable(0.0013, (1, 8, 32), (0.0, 1 / 3, 0.7), (4, 64), (0.1, 0.2),
                                   draft_bs_probes=(1, 32), draft_seconds=(0.002, 0.004))
    for table in (CLIFF, ADDITIVE, with_draft, TIER):
        assert type(table).from_format(table.to_format()) == table
        path = write_cost_table(tmp_path / f"{table.kind}.json", table.to_format())
        assert load_cost_model(path) == table
        assert cost_model_from_dict(json.loads(path.read_text()), "x") == table
    with pytest.raises(TypeError, match="SpsTable is built from a Sps1dCostModel, got AdditiveCostModel"):
        SpsTable.from_format(ADDITIVE.to_format())  # type: ignore[arg-type]


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


def test_cost_model_from_dict_names_the_place() -> None:
    # The generated planner config embeds the table and builds it at import, naming PLAN.cost_model.
    embedded = {"type": "sps-1d", "sample_batch_tokens": (4, 8), "sample_steps_per_sec": (100.0, 90.0),
                "max_batch_tokens": 8}
    assert cost_model_from_dict(embedded, "PLAN.cost_model") == SpsTable((4, 8), (100.0, 90.0), 8)
    with pytest.raises(CostTableError, match=r"^PLAN.cost_model: sps-1d table: max_batch_tokens: is 6 but "):
        cost_model_from_dict({**embedded, "max_batch_tokens": 6}, "PLAN.cost_model")
    with pytest.raises(CostTableError, match="^PLAN.cost_model: type is 'additive' but the keys"):
        cost_model_from_dict({**embedded, "type": "additive"}, "PLAN.cost_model")


def test_the_committed_tables_load() -> None:
    for path in sorted(REPO.glob("specs/tables/*/*.json")):
        if path.name in ("sps_1d.json", "additive.json", "tier.json"):
            assert load_cost_model(path).kind == {"sps_1d": "sps-1d"}.get(path.stem, path.stem)


# --- tier table ------------------------------------------------------------------------------------------



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


def test_tier_lists_become_tuples_and_the_draft_term_interpolates() -> None:
    with_draft = TierCostTable([16, 64], [1, 8], [[0.001, 0.002], [0.003, 0.004]],  # type: ignore[arg-type]
                               draft_bs_probes=(1, 8), draft_seconds=(0.0005, 0.0009))
    assert with_draft.step_seconds == ((0.001, 0.002), (0.003, 0.004))  # lists became tuples
    assert with_draft.draft_time(8) == 0.0009 and TIER.draft_time(3) == 0.0
    assert hash(TIER) == hash(TierCostTable.from_format(TIER.to_format()))
