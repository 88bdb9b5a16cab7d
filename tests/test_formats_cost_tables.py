"""The cost-table format (dspark.formats.cost_tables): validation, kind detection, reading and writing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dspark.formats.cost_tables import (
    AdditiveCostModel,
    CostTableError,
    Sps1dCostModel,
    TierCostModel,
    cost_table_from_json,
    cost_table_json,
    cost_table_kind,
    read_cost_table,
    write_cost_table,
)

SPS = {"sample_batch_tokens": [8, 64, 65, 96], "sample_steps_per_sec": [900.0, 800.0, 500.0, 480.0],
       "max_batch_tokens": 96}
ADDITIVE = {"bias_seconds": 0.001, "bs_probes": [1, 8], "alpha_seconds": [0.0, 0.0007], "m_probes": [4, 64],
            "theta_seconds": [0.0002, 0.0032]}
TIER = {"tiers": [8, 16, 32], "bs_probes": [1, 5], "step_seconds": [[0.001, 0.002, 0.004],
                                                                    [0.003, 0.006, 0.012]]}
DRAFT = {"draft_bs_probes": [1, 32], "draft_seconds": [0.002, 0.004]}


def test_each_kind_is_told_by_its_own_keys() -> None:
    assert cost_table_kind(SPS, "x") == "sps-1d"
    assert cost_table_kind(ADDITIVE, "x") == "additive"  # bs_probes is shared; bias_seconds is not
    assert cost_table_kind(TIER, "x") == "tier"
    assert isinstance(cost_table_from_json({"type": "tier", **TIER}, "x"), TierCostModel)
    assert isinstance(cost_table_from_json(ADDITIVE, "x"), AdditiveCostModel)


@pytest.mark.parametrize("data, message", [
    ({"type": "additive", **SPS},
     r"type is 'additive' but the keys \['sample_batch_tokens', .*\] are those of the 'sps-1d' kind"),
    ({"type": "linear", **SPS}, "type must be 'sps-1d', 'additive' or 'tier', got 'linear'"),
    ({**SPS, "bias_seconds": 0.1}, r"mixes sps-1d keys .* and additive keys \['bias_seconds'\]"),
    ({**TIER, "m_probes": [1]}, r"mixes additive keys \['m_probes'\] and tier keys \['tiers', "),
    ({}, "cannot tell the cost-model kind; give one of the sps-1d keys"),
    ({"bs_probes": [1]}, "cannot tell the cost-model kind"),
    ({"type": "sps-1d"}, "sps-1d table: sample_batch_tokens: Field required"),
    ({**SPS, "max_tokens": 3}, "sps-1d table: max_tokens: Extra inputs are not permitted"),
    ({**ADDITIVE, "m_probes": "64"}, "additive table: m_probes: Input should be a valid tuple"),
    ({**SPS, "sample_steps_per_sec": [1.0, 0.0, 1.0, 1.0]}, "steps per second must all be > 0"),
    ({**SPS, "sample_batch_tokens": [8, 64, 64, 96]}, r"strictly increasing, but item 2 \(64\) follows 64"),
    ({**SPS, "sample_batch_tokens": [8.5, 64, 65, 96]}, r"sample_batch_tokens\[0\]: Input should be"),
    ({**SPS, "sample_batch_tokens": [True, 64, 65, 96]}, r"sample_batch_tokens\[0\]: Input should be"),
    ({**SPS, "sample_steps_per_sec": [900.0, float("nan"), 1.0, 1.0]}, r"\[1\]: Input should be a finite"),
    ([1, 2], "a cost model must be a JSON object, got list"),
])
def test_malformed_objects_name_the_place_the_kind_and_the_field(data: Any, message: str) -> None:
    with pytest.raises(CostTableError, match="^cost.json: .*" + message):
        cost_table_from_json(data, "cost.json")


def test_an_sps_table_covers_its_own_probes() -> None:
    with pytest.raises(CostTableError, match="max_batch_tokens: is 64 but sample_batch_tokens reaches 96 "
                                             r"\(raise max_batch_tokens"):
        cost_table_from_json({**SPS, "max_batch_tokens": 64}, "x")
    assert cost_table_from_json({**SPS, "max_batch_tokens": 200}, "x").max_batch_tokens == 200


@pytest.mark.parametrize("table", [SPS, ADDITIVE, TIER])
def test_the_draft_term_is_both_lists_or_neither(table: dict[str, Any]) -> None:
    assert cost_table_from_json({**table, **DRAFT}, "x").draft_seconds == (0.002, 0.004)
    with pytest.raises(CostTableError, match="draft_bs_probes is given but draft_seconds is empty"):
        cost_table_from_json({**table, "draft_bs_probes": [1, 32]}, "x")
    with pytest.raises(CostTableError, match="draft_seconds: has 2 entries but draft_bs_probes has 0"):
        cost_table_from_json({**table, "draft_seconds": [0.002, 0.004]}, "x")
    with pytest.raises(CostTableError, match="draft_bs_probes: .* strictly increasing"):
        cost_table_from_json({**table, "draft_bs_probes": [32, 1], "draft_seconds": [0.1, 0.1]}, "x")
    with pytest.raises(CostTableError, match="draft_seconds: draft times must be ≥ 0"):
        cost_table_from_json({**table, **DRAFT, "draft_seconds": [0.1, -0.1]}, "x")


@pytest.mark.parametrize("change, message", [
    ({"bias_seconds": -0.1}, "bias_seconds: Input should be greater than or equal to 0"),
    ({"alpha_seconds": [0.0, -1e-3]}, "alpha_seconds: times must be ≥ 0"),
    ({"alpha_seconds": [0.0]}, "alpha_seconds: has 1 entries but bs_probes has 2"),
    ({"bias_seconds": 0.0, "theta_seconds": [0.0, 0.5]},
     r"bias_seconds \+ min\(alpha_seconds\) \+ min\(theta_seconds\) is 0, so some steps would be predicted"),
])
def test_additive_rules(change: dict[str, Any], message: str) -> None:
    with pytest.raises(CostTableError, match=message):
        cost_table_from_json({**ADDITIVE, **change}, "x")


@pytest.mark.parametrize("change, message", [
    ({"tiers": [8, 8, 32]}, r"tiers: tiers must be strictly increasing, but item 1 \(8\)"),
    ({"tiers": []}, "tiers: Tuple should have at least 1 item"),
    ({"step_seconds": [[0.001, 0.002, 0.004]]}, "step_seconds: has 1 entries but bs_probes has 2"),
    ({"step_seconds": [[0.001, 0.002, 0.004], [0.003]]}, "step_seconds: row 1 has 1 entries but tiers has 3"),
    ({"step_seconds": [[0.001, 0.0, 0.004], [0.003, 0.006, 0.012]]}, "row 0 has a step time ≤ 0"),
    ({"step_seconds": [1.0, 2.0]}, r"step_seconds\[0\]: Input should be a valid tuple"),
])
def test_tier_rules(change: dict[str, Any], message: str) -> None:
    with pytest.raises(CostTableError, match=message):
        cost_table_from_json({**TIER, **change}, "x")


def test_write_then_read_gives_the_same_table_in_sglangs_key_order(tmp_path: Path) -> None:
    for data in (SPS, {**ADDITIVE, **DRAFT}, TIER):
        table = cost_table_from_json(data, "x")
        path = write_cost_table(tmp_path / f"{table.type}.json", table, fingerprint={"backend": "cpu"})
        written = json.loads(path.read_text())
        assert list(written) == [*data, "fingerprint"] and "type" not in written  # SGLang's files have none
        assert written == {**data, "fingerprint": {"backend": "cpu"}}
        again = read_cost_table(path)
        assert cost_table_json(again) == cost_table_json(table) and again.fingerprint == {"backend": "cpu"}
    assert cost_table_json(cost_table_from_json(SPS, "x")) == SPS  # no draft term, no fingerprint: left out
    assert path.read_text().startswith('{\n  "tiers"')  # indent=2
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_read_errors_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    with pytest.raises(CostTableError, match=f"{missing}: cost-model file not found"):
        read_cost_table(missing)
    broken = tmp_path / "broken.json"
    broken.write_text('{"sample_batch_tokens": [4,\n')
    with pytest.raises(CostTableError, match=f"{broken}:2: not valid JSON"):
        read_cost_table(broken)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**SPS, "extra": 1}))
    with pytest.raises(CostTableError, match=f"{bad}: sps-1d table: extra: Extra inputs are not permitted"):
        read_cost_table(bad)


def test_the_spec_names_stay_importable() -> None:
    # The spec validates inline tables and table files with these models.
    from dspark.formats.cost_tables import COST_TABLE_MODELS, CostTable

    assert COST_TABLE_MODELS == {"sps-1d": Sps1dCostModel, "additive": AdditiveCostModel,
                                 "tier": TierCostModel}
    assert CostTable == Sps1dCostModel | AdditiveCostModel | TierCostModel
