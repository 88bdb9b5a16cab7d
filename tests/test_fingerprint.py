"""Fingerprints: what a table was measured on, compared with the spec being compiled."""

from __future__ import annotations

import json
import runpy
from dataclasses import replace
from pathlib import Path

import pytest

from dspark.compiler import compile_spec
from dspark.fingerprint import (
    CALIBRATION_FIELDS,
    COST_FIELDS,
    Fingerprint,
    FingerprintError,
    fingerprint_of_deployment,
    fingerprint_of_spec,
    sampling_policy,
)
from dspark.spec import SpecError, load_spec

REPO = Path(__file__).resolve().parents[1]
SPS = {"sample_batch_tokens": [4, 8], "sample_steps_per_sec": [100.0, 90.0], "max_batch_tokens": 8}
COMPACT = {"verify": {"mode": "compact"}, "cost_model": {"type": "sps-1d", "file": "cost.json"}}


def example() -> Fingerprint:
    return Fingerprint(backend="cuda", device="h200", dtype="bfloat16", model_geometry="0" * 16,
                       draft="1" * 16, tp=1, dp=1, tiers=(8, 16), verify_mode="compact", gamma=7,
                       policy="greedy")


def test_json_round_trip_and_strict_keys():
    fingerprint = example()
    assert Fingerprint.from_json(json.loads(json.dumps(fingerprint.to_json()))) == fingerprint
    data = {**fingerprint.to_json(), "gpu": "h200"}
    del data["tiers"]
    with pytest.raises(FingerprintError, match=r"unknown keys \['gpu'\] and missing keys \['tiers'\]"):
        Fingerprint.from_json(data)
    with pytest.raises(FingerprintError, match="tp must be an integer"):
        Fingerprint.from_json({**fingerprint.to_json(), "tp": True})
    with pytest.raises(FingerprintError, match="strictly increasing"):
        Fingerprint.from_json({**fingerprint.to_json(), "tiers": [16, 8]})


def test_differences_name_each_field_in_the_chosen_set():
    measured, spec = example(), replace(example(), tiers=(8, 16, 24), policy="sample:temperature=0.7,"
                                        "top_p=1.0,top_k=0", device="h100")
    assert measured.differences(spec, COST_FIELDS) == [
        "device: measured on 'h200' but the spec has 'h100'",
        "tiers: measured on (8, 16) but the spec has (8, 16, 24)"]
    assert measured.differences(spec, CALIBRATION_FIELDS) == [
        "policy: measured on 'greedy' but the spec has 'sample:temperature=0.7,top_p=1.0,top_k=0'"]
    assert measured.differences(measured, COST_FIELDS) == []


def test_sampling_policy():
    assert sampling_policy(0.0, 0.9, 40) == "greedy"
    assert sampling_policy(0.7, 0.9, 0) == "sample:temperature=0.7,top_p=0.9,top_k=0"
    assert sampling_policy(1, 1, 0) == "sample:temperature=1.0,top_p=1.0,top_k=0"


@pytest.mark.parametrize("spec", sorted((REPO / "specs").glob("*.yaml")), ids=lambda p: p.stem)
def test_spec_and_generated_package_fingerprints_agree(spec, monkeypatch):
    from dspark.runtime import package as package_module

    # The tokenizer plays no part in a fingerprint, and the /models checkpoints of the 8B specs are
    # not on this machine, so loading stops short of it.
    monkeypatch.setattr(package_module, "resolve_checkpoint", lambda raw, role, base: Path(base))
    monkeypatch.setattr(package_module, "load_tokenizer", lambda directory: None)
    resolved = load_spec(spec)
    package = package_module.load_package(REPO / "generated" / resolved.name)
    runtime = fingerprint_of_deployment(package.deployment, package.graph_runner.TOKEN_TIERS)
    assert runtime == fingerprint_of_spec(resolved)


