"""Loading specs: valid specs resolve; invalid ones fail with file:line:col and a hint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.checkpoints.dspark_block_config import BlockDraftConfig
from dspark.spec import SpecError, load_spec
from dspark.spec import checkpoints as checkpoint_module

from .bounded_work import count_calls

REPO = Path(__file__).resolve().parents[1]

VALID = """\
name: demo
model:
  family: llama
  checkpoint: /nonexistent/target
  geometry:
    vocab_size: 256
    hidden_size: 64
    intermediate_size: 128
    num_layers: 2
    num_heads: 4
    num_kv_heads: 2
    max_position_embeddings: 2048
    rope_theta: 10000.0
    rms_norm_eps: 1e-6
draft:
  checkpoint: /nonexistent/draft
  gamma: 3
backend:
  kind: cpu
  device: generic
"""


def errors_of(path: Path) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return info.value


def test_valid_spec_resolves_defaults_and_derived_values(write_spec):
    resolved = load_spec(write_spec(text=VALID))
    assert resolved.name == "demo"
    assert resolved.num_draft_tokens == 4 and resolved.max_verify_len == 4
    assert resolved.tiers == ()
    assert resolved.geometry.head_dim == 16  # hidden / heads
    assert resolved.spec.serving.page_size == 16
    assert resolved.line_of("draft.gamma") == 17
    assert resolved.line_of("verify.mode") is None  # a default has no line


def test_exponent_floats_parse_as_floats(write_spec):
    resolved = load_spec(write_spec(text=VALID))
    assert resolved.geometry.rms_norm_eps == pytest.approx(1e-6)
    text = VALID + "verify:\n  survival_eps: 1e-3\n"
    assert load_spec(write_spec(text=text)).spec.verify.survival_eps == pytest.approx(1e-3)


@pytest.fixture(autouse=True)
def _digest_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "digest-cache"))


@pytest.mark.parametrize("spec", sorted((REPO / "specs").glob("*.yaml")), ids=lambda p: p.stem)
def test_repository_specs_load(spec):
    resolved = load_spec(spec)  # no committed table or calibration is stale
    assert resolved.display_path == f"specs/{spec.name}"
    assert resolved.name == spec.stem and resolved.stale_tables == ()


def test_unknown_key_points_at_the_key_and_suggests_the_closest(write_spec):
    error = errors_of(write_spec(text=VALID.replace("  gamma: 3", "  gama: 3")))
    (issue,) = [i for i in error.issues if i.path == ("draft", "gama")]
    assert (issue.location.line, issue.location.column) == (17, 3)
    assert "unknown key 'gama'" in issue.message
    assert "did you mean `gamma`" in issue.hint and "confidence_head" in issue.hint
    assert f"{issue.location.file}:17:3: draft.gama: unknown key" in str(error)


def test_missing_field_points_at_the_parent_mapping(write_spec):
    error = errors_of(write_spec(text=VALID.replace("  checkpoint: /nonexistent/draft\n", "")))
    (issue,) = error.issues
    assert issue.path == ("draft", "checkpoint")
    assert (issue.location.line, issue.location.column) == (15, 1)  # the `draft:` line
    assert "required field is missing" in issue.message and "add `checkpoint:`" in issue.hint


def test_wrong_type_points_at_the_value_and_is_strict(write_spec):
    error = errors_of(write_spec(text=VALID.replace("gamma: 3", 'gamma: "3"')))
    (issue,) = error.issues
    assert (issue.location.line, issue.location.column) == (17, 10)
    assert "valid integer" in issue.message and "remove the quotes" in issue.hint


def test_literal_error_suggests_a_value(write_spec):
    error = errors_of(write_spec(text=VALID.replace("kind: cpu", "kind: cuad")))
    (issue,) = error.issues
    assert issue.path == ("backend", "kind") and issue.location.line == 19
    assert "did you mean 'cuda'" in issue.hint


def test_device_must_belong_to_the_backend(write_spec):
    error = errors_of(write_spec(text=VALID.replace("device: generic", "device: h200")))
    (issue,) = error.issues
    assert issue.path == ("backend", "device") and issue.location.line == 20
    assert "not a cpu device" in issue.message and "generic" in issue.hint


def test_duplicate_key_is_an_error(write_spec):
    error = errors_of(write_spec(text=VALID + "name: again\n"))
    (issue,) = error.issues
    assert issue.location.line == 21 and "duplicate key 'name'" in issue.message
    assert "first defined at line 1" in issue.message


def test_yaml_syntax_error_has_a_position(write_spec):
    error = errors_of(write_spec(text=VALID.replace("gamma: 3", "gamma: [3")))
    (issue,) = error.issues
    # The unclosed bracket is blamed where it opens, not where the parser gave up.
    assert "YAML syntax error" in issue.message
    assert (issue.location.line, issue.location.column) == (17, 10)
    assert str(error).startswith(f"{issue.location.file}:17:10:")


def test_an_unclosed_quote_is_blamed_at_the_opening_quote(write_spec):
    text = VALID.replace("checkpoint: /nonexistent/draft", 'checkpoint: "/nonexistent/draft')
    (issue,) = errors_of(write_spec(text=text)).issues
    assert (issue.location.line, issue.location.column) == (16, 15)
    assert "quoted scalar" in issue.message and "line 21" in issue.message  # where the file ended


def test_non_utf8_bytes_are_located(write_spec, tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(VALID.replace("kind: cpu", "kind: c\xe9u").encode("latin-1"))
    (issue,) = errors_of(path).issues
    assert (issue.location.line, issue.location.column) == (19, 10)
    assert "0xe9" in issue.message and "UTF-8" in issue.hint


def test_yaml_and_validation_problems_are_reported_together(write_spec):
    text = VALID.replace("gamma: 3", "gamma: .nan").replace("kind: cpu", "kind: gpu") + "name: twice\n"
    error = errors_of(write_spec(text=text))
    assert [(i.location.line, i.path) for i in error.issues] == [
        (17, ("draft", "gamma")), (19, ("backend", "kind")), (21, ("name",))]
    assert "not a number" in error.issues[0].message


def test_anchors_and_merge_keys_share_settings(write_spec):
    text = VALID + ("verify: &v\n  mode: static\n  lag_steps: 0\n"
                    "graph: {enabled: false}\n"
                    "serving:\n  <<: {page_size: 16, max_context_len: 512}\n  max_context_len: 1024\n")
    resolved = load_spec(write_spec(text=text))
    # The mapping's own key wins over the merged one, without a duplicate-key error.
    assert resolved.spec.serving.max_context_len == 1024 and resolved.spec.serving.page_size == 16
    assert resolved.line_of("serving.page_size") == 26  # where the merged mapping writes it


def test_alias_expansion_is_bounded(write_spec):
    laughs = "".join(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]\n" for i in range(1, 9))
    path = write_spec(text=VALID + "l0: &l0 [a, b, c, d, e, f, g, h, i]\n" + laughs)
    error, calls = count_calls(lambda: errors_of(path))
    (issue,) = error.issues
    assert calls < 1_000_000, calls  # about 330 000 for the 20 000 values built; 9^9 values would be billions
    assert "expands to more than" in issue.message and issue.location.line == 22  # the first alias


@pytest.mark.parametrize("tagged, path", [
    ("name: !!python/object/apply:os.system [ls]", ("name",)),
    ("name: !!str demo", ("name",)),
    ("name: !custom {a: 1}", ("name",)),
])
def test_tags_are_refused_where_written(write_spec, tagged, path):
    (issue,) = errors_of(write_spec(text=VALID.replace("name: demo", tagged))).issues
    assert issue.path == path and (issue.location.line, issue.location.column) == (1, 7)
    assert "is not allowed" in issue.message and "remove the tag" in issue.hint


def test_every_problem_is_reported_at_once_in_source_order(write_spec):
    text = VALID.replace("gamma: 3", "gamma: 0").replace("kind: cpu", "kind: gpu")
    error = errors_of(write_spec(text=text))
    assert [i.location.line for i in error.issues] == [17, 19]


@pytest.mark.parametrize("name", ["Demo", "1abc", "with-dash", "class", "x" * 65, "ok\n"])
def test_name_must_be_a_safe_package_name(write_spec, name):
    error = errors_of(write_spec({"name": name}))
    assert error.issues[0].path == ("name",)


def test_spec_must_be_a_mapping(write_spec):
    assert "YAML mapping" in str(errors_of(write_spec(text="- 1\n- 2\n")))
    assert "empty" in str(errors_of(write_spec(text="")))


def test_max_context_len_must_be_whole_pages(write_spec):
    error = errors_of(write_spec({"serving": {"page_size": 16, "max_context_len": 1000}}))
    assert error.issues[0].path == ("serving", "max_context_len")
    assert "use 1008 or 992" in error.issues[0].hint


def test_graph_lists_must_increase(write_spec):
    error = errors_of(write_spec({"graph": {"enabled": True, "token_tiers": [8, 8]}}))
    assert error.issues[0].path == ("graph", "token_tiers")
    assert "strictly increasing" in error.issues[0].message


def test_inline_cost_models_validate(write_spec, tmp_path):
    sps = {"type": "sps-1d", "sample_batch_tokens": [4, 8], "sample_steps_per_sec": [100, 90.5],
           "max_batch_tokens": 8}
    assert load_spec(write_spec({"cost_model": sps})).cost_model.sample_steps_per_sec == (100.0,
                                                                                         90.5)
    error = errors_of(write_spec({"cost_model": {**sps, "sample_steps_per_sec": [1.0]}}))
    assert error.issues[0].path == ("cost_model", "sample_steps_per_sec")
    assert "has 1 entries" in error.issues[0].message
    additive = {"type": "additive", "bias_seconds": 0.001, "bs_probes": [1, 8],
                "alpha_seconds": [0.0, 1e-4], "m_probes": [8, 64], "theta_seconds": [0.0, -1.0]}
    error = errors_of(write_spec({"cost_model": additive}))
    assert error.issues[0].path == ("cost_model", "theta_seconds")
    error = errors_of(write_spec({"cost_model": {"type": "linear"}}))
    assert "sps-1d" in error.issues[0].hint


def test_cost_models_take_an_optional_draft_term(write_spec):
    sps = {"type": "sps-1d", "sample_batch_tokens": [4, 8], "sample_steps_per_sec": [100, 90.5],
           "max_batch_tokens": 8, "draft_bs_probes": [1, 4], "draft_seconds": [0.001, 0.002]}
    assert load_spec(write_spec({"cost_model": sps})).cost_model.draft_seconds == (0.001, 0.002)
    error = errors_of(write_spec({"cost_model": {**sps, "draft_seconds": [0.001]}}))
    assert error.issues[0].path == ("cost_model", "draft_seconds")
    error = errors_of(write_spec({"cost_model": {**sps, "draft_bs_probes": [4, 1]}}))
    assert error.issues[0].path == ("cost_model", "draft_bs_probes")


def test_cost_model_file_is_loaded_and_validated(write_spec, tmp_path):
    table = {"sample_batch_tokens": [4, 8], "sample_steps_per_sec": [100.0, 90.0],
             "max_batch_tokens": 8}
    (tmp_path / "costs.json").write_text(json.dumps(table))
    resolved = load_spec(write_spec({"cost_model": {"type": "sps-1d", "file": "costs.json"}}))
    assert resolved.cost_model.sample_batch_tokens == (4, 8)
    (tmp_path / "bad.json").write_text(json.dumps({**table, "extra": 1}))
    error = errors_of(write_spec({"cost_model": {"type": "sps-1d", "file": "bad.json"}}))
    (issue,) = error.issues
    assert issue.path == ("cost_model", "file") and "bad.json" in issue.message
    assert "extra" in issue.message
    error = errors_of(write_spec({"cost_model": {"type": "additive", "file": "missing.json"}}))
    assert "missing.json" in error.issues[0].message and "does not exist" in error.issues[0].message


def test_calibration_file_is_loaded(write_spec, tmp_path):
    (tmp_path / "sts.json").write_text(json.dumps({"temperatures": [1.0, 1.5, 2]}))
    resolved = load_spec(write_spec({"calibration": {"file": "sts.json"}}))
    assert resolved.temperatures == (1.0, 1.5, 2.0)
    (tmp_path / "broken.json").write_text("{")
    error = errors_of(write_spec({"calibration": {"file": "broken.json"}}))
    assert "not valid JSON" in error.issues[0].message


def _checkpoint(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


HF_CONFIG = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}


def test_geometry_is_read_from_a_relative_checkpoint(write_spec, tmp_path):
    _checkpoint(tmp_path / "ckpt", HF_CONFIG)
    resolved = load_spec(write_spec({"model": {"checkpoint": "ckpt", "geometry": None}}))
    assert resolved.geometry.num_layers == 2 and resolved.geometry.head_dim == 16
    assert resolved.model_checkpoint.directory == tmp_path / "ckpt"


def test_inline_geometry_must_match_the_checkpoint(write_spec, tmp_path):
    _checkpoint(tmp_path / "ckpt", {**HF_CONFIG, "num_hidden_layers": 3, "vocab_size": 512})
    error = errors_of(write_spec({"model": {"checkpoint": "ckpt"}}))
    paths = {issue.path for issue in error.issues}
    assert paths == {("model", "geometry", "num_layers"), ("model", "geometry", "vocab_size")}
    assert all("config.json" in issue.message for issue in error.issues)


def test_geometry_is_required_without_a_checkpoint(write_spec):
    error = errors_of(write_spec({"model": {"geometry": None}}))
    (issue,) = error.issues
    assert issue.path == ("model", "geometry") and "required" in issue.message
    assert issue.location.line == 2  # the `model:` line


def test_checkpoint_config_missing_keys(write_spec, tmp_path):
    config = {k: v for k, v in HF_CONFIG.items() if k not in ("hidden_size", "rope_theta")}
    _checkpoint(tmp_path / "ckpt", config)
    error = errors_of(write_spec({"model": {"checkpoint": "ckpt", "geometry": None}}))
    (issue,) = error.issues
    assert issue.path == ("model", "checkpoint") and "lacks hidden_size" in issue.message
    _checkpoint(tmp_path / "defaults", {k: v for k, v in HF_CONFIG.items()
                                        if k not in ("rope_theta", "rms_norm_eps")})
    spec = write_spec({"model": {"checkpoint": "defaults", "geometry": None}})
    geometry = load_spec(spec).geometry
    # transformers' LlamaConfig defaults
    assert (geometry.rope_theta, geometry.rms_norm_eps) == (10000.0, 1e-6)


def test_embedded_checkpoints_resolve_from_the_package(write_spec, tmp_path, monkeypatch):
    root = tmp_path / "embedded"
    _checkpoint(root / "mini" / "target", HF_CONFIG)
    draft = BlockDraftConfig(
        vocab_size=HF_CONFIG["vocab_size"], hidden_size=HF_CONFIG["hidden_size"], intermediate_size=128,
        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=HF_CONFIG["hidden_size"] // 4, rms_norm_eps=1e-6,
        rope_theta=10000.0, attention_bias=False, block_size=3, mask_token_id=0, target_layer_ids=(0,),
        num_target_layers=HF_CONFIG["num_hidden_layers"], markov_rank=0, markov_head_type=None,
        confidence_head=True, confidence_with_markov=False)
    _checkpoint(root / "mini" / "draft", draft.to_hf())
    monkeypatch.setattr(checkpoint_module, "embedded_root", lambda: root)
    resolved = load_spec(write_spec({"model": {"checkpoint": "embedded:mini", "geometry": None},
                                     "draft": {"checkpoint": "embedded:mini"}}))
    assert resolved.model_checkpoint.embedded == "mini"
    assert resolved.draft_checkpoint.directory == root / "mini" / "draft"
    error = errors_of(write_spec({"model": {"checkpoint": "embedded:huge", "geometry": None}}))
    assert "embedded:mini" in error.issues[0].hint


def test_schema_lists_every_section(capsys):
    from dspark.cli.compile import main

    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert set(schema["properties"]) == {"name", "model", "draft", "parallelism", "backend",
                                         "verify", "graph", "cost_model", "calibration", "online_calibration",
                                         "online_cost", "serving"}
    assert schema["additionalProperties"] is False


TIER_TABLE = {"tiers": [8, 16, 32], "bs_probes": [1, 4],
              "step_seconds": [[0.001, 0.002, 0.003], [0.002, 0.003, 0.005]]}


def test_tier_cost_model_inline_and_from_a_file(write_spec, tmp_path):
    resolved = load_spec(write_spec({"cost_model": {"type": "tier", **TIER_TABLE}}))
    assert resolved.cost_model.type == "tier"
    assert resolved.cost_model.step_seconds == ((0.001, 0.002, 0.003), (0.002, 0.003, 0.005))
    (tmp_path / "tier.json").write_text(json.dumps({**TIER_TABLE, "draft_bs_probes": [1],
                                                    "draft_seconds": [0.0005]}))
    from_file = load_spec(write_spec({"cost_model": {"type": "tier", "file": "tier.json"}})).cost_model
    assert from_file.tiers == (8, 16, 32) and from_file.draft_seconds == (0.0005,)
    # The runtime reads the resolved table the way the compiler embeds it.
    from dspark.runtime.planner.cost_models import TierCostTable, cost_model_from_dict

    table = cost_model_from_dict(from_file.model_dump(mode="json", exclude_defaults=True), "spec")
    assert isinstance(table, TierCostTable) and table.step_time(4, 9) == 0.003


def test_bad_tier_cost_models_name_the_field(write_spec, tmp_path):
    ragged = {**TIER_TABLE, "step_seconds": [[0.001, 0.002, 0.003], [0.002, 0.003]]}
    (issue,) = errors_of(write_spec({"cost_model": {"type": "tier", **ragged}})).issues
    assert issue.path == ("cost_model", "step_seconds")
    assert "row 1 has 2 entries but tiers has 3" in issue.message and "one step time per tier" in issue.hint
    (issue,) = errors_of(write_spec({"cost_model": {"type": "tier", **TIER_TABLE,
                                                    "tiers": [8, 32, 16]}})).issues
    assert issue.path == ("cost_model", "tiers") and "strictly increasing" in issue.message
    zero = {**TIER_TABLE, "step_seconds": [[0.001, 0.0, 0.003], [0.002, 0.003, 0.005]]}
    (issue,) = errors_of(write_spec({"cost_model": {"type": "tier", **zero}})).issues
    assert issue.path == ("cost_model", "step_seconds") and "row 0" in issue.message
    (tmp_path / "short.json").write_text(json.dumps({**TIER_TABLE, "bs_probes": [1]}))
    (issue,) = errors_of(write_spec({"cost_model": {"type": "tier", "file": "short.json"}})).issues
    assert issue.path == ("cost_model", "file") and "short.json" in issue.message
    assert "step_seconds" in issue.message and "has 2 entries but bs_probes has 1" in issue.message
    (tmp_path / "other.json").write_text(json.dumps({**TIER_TABLE, "type": "additive"}))
    (issue,) = errors_of(write_spec({"cost_model": {"type": "tier", "file": "other.json"}})).issues
    assert "holds a 'additive' table" in issue.message and "cost_model.type: additive" in issue.hint
    (issue,) = errors_of(write_spec({"cost_model": {"type": "tiered"}})).issues
    assert "'tier'" in issue.message and "type: tier" in issue.hint


def _calibrate_output(temperatures: list[float], **extra) -> dict:
    """A calibration file as `dspark calibrate` writes it: fit statistics beside the temperatures."""
    n = len(temperatures)
    return {"temperatures": temperatures, "dataset": "held-out prompts", "num_samples": 256,
            "ece_before": [0.1] * n, "ece_after": [0.03] * n, "brier_before": [0.2] * n,
            "brier_after": [0.1] * n, "auc_before": [None] + [0.7] * (n - 1),
            "auc_after": [None] + [0.7] * (n - 1), "num_bins": 15, "grid": [0.5, 1.0, 2.0], **extra}


def test_a_calibrate_output_file_is_accepted(write_spec, tmp_path):
    (tmp_path / "sts.json").write_text(json.dumps(_calibrate_output([1.0, 1.5, 2], policy="greedy")))
    resolved = load_spec(write_spec({"calibration": {"file": "sts.json"}}))
    assert resolved.temperatures == (1.0, 1.5, 2.0)
    assert resolved.calibration_policy == "greedy" and resolved.calibration_fingerprint is None


@pytest.mark.parametrize("change, fragment", [
    ({"grdi": [1.0]}, "grdi"),  # unknown keys are still rejected, by name
    ({"ece_after": [0.1]}, "ece_after has 1 entries but there are 3 temperatures"),
    ({"num_samples": "many"}, "num_samples"),
    ({"temperatures": [1.0, 0.0, 1.0]}, "must all be > 0"),
])
def test_a_damaged_calibration_file_is_rejected(write_spec, tmp_path, change, fragment):
    (tmp_path / "sts.json").write_text(json.dumps({**_calibrate_output([1.0, 1.5, 2]), **change}))
    (issue,) = errors_of(write_spec({"calibration": {"file": "sts.json"}})).issues
    assert issue.path == ("calibration", "file") and "sts.json" in issue.message
    assert fragment in issue.message


def test_calibration_policy_must_match_the_serving_policy(write_spec):
    sampled = "sample:temperature=0.7,top_p=1.0,top_k=0"
    calibration = {"temperatures": [1.0, 1.0, 1.0], "policy": sampled}
    (issue,) = errors_of(write_spec({"calibration": calibration})).issues
    assert issue.path == ("calibration", "policy")
    assert f"fitted for {sampled!r}" in issue.message and "'greedy'" in issue.message
    resolved = load_spec(write_spec({"calibration": calibration,
                                     "serving": {"generation": {"temperature": 0.7}}}))
    assert resolved.calibration_policy == sampled


def test_calibration_policy_must_match_the_file(write_spec, tmp_path):
    (tmp_path / "sts.json").write_text(json.dumps(
        _calibrate_output([1.0, 1.0, 1.0], policy="sample:temperature=0.7,top_p=1.0,top_k=0")))
    (issue,) = errors_of(write_spec({"calibration": {"file": "sts.json", "policy": "greedy"}})).issues
    assert issue.path == ("calibration", "policy")
    assert "'greedy'" in issue.message and "'sample:temperature=0.7,top_p=1.0,top_k=0'" in issue.message
    # Without calibration.policy the file's own policy still has to fit the deployment.
    (issue,) = errors_of(write_spec({"calibration": {"file": "sts.json"}})).issues
    assert issue.path == ("calibration", "file") and "policy: fitted for" in issue.message
    assert "--allow-stale-tables" in issue.hint


@pytest.mark.parametrize("content, fragment", [
    ('{"temperatures": [1.0, NaN, 1.0]}', "holds NaN, which is not a finite number"),
    ('{"temperatures": [1.0, -Infinity, 1.0]}', "holds -Infinity"),
    ('{"temperatures": [1.0, 1e999, 1.0]}', "1e999, too large for a floating-point number"),
    ('{"temperatures": [1.0], "temperatures": [2.0]}', "has the key 'temperatures' twice"),
    ("[1.0, 1.0, 1.0]", "must hold a JSON object, not a list"),
])
def test_json_files_are_read_strictly(write_spec, tmp_path, content, fragment):
    (tmp_path / "sts.json").write_text(content)
    (issue,) = errors_of(write_spec({"calibration": {"file": "sts.json"}})).issues
    assert issue.path == ("calibration", "file") and "sts.json" in issue.message
    assert fragment in issue.message


def test_paths_to_the_wrong_kind_of_thing(write_spec, tmp_path):
    (tmp_path / "tables").mkdir()
    (issue,) = errors_of(write_spec({"calibration": {"file": "tables"}})).issues
    assert "is a directory" in issue.message
    (tmp_path / "weights.bin").write_bytes(b"\0")
    (issue,) = errors_of(write_spec({"model": {"checkpoint": "weights.bin"}})).issues
    assert issue.path == ("model", "checkpoint") and "is not a directory" in issue.message
    error = errors_of(tmp_path)
    assert "is a directory" in error.issues[0].message
