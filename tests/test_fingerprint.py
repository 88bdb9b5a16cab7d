"""Fingerprints: what a table was measured on, compared with the spec being compiled."""

from __future__ import annotations

import json
import os
import runpy
from dataclasses import replace
from pathlib import Path

import pytest

from dspark.checkpoints.digest import CACHE_FILE, checkpoint_digest
from dspark.checkpoints.dspark_block_config import BlockDraftConfig
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
from tests.conftest import merged

REPO = Path(__file__).resolve().parents[1]
SPS = {"sample_batch_tokens": [4, 8], "sample_steps_per_sec": [100.0, 90.0], "max_batch_tokens": 8}
SPS_WITH_DRAFT = {**SPS, "draft_bs_probes": [1], "draft_seconds": [0.001]}  # times the draft step too
COMPACT = {"verify": {"mode": "compact"}, "cost_model": {"type": "sps-1d", "file": "cost.json"}}


HF_CONFIG = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
             "rope_theta": 10000.0, "rms_norm_eps": 1e-6}
# A draft config.json in the released layout for the target above (the weights file is only bytes:
# the compiler reads the config and digests the files, it never loads the tensors).
DRAFT_CONFIG = BlockDraftConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
    head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, block_size=3, mask_token_id=255,
    target_layer_ids=(0,), num_target_layers=2, markov_rank=64, markov_head_type="vanilla",
    confidence_head=True, confidence_with_markov=True).to_hf()


@pytest.fixture(autouse=True)
def _digest_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "digest-cache"))


def example() -> Fingerprint:
    return Fingerprint(backend="cuda", device="h200", dtype="bfloat16", model_geometry="0" * 16,
                       model_weights="2" * 16, draft="1" * 16, draft_weights="3" * 16, tp=1, dp=1,
                       tiers=(8, 16), verify_mode="compact", gamma=7, policy="greedy")


