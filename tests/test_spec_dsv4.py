"""The dsv4 (DeepSeek-V4) family in the spec: its geometry section, read inline or from a checkpoint's
config.json, and the rules for what dspark's dsv4 model runs on. Every refusal is located at the line of
the field it blames."""

from __future__ import annotations

import copy
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from dspark.cli.compile import main
from dspark.formats.dsv4_config import DSV4_GEOMETRY_KEYS, DSV4_RUNTIME_FIELDS, Dsv4Geometry
from dspark.spec import SpecError, load_spec
from dspark.spec.loader import display_path
from dspark.spec.models import Dsv4GeometrySpec

from .conftest import GEOMETRY, merged

DSV4_GEOMETRY: dict[str, Any] = {
    "vocab_size": 512, "dim": 64, "compress_ratios": [0, 4, 16, 4], "csa_ratio": 4, "hca_ratio": 16,
    "n_heads": 4, "head_dim": 32, "rope_dim": 8, "q_lora_rank": 32, "window": 16, "index_n_heads": 2,
    "index_head_dim": 16, "index_topk": 4, "inter_dim": 128, "norm_eps": 1e-6, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "ffn": "dense", "hc_mult": 0, "o_groups": 0,
}
DSV4_SPEC: dict[str, Any] = {
    "name": "demo",
    "model": {"family": "dsv4", "checkpoint": "/nonexistent/target", "load_format": "dummy",
              "geometry": DSV4_GEOMETRY},
    "draft": {"checkpoint": "/nonexistent/draft", "load_format": "dummy", "gamma": 3},
    "backend": {"kind": "cpu", "device": "generic"},
}
EXPECTED = Dsv4Geometry(vocab_size=512, dim=64, compress_ratios=(0, 4, 16, 4), csa_ratio=4, hca_ratio=16,
                        n_heads=4, head_dim=32, rope_dim=8, q_lora_rank=32, window=16, index_n_heads=2,
                        index_head_dim=16, index_topk=4, inter_dim=128, norm_eps=1e-6, rope_theta=10000.0,
                        compress_rope_theta=160000.0)

# The DeepSeek-V4-Flash config.json layout at tiny sizes with the parts dspark's dsv4 leaves out switched
# off (no routed experts, no hyper-connections, one output projection, no quantisation, no YaRN), as
# tests/test_dsv4_config.py reads it; compress_ratios has an entry for the MTP layer.
DSV4_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 512,
    "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 32, "qk_rope_head_dim": 8, "q_lora_rank": 32, "sliding_window": 16, "index_n_heads": 2,
    "index_head_dim": 16, "index_topk": 4, "compress_ratios": [0, 4, 16, 4, 0], "num_nextn_predict_layers": 1,
    "n_routed_experts": 0, "n_shared_experts": 1, "moe_intermediate_size": 128, "hc_mult": None,
    "o_groups": None, "o_lora_rank": None, "swiglu_limit": None, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "compress_rope_theta": 160000, "hidden_act": "silu", "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
}


# The Ascend operators take DeepSeek-V4's own ratios: the tiny geometry's C128-kind layer at 128.
ASCEND_RATIOS = {"model": {"geometry": {"hca_ratio": 128, "compress_ratios": [0, 4, 128, 4]}}}


def dsv4_spec_writer(write_spec):
    """Writes a valid tiny dsv4 spec with `overrides` (a None value deletes the key); `geometry` replaces
    the whole model.geometry mapping."""
    def write(overrides: dict[str, Any] | None = None, *, geometry: dict[str, Any] | None = None,
              name: str = "spec.yaml") -> Path:
        data = merged(DSV4_SPEC, overrides or {})
        if geometry is not None:
            data["model"]["geometry"] = copy.deepcopy(geometry)
        return write_spec(text=yaml.safe_dump(data, sort_keys=False, default_flow_style=None), name=name)
    return write


@pytest.fixture
def dsv4_spec(write_spec):
    return dsv4_spec_writer(write_spec)