def test_relative_draft_checkpoints_agree_from_the_package(write_spec, tmp_path):
    # deployment.py stores a relative checkpoint relative to the package, the spec relative to itself.
    spec = write_spec({"draft": {"checkpoint": "ckpt/draft-v2"},
                       "serving": {"generation": {"temperature": 0.7, "top_p": 0.9}}})
    resolved = load_spec(spec)
    package = compile_spec(spec, tmp_path / "out" / "deep" / "demo")
    deployment_py = tmp_path / "deployment.py"
    deployment_py.write_bytes(package.files["deployment.py"])
    deployment = runpy.run_path(str(deployment_py))["DEPLOYMENT"]
    assert deployment.draft.checkpoint != "ckpt/draft-v2"
    assert fingerprint_of_deployment(deployment, resolved.tiers) == fingerprint_of_spec(resolved)
    assert fingerprint_of_spec(resolved).policy == "sample:temperature=0.7,top_p=0.9,top_k=0"


def test_what_each_kind_of_file_compares(write_spec):
    base = fingerprint_of_spec(load_spec(write_spec()))
    for overrides, fields in (({"draft": {"gamma": 4}}, ["draft", "gamma"]),  # the draft hash has gamma
                              ({"draft": {"checkpoint": "/elsewhere/other-draft"}}, ["draft"]),
                              ({"model": {"geometry": {"num_layers": 3}}}, ["model_geometry"]),
                              ({"model": {"dtype": "bfloat16"}}, ["dtype"]),
                              ({"graph": {"enabled": True, "token_tiers": [8, 128]}}, ["tiers"]),
                              ({"serving": {"generation": {"temperature": 0.5}}}, ["policy"])):
        changed = fingerprint_of_spec(load_spec(write_spec(overrides)))
        assert [line.split(":")[0] for line in base.differences(changed, COST_FIELDS + ("policy",))] \
            == fields, overrides
    # The same checkpoint directory under another root is the same draft.
    moved = fingerprint_of_spec(load_spec(write_spec({"draft": {"checkpoint": "/mnt/copy/draft"}})))
    assert moved.draft == base.draft


def stamp(path: Path, fingerprint: Fingerprint, **changes) -> None:
    data = json.loads(path.read_text())
    data["fingerprint"] = {**fingerprint.to_json(), **changes}
    path.write_text(json.dumps(data))


def test_cost_file_with_a_matching_fingerprint_compiles(write_spec, tmp_path):
    (tmp_path / "cost.json").write_text(json.dumps(SPS))
    spec = write_spec(COMPACT)
    fingerprint = fingerprint_of_spec(load_spec(spec))
    stamp(tmp_path / "cost.json", fingerprint)
    resolved = load_spec(spec)
    assert resolved.cost_model_fingerprint == fingerprint and resolved.stale_tables == ()
    planner = compile_spec(spec, tmp_path / "out").files["planner_config.py"].decode()
    assert "fingerprint" not in planner and "max_batch_tokens" in planner


def test_a_stale_cost_file_fails_at_the_spec_line_naming_every_field(write_spec, tmp_path):
    (tmp_path / "cost.json").write_text(json.dumps(SPS))
    spec = write_spec(COMPACT)
    stamp(tmp_path / "cost.json", fingerprint_of_spec(load_spec(spec)), device="h100", tiers=[8, 16],
          policy="sample:temperature=0.7,top_p=1.0,top_k=0")
    with pytest.raises(SpecError) as info:
        load_spec(spec)
    (issue,) = info.value.issues
    assert issue.path == ("cost_model", "file")
    file_line = next(i for i, line in enumerate(spec.read_text().splitlines(), 1) if "cost.json" in line)
    assert issue.location.line == file_line
    assert "device: measured on 'h100' but the spec has 'generic'" in issue.message
    assert "tiers: measured on (8, 16) but the spec has no graph tiers ()" in issue.message
    assert "policy" not in issue.message  # sampling does not change a step's cost
    assert "dspark profile generated/demo" in issue.hint and "--allow-stale-tables" in issue.hint
    resolved = load_spec(spec, allow_stale_tables=True)
    assert resolved.stale_tables == ("WARNING: compiled with --allow-stale-tables: cost_model.file "
                                     "'cost.json' is stale (device, tiers).",)


