"""`dspark simulate` end to end: a short static recording of the embedded pair replayed under the
compact build's planner, the JSON schema, the plot, and every input it must refuse in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dspark.cli.main import main
from dspark.modes import VerifyMode

from .test_simulate import _write_recording

REPO = Path(__file__).resolve().parents[1]
STATIC = REPO / "generated" / "tiny_cpu_static"
COMPACT = REPO / "generated" / "tiny_cpu_compact"
RESULT_KEYS = {"concurrency", "policy", "verify_len", "tokens_per_s", "tokens_per_step", "rows_per_step",
               "off_share"}


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sim") / "rec"
    assert main(["run", str(STATIC), "--prompt", "def main(argv):", "--prompt", "import os\nimport sys\n",
                 "--prompt", "class Queue:", "--max-new-tokens", "32", "--record", str(out)]) == 0
    return out


def by_policy(results: list[dict], policy: str) -> dict:
    return next(r for r in results if r["policy"] == policy)


def test_simulate_prints_every_policy_as_json_and_draws_the_plot(recording: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    png = tmp_path / "sim.png"
    assert main(["simulate", str(COMPACT), "--trace", str(recording), "--concurrency", "1,8",
                 "--steps", "40", "--json", "--plot", str(png)]) == 0
    doc = json.loads(capsys.readouterr().out)
    results = doc["results"]
    assert all(set(r) == RESULT_KEYS for r in results)
    for c in (1, 8):
        at = [r for r in results if r["concurrency"] == c]
        assert [r["policy"] for r in at] == (["target-only", "static"] + ["fixed"] * 8
                                             + ["adaptive-on", "adaptive", "informed", "oracle"])
        assert by_policy(at, "target-only")["tokens_per_step"] == c  # one token per request
        assert by_policy(at, "target-only")["off_share"] == 1.0 and by_policy(at, "static")["off_share"] == 0
        assert [r["verify_len"] for r in at if r["policy"] == "fixed"] == list(range(1, 9))
        assert all(r["verify_len"] is None for r in at if r["policy"] != "fixed")
        by = {(r["policy"], r["verify_len"]): r for r in at}
        assert by["static", None]["tokens_per_s"] == by["fixed", 8]["tokens_per_s"]
        assert by["static", None]["rows_per_step"] == 8 * c
        assert all(by["oracle", None]["tokens_per_step"] >= r["tokens_per_step"] for r in at)
        # A greedy trace's acceptance probabilities are 0 or 1: the informed bound is the oracle.
        assert by["informed", None]["tokens_per_s"] == pytest.approx(by["oracle", None]["tokens_per_s"])
        assert all(r["tokens_per_s"] > 0 for r in at)
    comparisons = doc["comparisons"]
    assert [c["concurrency"] for c in comparisons] == [1, 8]
    assert set(comparisons[0]) == {"concurrency", "best_fixed_verify_len", "adaptive_over_best_fixed",
                                   "adaptive_over_oracle", "adaptive_over_static", "adaptive_dropped_drafts",
                                   "adaptive_over_target_only", "adaptive_over_best", "adaptive_off_share",
                                   "adaptive_on_over_informed"}
    dropped = comparisons[1]["adaptive_dropped_drafts"]
    assert 0 <= dropped["mean_survival"] <= 1 and 0 <= dropped["reach_rate"] <= 1
    adaptive_8 = next(r for r in results if r["concurrency"] == 8 and r["policy"] == "adaptive")
    oracle_8 = next(r for r in results if r["concurrency"] == 8 and r["policy"] == "oracle")
    assert comparisons[1]["adaptive_over_oracle"] == pytest.approx(adaptive_8["tokens_per_s"] /
                                                                    oracle_8["tokens_per_s"])
    assert doc["cost_model"]["kind"] == "additive" and doc["trace_policy"] == "greedy"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_default_concurrencies_are_those_the_table_covers(recording: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["simulate", str(COMPACT), "--trace", str(recording / "steps.jsonl"), "--steps", "5"]) == 0
    out = capsys.readouterr().out
    # The embedded table was profiled up to B = 32: 64 and more would only repeat its edge.
    assert "concurrency 32" in out and "concurrency 64" not in out
    assert "adaptive / best fixed" in out and "fixed k=8" in out


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], *says: str) -> None:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dspark: error: ") and err.count("\n") == 1, err
    for text in says:
        assert text in err, err


def test_inputs_a_simulation_cannot_use_are_refused_in_one_line(recording: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    base = ["simulate", str(COMPACT), "--trace"]
    compact = _write_recording(tmp_path / "compact", VerifyMode.COMPACT)
    _fails([*base, str(compact)], capsys, "run.json: verify_mode is compact", "record a static build")
    _fails([*base, str(tmp_path / "missing")], capsys, "no such recording directory")
    (tmp_path / "empty").mkdir()
    _fails([*base, str(tmp_path / "empty")], capsys, "run.json: run description not found")
    bad_table = tmp_path / "table.json"
    bad_table.write_text('{"bias_seconds": 0.001, "bs_probes": [1]}')
    _fails([*base, str(recording), "--cost-model", str(bad_table)], capsys, str(bad_table), "additive")
    _fails([*base, str(recording), "--cost-model", str(tmp_path / "none.json")], capsys, "none.json",
           "not found")
    _fails([*base, str(recording), "--concurrency", "8,64"], capsys, "--concurrency 64 does not fit",
           "largest batch probe 32")
    _fails([*base, str(recording), "--concurrency", "8,x"], capsys, "comma-separated positive integers")
    _fails([*base, str(recording), "--steps", "0"], capsys, "--steps must be a positive integer")
    _fails(["simulate", str(STATIC), "--trace", str(recording)], capsys, "static build", "no planner")
    sampled = tmp_path / "sampled"
    shutil.copytree(recording, sampled)
    run = json.loads((sampled / "run.json").read_text())
    run["policy"] = run["fingerprint"]["policy"] = "sample:temperature=0.8,top_p=0.95,top_k=0"
    (sampled / "run.json").write_text(json.dumps(run))
    _fails([*base, str(sampled)], capsys, "policy is sample:temperature=0.8", "serves greedy",
           "--temperature 0.0")
    hand = _write_recording(tmp_path / "gamma3")
    _fails([*base, str(hand)], capsys, "gamma is 3", "gamma = 7")