def line_of(path: Path, text: str) -> int:
    """The 1-based line of the spec on which `text` is first written."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def only_issue(path: Path):
    with pytest.raises(SpecError) as info:
        load_spec(path)
    (issue,) = info.value.issues
    return issue


def checkpoint(directory: Path, config: dict[str, Any]) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_the_geometry_section_has_exactly_dsv4_geometrys_fields():
    # but the backend's own (index_quant: the runtime sets it, Dsv4Geometry.for_backend)
    compiled = [f.name for f in fields(Dsv4Geometry) if f.name not in DSV4_RUNTIME_FIELDS]
    assert list(Dsv4GeometrySpec.model_fields) == compiled
    for name, field in Dsv4GeometrySpec.model_fields.items():
        # each says the config.json key it is read from (the last part of a nested key)
        assert DSV4_GEOMETRY_KEYS[name].rsplit(".", 1)[-1] in field.description, name


def test_an_inline_dsv4_geometry_resolves(dsv4_spec):
    resolved = load_spec(dsv4_spec())
    assert resolved.geometry == EXPECTED
    assert resolved.spec.model.family == "dsv4" and resolved.spec.attention_impl == "torch"
    assert resolved.spec.draft.mask_token_id == 511  # the draft's defaults follow the target's sizes


def test_ascend_defaults_to_the_sparse_shared_kv_attention(dsv4_spec, write_spec):
    ascend = {"backend": {"kind": "ascend", "device": "910c"}}
    assert load_spec(dsv4_spec({**ascend, **ASCEND_RATIOS})).spec.attention_impl == "sparse_attn_sharedkv"
    # the dense families keep the fused attention as the default
    assert load_spec(write_spec(ascend)).spec.attention_impl == "fused_infer_attention"


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("rope_dim", 7, "rope_dim is 7, an odd number"),
    ("rope_dim", 64, "more than head_dim 32"),
    ("hca_ratio", 4, "the CSA ratio too"),
    ("compress_ratios", [0, 4, 8, 4], "not a non-empty list of ratios in (0, 4, 16)"),
])
def test_geometry_refusals_point_at_their_field(dsv4_spec, field, value, fragment):
    spec = dsv4_spec(geometry={**DSV4_GEOMETRY, field: value})
    issue = only_issue(spec)
    assert issue.path == ("model", "geometry", field) and fragment in issue.message
    assert issue.location.line == line_of(spec, f"{field}:") and issue.hint
    assert "Dsv4Geometry" not in issue.message  # the path names the field


def test_a_refusal_of_a_field_sharing_a_config_key_points_at_that_field(dsv4_spec):
    # ffn and n_routed_experts are both read from config.json's n_routed_experts
    spec = dsv4_spec(geometry={**DSV4_GEOMETRY, "n_routed_experts": 8})
    issue = only_issue(spec)
    assert issue.path == ("model", "geometry", "ffn")
    assert issue.message == "ffn is dense with routed experts or hash layers", issue.message
    assert issue.location.line == line_of(spec, "ffn:")


def test_a_typo_in_the_geometry_suggests_the_field(dsv4_spec):
    geometry = {("windw" if key == "window" else key): value for key, value in DSV4_GEOMETRY.items()}
    with pytest.raises(SpecError) as info:
        load_spec(dsv4_spec(geometry=geometry))
    paths = {issue.path: issue for issue in info.value.issues}
    assert "did you mean `window`?" in paths[("model", "geometry", "windw")].hint
    assert ("model", "geometry", "window") in paths  # and it is missing


def test_a_dense_geometry_for_dsv4_is_one_error(dsv4_spec):
    spec = dsv4_spec(geometry=GEOMETRY)
    issue = only_issue(spec)
    assert issue.path == ("model", "geometry")
    assert "a dense model's geometry (hidden_size, intermediate_size" in issue.message
    assert "model.family dsv4" in issue.message
    assert "compress_ratios" in issue.hint and "llama, qwen3" in issue.hint
    assert issue.location.line == line_of(spec, "vocab_size:")


def test_a_dsv4_geometry_for_a_dense_family_is_one_error(write_spec):
    spec = write_spec(text=yaml.safe_dump(merged(DSV4_SPEC, {"model": {"family": "llama"}}), sort_keys=False))
    issue = only_issue(spec)
    assert issue.path == ("model", "geometry")
    assert "a DeepSeek-V4 geometry (dim, compress_ratios" in issue.message
    assert "set model.family: dsv4" in issue.hint


def test_an_unknown_family_lists_dsv4(write_spec):
    issue = only_issue(write_spec({"model": {"family": "mistral"}}))
    assert issue.path == ("model", "family") and issue.hint == "use one of: llama, qwen3, dsv4"


def test_the_geometry_is_required_without_a_checkpoint(dsv4_spec):
    issue = only_issue(dsv4_spec({"model": {"geometry": None}}))
    assert issue.path == ("model", "geometry") and "required" in issue.message
    assert "(vocab_size, dim, compress_ratios, csa_ratio" in issue.hint


def test_the_geometry_is_read_from_a_dsv4_config(dsv4_spec, tmp_path):
    checkpoint(tmp_path / "ckpt", DSV4_CONFIG)
    resolved = load_spec(dsv4_spec({"model": {"checkpoint": "ckpt", "geometry": None}}))
    assert resolved.geometry == EXPECTED
    assert load_spec(dsv4_spec({"model": {"checkpoint": "ckpt"}})).geometry == EXPECTED  # inline agrees


def test_an_inline_geometry_must_match_the_config(dsv4_spec, tmp_path):
    checkpoint(tmp_path / "ckpt", {**DSV4_CONFIG, "sliding_window": 32})
    spec = dsv4_spec({"model": {"checkpoint": "ckpt"}})
    issue = only_issue(spec)
    assert issue.path == ("model", "geometry", "window")
    assert "window is 16 here but 32 in" in issue.message and "config.json" in issue.message
    assert issue.location.line == line_of(spec, "window:")


@pytest.mark.parametrize(("change", "key"), [
    ({"n_routed_experts": 8, "n_shared_experts": 2}, "n_shared_experts"),
    ({"hc_mult": 0}, "hc_mult"),  # only null is the plain residual
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config.quant_method"),
    ({"rope_scaling": {"type": "linear", "factor": 16}}, "rope_scaling.type"),
])
def test_a_released_style_config_is_refused_naming_the_key(dsv4_spec, tmp_path, change, key):
    config = {k: v for k, v in {**DSV4_CONFIG, **change}.items() if v is not None or k not in change}
    checkpoint(tmp_path / "ckpt", config)
    spec = dsv4_spec({"model": {"checkpoint": "ckpt", "geometry": None}})
    issue = only_issue(spec)
    assert issue.path == ("model", "checkpoint")
    assert issue.message.startswith(f"model config {str(tmp_path / 'ckpt' / 'config.json')!r}: {key} ")
    assert issue.hint and issue.location.line == line_of(spec, "checkpoint: ckpt")


def test_a_dsv4_config_for_a_dense_family_says_which_family(write_spec, tmp_path):
    checkpoint(tmp_path / "ckpt", DSV4_CONFIG)
    issue = only_issue(write_spec({"model": {"checkpoint": "ckpt", "geometry": None}}))
    assert issue.path == ("model", "checkpoint") and "DeepSeek-V4 config" in issue.message
    assert issue.hint == "set model.family: dsv4"


def test_cuda_runs_the_triton_attention_and_refuses_flashinfer(dsv4_spec):
    cuda = {"backend": {"kind": "cuda", "device": "h200"}}
    assert load_spec(dsv4_spec(cuda)).spec.attention_impl == "triton"
    spec = dsv4_spec({"backend": {"kind": "cuda", "device": "h200", "attention": "flashinfer"}})
    issue = only_issue(spec)
    assert issue.path == ("backend", "attention") and "not model.family dsv4" in issue.message
    assert issue.hint == "leave backend.attention out for dsv4's triton on cuda"


def test_tp_must_divide_the_output_projection_groups(dsv4_spec):
    # 4 heads in 2 groups: tp 2 keeps one group a rank, tp 4 would split a group
    grouped = {"model": {"geometry": {"o_groups": 2, "o_lora_rank": 8}}}
    assert load_spec(dsv4_spec(merged(grouped, {"parallelism": {"tp": 2}}))).spec.parallelism.tp == 2
    spec = dsv4_spec(merged(grouped, {"parallelism": {"tp": 4}}))
    issue = only_issue(spec)
    assert issue.path == ("parallelism", "tp") and issue.message == "tp 4 does not divide o_groups (2)"
    assert "use tp in [1, 2]" in issue.hint and issue.location.line == line_of(spec, "tp: 4")


def test_dsv4_refuses_the_dense_ascend_attention(dsv4_spec):
    spec = dsv4_spec({"backend": {"kind": "ascend", "device": "910c", "attention": "fused_infer_attention"},
                      **ASCEND_RATIOS})
    issue = only_issue(spec)
    assert issue.path == ("backend", "attention")
    assert issue.message == ("fused_infer_attention runs the dense families' paged attention, "
                             "not model.family dsv4")
    assert issue.hint == "leave backend.attention out for dsv4's sparse_attn_sharedkv on ascend"
    assert issue.location.line == line_of(spec, "attention: fused_infer_attention")


def test_dense_families_refuse_the_dsv4_attention(write_spec):
    issue = only_issue(write_spec({"backend": {"kind": "ascend", "device": "910b",
                                               "attention": "sparse_attn_sharedkv"}}))
    assert issue.path == ("backend", "attention")
    assert "DeepSeek-V4's compressed sparse attention (model.family dsv4), not model.family llama" in \
        issue.message
    assert issue.hint == "leave backend.attention out for llama's fused_infer_attention on ascend"


def test_tp_must_divide_the_query_heads_only(dsv4_spec):
    # one latent K=V head, replicated: tp 2 and 4 split the 4 query heads
    assert load_spec(dsv4_spec({"parallelism": {"tp": 4}})).spec.parallelism.tp == 4
    spec = dsv4_spec({"parallelism": {"tp": 3}})
    issue = only_issue(spec)
    assert issue.path == ("parallelism", "tp") and issue.message == "tp 3 does not divide n_heads (4)"
    assert "use tp in [1, 2, 4]" in issue.hint and issue.location.line == line_of(spec, "tp: 3")


def test_under_dp_attention_tp_over_dp_must_divide_the_query_heads(dsv4_spec):
    # tp 8 over dp 2: each DP rank splits its 4 query heads over 4 attention ranks
    parallelism = {"tp": 8, "dp": 2, "dp_attention": True}
    assert load_spec(dsv4_spec({"parallelism": parallelism})).spec.parallelism.tp == 8
    issue = only_issue(dsv4_spec({"parallelism": {**parallelism, "tp": 16}}))
    assert issue.path == ("parallelism", "tp")
    assert issue.message == "the attention TP size tp / dp = 8 does not divide n_heads (4)"
    assert "use tp / dp in [1, 2, 4]" in issue.hint


MOE = {"model": {"geometry": {"ffn": "moe", "n_routed_experts": 8, "n_activated_experts": 2}}}


def test_expert_parallelism_shards_the_routed_experts_over_every_rank(dsv4_spec):
    spec = load_spec(dsv4_spec(merged(MOE, {"parallelism": {"tp": 2, "ep": 2}}))).spec
    assert spec.parallelism.ep == 2
    under_dp = {"parallelism": {"tp": 4, "dp": 2, "dp_attention": True, "ep": 4}}
    assert load_spec(dsv4_spec(merged(MOE, under_dp))).spec.parallelism.ep == 4


@pytest.mark.parametrize(("change", "message", "hint"), [
    ({"parallelism": {"ep": 2}}, "ep is 2, but this DeepSeek-V4 geometry has a dense FFN (ffn: dense): no "
     "experts to shard across ranks", "set parallelism.ep: 1"),
    (merged(MOE, {"parallelism": {"tp": 4, "ep": 2}}), "ep 2 is not the ranks of one model instance (tp 4)",
     "set ep: 4"),
    (merged(MOE, {"parallelism": {"tp": 2, "dp": 2, "ep": 2}}), "ep 2 is not the ranks of one model instance",
     "use dp_attention"),
    (merged(MOE, {"model": {"geometry": {"n_routed_experts": 6}}, "parallelism": {"tp": 4, "ep": 4}}),
     "ep 4 does not divide n_routed_experts (6)", "use tp = ep in [1, 2, 3, 6]"),
])
def test_expert_parallelism_that_cannot_split_is_refused(dsv4_spec, change, message, hint):
    spec = dsv4_spec(change)
    issue = only_issue(spec)
    assert issue.path == ("parallelism", "ep") and issue.message.startswith(message), issue.message
    assert hint in issue.hint


def test_the_context_is_not_bounded_by_max_position_embeddings(dsv4_spec):
    # a Dsv4Geometry has none: without YaRN it changes nothing computed
    assert load_spec(dsv4_spec({"serving": {"max_context_len": 1 << 16, "max_total_tokens": 1 << 17}}))


def test_every_problem_is_reported_at_once_located_without_a_traceback(dsv4_spec, capsys):
    spec = dsv4_spec({"model": {"geometry": {"o_groups": 2, "o_lora_rank": 8}},
                      "backend": {"kind": "cuda", "device": "h100", "attention": "flashinfer"},
                      "parallelism": {"tp": 4}})
    assert main(["build", str(spec), "-o", str(spec.parent / "out")]) == 2
    err = capsys.readouterr().err
    where = display_path(spec)
    for field, text in (("backend.attention", "attention: flashinfer"), ("parallelism.tp", "tp: 4")):
        assert f"{where}:{line_of(spec, text)}:" in err and f": {field}: " in err
    assert "Traceback" not in err and not (spec.parent / "out").exists()


@pytest.mark.parametrize(("field", "value"), [("hca_ratio", 16), ("csa_ratio", 8)])
def test_ascend_takes_the_operators_compress_ratios(dsv4_spec, field, value):
    ratios = [0, 4, 16, 4] if field == "hca_ratio" else [0, 8, 128, 8]
    spec = dsv4_spec({"backend": {"kind": "ascend", "device": "910c"},
                      "model": {"geometry": {"hca_ratio": 128, "compress_ratios": ratios, field: value}}})
    issue = only_issue(spec)
    assert issue.path == ("model", "geometry", field)
    assert issue.message.startswith(f"{field} is {value}, but the Ascend DSV4 operators take compress ratio")
    assert issue.hint.startswith(f"use {field}: ")
    assert issue.location.line == line_of(spec, f"{field}: {value}")
