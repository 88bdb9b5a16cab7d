"""The profile.json format (dspark.formats.profile): strict reading, errors naming the place, tiers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dspark.formats.profile import ProfileError, ProfilePlan, ProfileResult, ProfileSample, parse_tiers

REPO = Path(__file__).resolve().parents[1]
PLAN = ProfilePlan(batch_sizes=(1, 2), num_draft_tokens=4, max_rows=8, extra_rows=(3, 4, 5))


def profile_json(**changes: Any) -> dict[str, Any]:
    result = ProfileResult(PLAN, (ProfileSample(1, 4, (0.001, 0.002)), ProfileSample(2, 8, (0.003,))),
                           (ProfileSample(2, 3, (0.002,)),), {"tiers": "4,8", "backend": "cpu"})
    return {**result.to_json(), **changes}


def sample(**changes: Any) -> dict[str, Any]:
    return {"num_reqs": 2, "num_rows": 3, "seconds": [0.1], **changes}


def test_the_committed_profiles_round_trip_byte_for_byte(tmp_path: Path) -> None:
    for path in sorted(REPO.glob("specs/tables/*/profile.json")):
        result = ProfileResult.load(path)
        assert result.save(tmp_path / "p.json").read_text() == path.read_text()
    assert ProfileResult.load(REPO / "specs/tables/tiny_cpu_tiers/profile.json").tiers[:3] == (8, 16, 24)


def test_a_profile_knows_its_tiers() -> None:
    assert ProfileResult.from_json(profile_json()).tiers == (4, 8)
    assert parse_tiers("") == () and parse_tiers(" 8,16 ") == (8, 16)
    with pytest.raises(ProfileError, match="meta.tiers is '8,8'; tiers must be >= 1 and strictly increasing"):
        parse_tiers("8,8")


@pytest.mark.parametrize("changes, message", [
    ({"format": "dspark-run"}, "not a profile result"),
    ({"version": 2}, "profile result version 2 is not supported"),
    ({"extra": 1}, r"unknown field\(s\) \['extra'\]"),
    ({"static": [sample(seconds=[])]}, r"static\[0\]: sample .* has no measurements"),
    ({"grid": [sample(num_reqs="2")]}, r"grid\[0\]: field 'num_reqs' must be int"),
    ({"grid": [sample(seconds=[True])]}, r"grid\[0\]: field 'seconds' must hold numbers"),
    ({"grid": [sample(seconds=[0.0])]}, r"grid\[0\]: .* has step times \[0.0\]"),
    ({"meta": {"tiers": "8,x"}}, "meta.tiers is '8,x'"),
])
def test_malformed_profiles_name_the_place(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ProfileError, match="^p.json: .*" + message):
        ProfileResult.from_json(profile_json(**changes), "p.json")


@pytest.mark.parametrize("changes, message", [
    ({"batch_sizes": [1, True]}, "field 'batch_sizes' must hold integers >= 1"),
    ({"repeats": 2.5}, "field 'repeats' must be int"),
    ({"repeats": 0}, "ProfilePlan.repeats must be >= 1"),
    ({"max_rows": 2}, r"batch sizes \[\] need|no batch size has B·N <= max_rows=2"),
])
def test_malformed_plans_name_the_field(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ProfileError, match="^p.json: plan: .*" + message):
        ProfileResult.from_json(profile_json(plan={**PLAN.to_json(), **changes}), "p.json")


def test_load_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    with pytest.raises(ProfileError, match=f"{path}: profile not found"):
        ProfileResult.load(path)
    path.write_text(json.dumps(profile_json())[:-5])
    with pytest.raises(ProfileError, match=f"{path}:1: not valid JSON"):
        ProfileResult.load(path)
