"""The STS calibration file format (dspark.formats.sts_calibration): reading, validation, writing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.formats.sts_calibration import (
    CalibrationFileContents,
    CalibrationFileError,
    calibration_json,
    read_calibration,
    write_calibration,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text, message", [
    ('{"dataset": "x"}', "temperatures: Field required"),
    ('{"temperatures": []}', "temperatures: Tuple should have at least 1 item"),
    ('{"temperatures": [1.0, -0.5]}', "temperatures: temperatures must all be > 0"),
    ('{"temperatures": [1.0, NaN]}', "1: holds NaN, which is not a finite number"),  # refused while parsing
    ('{"temperatures": [true]}', r"temperatures\[0\]: Input should be a valid number"),
    ('{"temperatures": ["1.0"]}', r"temperatures\[0\]: Input should be a valid number"),
    ('{"temperatures": [1.0], "ece_before": [0.1, 0.2]}', "ece_before has 2 entries but there are 1 "),
    ('{"temperatures": [1.0], "gamma": 1}', "gamma: Extra inputs are not permitted"),
    ('[1.0]', "a calibration must be a JSON object with 'temperatures', got list"),
])
def test_errors_name_the_file_and_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "sts.json"
    path.write_text(text)
    with pytest.raises(CalibrationFileError, match=f"^{path}:? ?{message}"):
        read_calibration(path)


def test_unreadable_files_name_the_file_and_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(CalibrationFileError, match=f"{missing}: STS calibration file not found"):
        read_calibration(missing)
    broken = tmp_path / "broken.json"
    broken.write_text('{"temperatures":\n [1.0,')
    with pytest.raises(CalibrationFileError, match=f"{broken}:2: not valid JSON"):
        read_calibration(broken)


def test_a_minimal_sglang_file_reads_and_writes_back_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "sts.json"
    path.write_text('{"temperatures": [2, 0.5], "dataset": "gsm8k", "num_samples": 10, "ece_before": [],'
                    ' "ece_after": []}')
    contents = read_calibration(path)
    assert contents.temperatures == (2.0, 0.5) and contents.ece_before == () and contents.policy is None
    out = write_calibration(tmp_path / "again.json", contents)
    assert json.loads(out.read_text()) == {"temperatures": [2.0, 0.5], "dataset": "gsm8k", "num_samples": 10,
                                           "ece_before": [], "ece_after": []}


def test_the_committed_files_round_trip_byte_for_byte(tmp_path: Path) -> None:
    for path in sorted(REPO.glob("specs/tables/*/sts*.json")):
        contents = read_calibration(path)
        assert contents.fingerprint is not None and contents.policy is not None
        assert write_calibration(tmp_path / path.name, contents).read_text() == path.read_text()


def test_sglangs_fields_come_first_and_unset_fields_are_left_out() -> None:
    contents = CalibrationFileContents(temperatures=(1.0, 2.0), dataset="x", num_samples=3, grid=(1.0, 2.0),
                                       policy="greedy", fingerprint={"draft": "d"})
    assert list(calibration_json(contents)) == ["temperatures", "dataset", "num_samples", "grid", "policy",
                                                "fingerprint"]
    assert calibration_json(contents)["fingerprint"] == {"draft": "d"}  # kept, though dumps exclude it