def test_a_malformed_fingerprint_is_an_error_even_with_the_override(write_spec, tmp_path):
    (tmp_path / "cost.json").write_text(json.dumps({**SPS, "fingerprint": {"device": "h200"}}))
    with pytest.raises(SpecError) as info:
        load_spec(write_spec(COMPACT), allow_stale_tables=True)
    (issue,) = info.value.issues
    assert issue.path == ("cost_model", "file") and "invalid fingerprint" in issue.message
    assert "missing keys" in issue.message


def calibration_file(temperatures: list[float], **extra) -> dict:
    """A calibration as `dspark calibrate` writes it (fit statistics beside the temperatures)."""
    n = len(temperatures)
    return {"temperatures": temperatures, "dataset": "held-out prompts", "num_samples": 512,
            "ece_before": [0.1] * n, "ece_after": [0.02] * n, "brier_before": [0.2] * n,
            "brier_after": [0.15] * n, "auc_before": [0.8] * (n - 1) + [None],
            "auc_after": [0.8] * (n - 1) + [None], "mean_survival_before": [0.5] * n,
            "mean_survival_after": [0.45] * n, "reach_rate": [0.4] * n, "num_bins": 15,
            "grid": [0.5, 1.0, 2.0], **extra}


def test_a_calibration_fitted_under_another_policy_is_stale(write_spec, tmp_path):
    spec = write_spec({"calibration": {"file": "sts.json"}})
    fingerprint = replace(fingerprint_of_spec(load_spec(write_spec(name="plain.yaml"))),
                          policy="sample:temperature=0.7,top_p=1.0,top_k=0", device="h100")
    (tmp_path / "sts.json").write_text(json.dumps(calibration_file([1.0, 1.2, 1.4],
                                                                   fingerprint=fingerprint.to_json())))
    with pytest.raises(SpecError) as info:
        load_spec(spec)
    (issue,) = info.value.issues
    assert issue.path == ("calibration", "file")
    assert "policy: measured on 'sample:temperature=0.7,top_p=1.0,top_k=0' but the spec has 'greedy'" \
        in issue.message
    assert "device" not in issue.message  # calibration does not depend on the hardware
    assert "dspark calibrate" in issue.hint
    resolved = load_spec(spec, allow_stale_tables=True)
    assert resolved.calibration_fingerprint == fingerprint
    assert resolved.calibration_policy == fingerprint.policy


def test_the_runtime_reads_a_fingerprinted_cost_file(tmp_path):
    from dspark.runtime.planner.cost_models import load_cost_model

    (tmp_path / "cost.json").write_text(json.dumps({**SPS, "fingerprint": example().to_json()}))
    assert load_cost_model(tmp_path / "cost.json").sample_batch_tokens == (4, 8)


def test_what_dspark_calibrate_writes_loads_with_its_fingerprint(write_spec, tmp_path):
    import numpy as np

    from dspark.measure.calibration import StsData, calibration_payload, fit_sts

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 3))
    correct = rng.integers(0, 4, size=64)
    mask = np.arange(3)[None, :] < correct[:, None]
    spec = write_spec({"calibration": {"file": "sts.json"}})
    fingerprint = fingerprint_of_spec(load_spec(write_spec(name="plain.yaml")))
    payload = calibration_payload(fit_sts(StsData(logits, mask)), "recorded",
                                  extra={"policy": "greedy", "fingerprint": fingerprint.to_json()})
    (tmp_path / "sts.json").write_text(json.dumps(payload))
    resolved = load_spec(spec)
    assert resolved.temperatures == tuple(payload["temperatures"])
    assert resolved.calibration_fingerprint == fingerprint and resolved.calibration_policy == "greedy"
