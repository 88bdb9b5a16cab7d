"""steps.jsonl and run.json (dspark.formats.step_records, dspark.formats.run_info): round trips, the ring,
and strict reading with errors naming the file, line and field."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dspark.formats.run_info import RunInfo, RunInfoError, read_run_info, write_run_info
from dspark.formats.step_records import RequestRecord, StepRecord, StepRecordError, StepRing, read_steps

GAMMA = 3


def record(committed: int = 4, *, survival: bool = True) -> StepRecord:
    requests = (RequestRecord(0, 1, 3, 2, 2, 3, (1.0, 0.5, -0.5), (0.7, 0.5, 0.3) if survival else None),
                RequestRecord(1, 4, 1, 0, 1, 1, None, None))
    return StepRecord(num_reqs=2, lag=0, mode="compact", budget=2, aligned_budget=None, decision_tau=3.5,
                      planned_rows=4, rows=4, tier=8, padding_rows=4, tau=3.2, committed=committed,
                      predicted_step_seconds=0.01, step_seconds=0.012, requests=requests)


def test_the_ring_numbers_records_keeps_the_last_and_reads_back(tmp_path: Path) -> None:
    ring = StepRing(capacity=2)
    for committed in (4, 5, 6):
        ring.append(record(committed))
    assert ring.total == 3 and [r.step for r in ring.records] == [1, 2]
    path = ring.write(tmp_path / "steps.jsonl")
    steps = read_steps(path, GAMMA)
    assert steps == tuple(ring.records) and steps[1].committed == 6
    first = json.loads(path.read_text().splitlines()[0])
    assert list(first)[:3] == ["step", "num_reqs", "lag"] and first["requests"][1]["confidence"] is None


def test_a_record_is_written_only_with_its_index() -> None:
    with pytest.raises(StepRecordError, match="append it to a StepRing"):
        record().to_json()
    assert StepRecord.from_json(replace(record(), step=7).to_json(), GAMMA, "x").step == 7


def test_survival_and_confidence_may_be_null() -> None:
    data = replace(record(survival=False), step=0).to_json()
    parsed = StepRecord.from_json(data, GAMMA, "x")
    assert parsed.requests[0].survival is None and parsed.requests[0].confidence == (1.0, 0.5, -0.5)
    assert parsed.requests[1].confidence is None


def test_accept_prob_round_trips_and_may_be_absent() -> None:
    with_prob = replace(record(), step=0)
    first = replace(with_prob.requests[0], accept_prob=(1.0, 0.25, 0.0))
    with_prob = replace(with_prob, requests=(first, with_prob.requests[1]))
    data = with_prob.to_json()
    assert "accept_prob" not in data["requests"][1]  # written only where it was computed
    assert StepRecord.from_json(data, GAMMA, "x").requests[0].accept_prob == (1.0, 0.25, 0.0)
    data["requests"][0]["accept_prob"] = [1.0, 1.5, 0.0]
    with pytest.raises(StepRecordError, match=r"x: requests\[0\]: accept_prob must hold probabilities"):
        StepRecord.from_json(data, GAMMA, "x")


def step_json(**changes: Any) -> dict[str, Any]:
    return {**replace(record(), step=0).to_json(), **changes}


@pytest.mark.parametrize("changes, message", [
    ({"num_reqs": 3}, "num_reqs is 3 but requests has 2 entries"),
    ({"mode": "fast"}, r"mode must be one of \['static', 'cap-accept', 'compact'\], got 'fast'"),
    ({"budget": True}, "field 'budget' must be int or null, got True"),
    ({"tau": float("nan")}, "field 'tau' must be a finite number, got nan"),
    ({"step_seconds": -1.0}, "step_seconds must be >= 0"),
    ({"extra": 1}, r"unknown field\(s\) \['extra'\]"),
    ({"requests": [{"slot": 0}] * 2}, r"requests\[0\]: missing field 'generation'"),
])
def test_bad_fields_are_named(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(StepRecordError, match="^f:3: .*" + message):
        StepRecord.from_json(step_json(**changes), GAMMA, "f:3")


def test_request_errors_name_the_request_and_the_gamma() -> None:
    data = step_json()
    data["requests"][1] = {**data["requests"][1], "confidence": [0.1]}
    message = r"f:1: requests\[1\]: field 'confidence' has 1 values, expected gamma=3"
    with pytest.raises(StepRecordError, match=message):
        StepRecord.from_json(data, GAMMA, "f:1")
    data["requests"][1] = {**data["requests"][1], "confidence": None, "verify_len": 5}
    with pytest.raises(StepRecordError, match=r"verify_len 5 is outside \[1, gamma\+1=4\]"):
        StepRecord.from_json(data, GAMMA, "f:1")


def test_read_steps_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    with pytest.raises(StepRecordError, match="steps file not found"):
        read_steps(path, GAMMA)
    good = json.dumps(step_json())
    path.write_text(good + "\n\n" + good[:-10] + "\n")  # a blank line still counts, a torn last line
    with pytest.raises(StepRecordError, match=re.escape(f"{path}:3: not valid JSON") + ".*delete that line"):
        read_steps(path, GAMMA)
    path.write_text(good + "\n")
    assert len(read_steps(path, GAMMA)) == 1


RUN = {"deployment": "tiny", "verify_mode": "compact", "backend": "cpu", "device": "generic", "gamma": 7,
       "lag_steps": 0, "policy": "greedy", "tiers": [8, 16], "target_only": False, "fingerprint": {"x": 1},
       "stats": {"steps": 3}}


def test_run_info_round_trips(tmp_path: Path) -> None:
    info = RunInfo.from_json({"format": "dspark-run", "version": 1, **RUN, "recorded_steps": 3,
                              "total_steps": 3}, "run")
    assert info.tiers == (8, 16) and info.stats == {"steps": 3}
    write_run_info(tmp_path, info)
    assert read_run_info(tmp_path) == info
    assert list(json.loads((tmp_path / "run.json").read_text())) == ["format", "version", *RUN,
                                                                     "recorded_steps", "total_steps"]


@pytest.mark.parametrize("changes, message", [
    ({"format": "dspark-profile"}, "not a dspark run"),
    ({"version": 2}, "run format version 2 is not supported"),
    ({"verify_mode": "fast"}, "verify_mode must be one of"),
    ({"gamma": True}, "field 'gamma' must be int, got True"),
    ({"tiers": [8, 0]}, "field 'tiers' must hold integers >= 1"),
    ({"stats": None}, None),  # a run that failed before it finished has no stats
    ({"speed": 1}, r"unknown field\(s\) \['speed'\]"),
])
def test_run_info_errors_name_the_field(tmp_path: Path, changes: dict[str, Any], message: str | None) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"format": "dspark-run", "version": 1, **RUN, **changes}))
    if message is None:
        assert read_run_info(tmp_path).stats is None
        return
    with pytest.raises(RunInfoError, match=re.escape(str(tmp_path / "run.json")) + ": " + message):
        read_run_info(tmp_path)