def checkpoint(directory: Path, config: dict, weights: bytes) -> Path:
    """A checkpoint directory as the digest sees it: config.json and a weights file."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(weights)
    return directory


def pair(root: Path, draft_weights: bytes = b"draft" * 100) -> dict:
    """Spec overrides naming a target and a draft checkpoint written under `root`."""
    checkpoint(root / "target", HF_CONFIG, b"target" * 100)
    checkpoint(root / "draft", DRAFT_CONFIG, draft_weights)
    return {"model": {"checkpoint": str(root / "target"), "geometry": None},
            "draft": {"checkpoint": str(root / "draft")}}


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
    with pytest.raises(FingerprintError, match="draft_weights must be 16 lowercase hex digits"):
        Fingerprint.from_json({**fingerprint.to_json(), "draft_weights": "tiny"})
    assert Fingerprint.from_json({**fingerprint.to_json(), "model_weights": ""}).model_weights == ""


def test_a_fingerprint_from_before_content_digests_says_so():
    old = {key: value for key, value in example().to_json().items() if not key.endswith("_weights")}
    with pytest.raises(FingerprintError, match=r"missing keys \['model_weights', 'draft_weights'\] \(it was "
                                               r"written by an older dspark"):
        Fingerprint.from_json(old)


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
    resolved = load_spec(spec, allow_stale_tables=True)  # agreement does not depend on staleness
    package = package_module.load_package(REPO / "generated" / resolved.name)
    runtime = fingerprint_of_deployment(package.deployment, package.deployment.token_tiers)
    assert runtime == fingerprint_of_spec(resolved)


def test_a_table_names_the_attention_it_was_measured_with():
    """FlashInfer's steps are not the Triton kernel's: their tables must not pass for each other,
    while the default attention keeps the bare backend (tables measured before the field existed)."""
    triton = fingerprint_of_spec(load_spec(REPO / "specs" / "llama31_8b_h200_compact.yaml"))
    flashinfer = fingerprint_of_spec(load_spec(REPO / "specs" / "llama31_8b_h200_flashinfer.yaml"))
    assert (triton.backend, flashinfer.backend) == ("cuda", "cuda+flashinfer")
    differences = triton.differences(flashinfer, COST_FIELDS)
    assert len(differences) == 1 and differences[0].startswith("backend: ")


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


def test_what_each_kind_of_file_compares(write_spec, tmp_path):
    checkpoints = pair(tmp_path / "ckpt")
    base = fingerprint_of_spec(load_spec(write_spec(checkpoints)))
    for overrides, fields in (({"draft": {"gamma": 4}}, ["draft", "gamma"]),  # the draft hash has gamma
                              ({"draft": {"markov_rank": 32}}, ["draft"]),
                              ({"draft": {"target_layer_ids": [-1]}}, ["draft"]),
                              ({"model": {"dtype": "bfloat16"}}, ["dtype"]),
                              ({"graph": {"enabled": True, "token_tiers": [4, 128]}}, ["tiers"]),
                              ({"serving": {"generation": {"temperature": 0.5}}}, ["policy"])):
        # The draft's config.json says block size 3 and Markov rank 64; a spec that says otherwise is
        # an error, so compare the draft's settings against fingerprints of specs without checkpoints.
        drafted = "draft" in overrides
        reference = fingerprint_of_spec(load_spec(write_spec(name="plain.yaml"))) if drafted else base
        changed = fingerprint_of_spec(load_spec(write_spec(overrides if drafted else merged(checkpoints,
                                                                                            overrides))))
        assert [line.split(":")[0] for line in reference.differences(changed, COST_FIELDS + ("policy",))] \
            == fields, overrides


def test_checkpoints_are_identified_by_content_not_by_path(write_spec, tmp_path):
    base = fingerprint_of_spec(load_spec(write_spec(pair(tmp_path / "here"))))
    assert len(base.model_weights) == 16 and len(base.draft_weights) == 16
    moved = fingerprint_of_spec(load_spec(write_spec(pair(tmp_path / "copy" / "elsewhere"))))
    assert moved == base  # the same files anywhere are the same checkpoints
    retrained = fingerprint_of_spec(load_spec(write_spec(pair(tmp_path / "new", b"draft" * 99 + b"drafT"))))
    assert base.differences(retrained, CALIBRATION_FIELDS) == [
        f"draft_weights: measured on {base.draft_weights!r} but the spec has {retrained.draft_weights!r}"]
    # Absent checkpoints (the 8B specs' /models paths) have no content to identify.
    absent = fingerprint_of_spec(load_spec(write_spec()))
    assert (absent.model_weights, absent.draft_weights) == ("", "")


def test_the_generated_deployment_carries_the_checkpoint_digests(write_spec, tmp_path):
    # deployment.py records each checkpoint's digest (ModelRef/DraftRef digest=...), so what the
    # profiler and the recorder stamp on new tables names the weights the package was compiled for.
    spec = write_spec(pair(tmp_path / "ckpt"))
    resolved = load_spec(spec)
    assert resolved.model_digest and resolved.draft_digest
    deployment_py = tmp_path / "deployment.py"
    deployment_py.write_bytes(compile_spec(spec, tmp_path / "out" / "demo").files["deployment.py"])
    deployment = runpy.run_path(str(deployment_py))["DEPLOYMENT"]
    assert deployment.model.digest == resolved.model_digest
    assert deployment.draft.digest == resolved.draft_digest
    assert fingerprint_of_deployment(deployment, resolved.tiers) == fingerprint_of_spec(resolved)


def test_a_table_measured_on_other_weights_is_refused(write_spec, tmp_path):
    # Same shapes, same settings, same directory names: only one byte of the draft's weights differs.
    (tmp_path / "cost.json").write_text(json.dumps(SPS_WITH_DRAFT))
    measured_on = fingerprint_of_spec(load_spec(write_spec(merged(pair(tmp_path / "old"), COMPACT))))
    stamp(tmp_path / "cost.json", measured_on)
    spec = write_spec(merged(pair(tmp_path / "new", b"draft" * 99 + b"drafT"), COMPACT))
    with pytest.raises(SpecError) as info:
        load_spec(spec)
    (issue,) = info.value.issues
    assert issue.path == ("cost_model", "file")
    assert issue.location.line == next(i for i, line in enumerate(spec.read_text().splitlines(), 1)
                                       if "cost.json" in line)
    assert "(1 field differs)" in issue.message and "draft_weights: measured on" in issue.message
    assert "model_weights" not in issue.message
    # The same table is fine for the weights it was measured on, wherever they are.
    copy = write_spec(merged(pair(tmp_path / "copy"), COMPACT), name="copy.yaml")
    assert load_spec(copy).stale_tables == ()


def test_a_verify_only_table_does_not_depend_on_the_draft(write_spec, tmp_path):
    """A table without the draft-time term timed the target's verify step alone: other draft weights
    (or draft settings) do not make it stale; other target weights and gamma still do."""
    (tmp_path / "cost.json").write_text(json.dumps(SPS))
    measured_on = fingerprint_of_spec(load_spec(write_spec(merged(pair(tmp_path / "old"), COMPACT))))
    stamp(tmp_path / "cost.json", measured_on)
    retrained_draft = write_spec(merged(pair(tmp_path / "new", b"draft" * 99 + b"drafT"), COMPACT))
    assert load_spec(retrained_draft).stale_tables == ()
    stamp(tmp_path / "cost.json", replace(measured_on, model_weights="4" * 16))
    with pytest.raises(SpecError, match="model_weights: measured on"):
        load_spec(retrained_draft)


def test_what_is_checked_when_a_checkpoint_is_absent(write_spec, tmp_path):
    (tmp_path / "cost.json").write_text(json.dumps(SPS_WITH_DRAFT))
    present = fingerprint_of_spec(load_spec(write_spec(merged(pair(tmp_path / "ckpt"), COMPACT))))
    absent_spec = write_spec(COMPACT, name="absent.yaml")  # /nonexistent checkpoints, inline geometry
    absent = fingerprint_of_spec(load_spec(absent_spec))
    # Weights cannot be compared with checkpoints that are not here; everything else still is.
    stamp(tmp_path / "cost.json", replace(absent, model_weights=present.model_weights,
                                          draft_weights=present.draft_weights))
    assert load_spec(absent_spec).stale_tables == ()
    stamp(tmp_path / "cost.json", replace(absent, device="h100", draft_weights=present.draft_weights))
    with pytest.raises(SpecError, match="device: measured on 'h100'"):
        load_spec(absent_spec)
    # A table that recorded no weights is stale for a spec whose checkpoints are present.
    stamp(tmp_path / "cost.json", replace(present, draft_weights=""))
    with pytest.raises(SpecError, match="draft_weights: measured on unrecorded weights ''"):
        load_spec(write_spec(merged(pair(tmp_path / "again"), COMPACT), name="present.yaml"))


def test_checkpoint_digest_covers_config_and_weights_only(tmp_path):
    one = checkpoint(tmp_path / "one", HF_CONFIG, b"w" * 1000)
    digest = checkpoint_digest(one)
    assert len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)
    (one / "tokenizer.json").write_text("{}")  # not the model
    assert checkpoint_digest(one) == digest
    shard = checkpoint(tmp_path / "shard", HF_CONFIG, b"w" * 1000)
    (shard / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    assert checkpoint_digest(shard) != digest  # the shard index is part of a sharded checkpoint
    other = checkpoint(tmp_path / "other", {**HF_CONFIG, "rope_theta": 500000.0}, b"w" * 1000)
    assert checkpoint_digest(other) != digest


def test_checkpoint_digests_are_cached_and_invalidated(tmp_path):
    directory = checkpoint(tmp_path / "ckpt", HF_CONFIG, b"w" * 4096)
    digest = checkpoint_digest(directory)
    cache_file = tmp_path / "digest-cache" / CACHE_FILE
    cache = json.loads(cache_file.read_text())
    (entry,) = cache["entries"].values()
    assert entry["digest"] == digest
    # The cached digest is what a second call returns (proved by planting another one) ...
    entry["digest"] = "f" * 64
    cache_file.write_text(json.dumps(cache))
    assert checkpoint_digest(directory) == "f" * 64
    # ... until a file changes: same size, one byte different, a later mtime.
    weights = directory / "model.safetensors"
    weights.write_bytes(b"w" * 4095 + b"x")
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    changed = checkpoint_digest(directory)
    assert changed not in (digest, "f" * 64)
    # A broken cache is ignored and replaced.
    cache_file.write_text("{not json")
    assert checkpoint_digest(directory) == changed
    assert json.loads(cache_file.read_text())["entries"]


def test_an_unwritable_cache_is_not_fatal(tmp_path, monkeypatch):
    directory = checkpoint(tmp_path / "ckpt", HF_CONFIG, b"w")
    expected = checkpoint_digest(directory)  # through the fixture's writable cache
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(blocker / "cache"))
    # Nothing can be read from or written to a cache under a file: each call hashes the files again.
    assert checkpoint_digest(directory) == expected
    (directory / "model.safetensors").write_bytes(b"x")
    assert checkpoint_digest(directory) not in (expected, "")
    assert blocker.read_text() == ""


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
