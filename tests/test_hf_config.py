"""config.json read per family as transformers reads it (`dspark.formats.hf_config`), and what the
runtime's loader does with a config it does not implement. The spec corpus (`config_*.yaml`) checks
that the compiler refuses the same configs with a located error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.formats.hf_config import ConfigFieldError, family_of_config, geometry_values
from dspark.runtime.config import ModelGeometry
from dspark.runtime.models.checkpoint import CheckpointError, load_target

BASE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 2048}


def test_transformers_5_rope_parameters_give_the_theta() -> None:
    values = geometry_values({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    assert values["rope_theta"] == 500000.0 and values["rope_scaling"] is None


def test_rope_scaling_wins_over_rope_parameters_and_keeps_the_top_level_theta() -> None:
    cfg = {**BASE, "rope_theta": 500000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0},
           "rope_scaling": {"type": "linear", "factor": 2.0}}
    values = geometry_values(cfg)
    assert values["rope_theta"] == 500000.0  # rope_scaling (which has no theta) replaced the parameters
    assert values["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


def test_absent_keys_resolve_as_each_family_defaults_them() -> None:
    llama = geometry_values(BASE, "llama")
    assert (llama["head_dim"], llama["num_kv_heads"], llama["rms_norm_eps"]) == (16, 4, 1e-6)
    qwen3 = geometry_values({**BASE, "model_type": "qwen3"}, "qwen3")
    assert (qwen3["head_dim"], qwen3["num_kv_heads"]) == (128, 32)  # Qwen3Config's defaults
    assert geometry_values({**BASE, "num_key_value_heads": None}, "qwen3")["num_kv_heads"] == 4


def test_yarn_resolves_its_factor_and_attention_factor_as_transformers() -> None:
    cfg = {**BASE, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": None,
                                       "original_max_position_embeddings": 512, "mscale": 0.5,
                                       "mscale_all_dim": 1.0}}
    scaling = geometry_values(cfg)["rope_scaling"]
    assert scaling["factor"] == 4.0  # max_position_embeddings / original
    assert scaling["attention_factor"] == pytest.approx((0.05 * 1.3862943611198906 + 1) /
                                                        (0.1 * 1.3862943611198906 + 1))
    assert (scaling["beta_fast"], scaling["beta_slow"], scaling["truncate"]) == (32.0, 1.0, True)


def test_the_family_comes_from_model_type() -> None:
    assert family_of_config({"model_type": "qwen3"}).name == "qwen3"
    assert family_of_config({}).name == "llama"
    with pytest.raises(ConfigFieldError, match="model_type"):
        family_of_config({"model_type": "gemma3"})


@pytest.mark.parametrize("cfg,key", [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ({"partial_rotary_factor": 0.25, "rope_theta": 1e4, "rope_parameters": {"rope_type": "default"}},
     "rope_parameters.partial_rotary_factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta": 1}}, "rope_scaling.beta"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
    ({"attention_bias": 1}, "attention_bias"),
    ({"model_type": "qwen3"}, "model_type"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
])
def test_a_value_dspark_does_not_implement_is_refused_naming_its_key(cfg: dict, key: str) -> None:
    with pytest.raises(ConfigFieldError) as raised:
        geometry_values({**BASE, **cfg}, "llama")
    assert raised.value.key == key and raised.value.hint


def test_sliding_windows_are_refused_only_where_a_layer_would_slide() -> None:
    qwen3 = {**BASE, "model_type": "qwen3", "use_sliding_window": True, "sliding_window": 64}
    with pytest.raises(ConfigFieldError, match="from layer 1 on") as raised:
        geometry_values({**qwen3, "max_window_layers": 1}, "qwen3")
    assert raised.value.key == "use_sliding_window"
    assert geometry_values({**qwen3, "max_window_layers": 2}, "qwen3")["num_layers"] == 2  # none slides
    assert geometry_values({**qwen3, "sliding_window": None}, "qwen3")["num_layers"] == 2
    with pytest.raises(ConfigFieldError, match="layer_types"):
        geometry_values({**qwen3, "layer_types": ["full_attention", "sliding_attention"]}, "qwen3")


def test_the_loader_refuses_such_a_config_without_a_traceback(tmp_path: Path) -> None:
    cfg = {**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json: rope_scaling.rope_type is 'longrope'"):
        load_target(str(tmp_path))


def test_config_json_round_trips_through_the_runtime_config() -> None:
    cfg = {**BASE, "model_type": "qwen3", "head_dim": 32, "num_key_value_heads": 2,
           "tie_word_embeddings": True,
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                               "original_max_position_embeddings": 512}}
    geometry = ModelGeometry.from_hf(cfg, "qwen3")
    assert ModelGeometry.from_hf(geometry.to_hf("qwen3"), "qwen3") == geometry
    assert geometry.to_hf("qwen3")["architectures"] == ["Qwen3ForCausalLM"]
