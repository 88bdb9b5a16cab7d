"""A DeepSeek-V4 config.json read for dspark's DSV4 reference (`dspark.formats.dsv4_config`): the released
key layout at tiny sizes reads into the geometry that builds the reference model, and every key the
reference does not implement is refused naming the key."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.formats.dsv4_hf_config import dsv4_geometry
from dspark.formats.hf_config import ConfigFieldError

REPO = Path(__file__).resolve().parents[1]

# The released DeepSeek-V4-Flash layout (same keys, same spellings), at tiny sizes and with the parts the
# reference leaves out switched off: no routed experts, no hyper-connections, one output projection, no
# quantisation, no YaRN. compress_ratios has one entry more than the layers, for the MTP layer.
TINY: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 64,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 4,
    "initializer_range": 0.02,
    "max_position_embeddings": 4096,
    "moe_intermediate_size": 96,
    "n_routed_experts": 0,
    "n_shared_experts": 1,
    "num_attention_heads": 4,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 4,
    "num_hash_layers": 3,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": None,
    "o_lora_rank": None,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "hc_mult": None,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 16,
    "swiglu_limit": None,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "vocab_size": 256,
    "compress_rope_theta": 160000,
    "compress_ratios": [0, 4, 8, 4, 0],
}

EXPECTED = Dsv4Geometry(vocab_size=256, dim=64, compress_ratios=(0, 4, 8, 4), csa_ratio=4, hca_ratio=8,
                        n_heads=4, head_dim=32, rope_dim=8, q_lora_rank=32, window=16, index_n_heads=2,
                        index_head_dim=16, index_topk=4, inter_dim=96, norm_eps=1e-6, rope_theta=10000.0,
                        compress_rope_theta=160000.0)


def _read(tmp_path: Path, cfg: dict[str, Any]) -> Dsv4Geometry:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return dsv4_geometry(json.loads(path.read_text()))


def test_the_released_layout_reads_into_the_geometry_and_builds_the_reference(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from dspark.runtime.families.dsv4.model import DSV4Model

    geometry = _read(tmp_path, TINY)
    assert geometry == EXPECTED and geometry.n_layers == 4
    logits = DSV4Model(geometry, seed=0).forward_full([3, 1, 4, 1, 5, 9, 2, 6, 5])  # the model's own config
    assert logits.shape == (9, 256) and bool(torch.isfinite(logits).all())



def test_absent_keys_resolve_as_transformers_and_the_ratio_list_may_omit_the_mtp_layer() -> None:
    cfg = {k: v for k, v in TINY.items() if k not in ("rope_theta", "compress_rope_theta", "rms_norm_eps",
                                                      "n_shared_experts", "num_key_value_heads")}
    cfg["compress_ratios"] = [0, 4, 8, 4]
    assert dsv4_geometry(cfg) == EXPECTED
    assert dsv4_geometry({**TINY, "n_shared_experts": 2}).inter_dim == 192  # the FFN is the shared experts
    assert dsv4_geometry({**TINY, "compress_ratios": [0, 4, 0, 4, 0]}).hca_ratio == 128  # none listed
    no_mtp = {**TINY, "num_nextn_predict_layers": 0, "compress_ratios": [0, 4, 8, 4]}
    assert dsv4_geometry(no_mtp) == EXPECTED


def test_a_dspark_bearing_config_reads_as_its_target() -> None:
    # the release's DSpark checkpoints: three draft stages after the layers, their keys beside the target's
    stages = {**TINY, "num_nextn_predict_layers": 3, "compress_ratios": [0, 4, 8, 4, 0, 0, 0],
              "dspark_block_size": 5, "dspark_noise_token_id": 250, "dspark_target_layer_ids": [1, 2, 3],
              "dspark_markov_rank": 16, "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 1}
    assert dsv4_geometry(stages) == EXPECTED


def test_the_releases_fp8_quantization_config_reads_with_its_block() -> None:
    from dspark.formats.dsv4_hf_config import fp8_block

    quant = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 64],
             "activation_scheme": "dynamic", "expert_dtype": "fp4"}
    assert dsv4_geometry({**TINY, "quantization_config": quant}) == EXPECTED  # computes the dequantised model
    assert fp8_block({**TINY, "quantization_config": quant}) == (128, 64) and fp8_block(TINY) == (128, 128)


def test_the_transformers_5_spellings_read_the_same() -> None:
    cfg = {k: v for k, v in TINY.items() if k not in ("compress_ratios", "qk_rope_head_dim", "rope_theta",
                                                      "compress_rope_theta", "moe_intermediate_size")}
    cfg.update({"layer_types": ["sliding_attention", "compressed_sparse_attention",
                                "heavily_compressed_attention", "compressed_sparse_attention"],
                "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                "partial_rotary_factor": 0.25, "intermediate_size": 96,
                "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0},
                                    "compress": {"rope_type": "default", "rope_theta": 160000.0}}})
    assert dsv4_geometry(cfg) == EXPECTED


@pytest.mark.parametrize("overrides,key", [
    ({"o_lora_rank": "__absent__"}, "o_lora_rank"),  # transformers' 1024 beside a null o_groups
    ({"o_groups": 3, "o_lora_rank": 8}, "o_groups"),  # does not divide the 4 heads
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config.quant_method"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "quantization_config.fmt"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
     "quantization_config.weight_block_size"),
    ({"quantization_config": {"quant_method": "fp8", "modules_to_not_convert": []}},
     "quantization_config.modules_to_not_convert"),
    ({"rope_scaling": {"type": "linear", "factor": 4}}, "rope_scaling.type"),
    ({"rope_scaling": {"type": "yarn", "factor": 16}}, "rope_scaling.original_max_position_embeddings"),
    ({"rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                       "attention_factor": 0.5}}, "rope_scaling.attention_factor"),
    ({"rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                       "mscale": 1.0, "mscale_all_dim": 0.7}}, "rope_scaling.attention_factor"),
    ({"rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                       "truncate": False}}, "rope_scaling.truncate"),
    ({"rope_parameters": {"main": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 64},
                          "compress": {"rope_type": "default"}}}, "rope_parameters.main.rope_type"),
    ({"rope_parameters": {"main": {"rope_type": "default"}, "compress": {"rope_type": "yarn", "factor": 16}}},
     "rope_parameters.compress.original_max_position_embeddings"),
    ({"n_routed_experts": 8, "n_shared_experts": 2}, "n_shared_experts"),
    ({"n_routed_experts": 8, "scoring_func": "relu"}, "scoring_func"),
    ({"n_routed_experts": 8, "topk_method": "greedy"}, "topk_method"),
    ({"n_routed_experts": 8, "n_group": 8, "topk_group": 4}, "n_group"),
    ({"n_routed_experts": 8, "num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"n_routed_experts": 8, "mlp_layer_types": ["moe", "hash_moe", "moe", "moe"]}, "mlp_layer_types"),
    ({"n_routed_experts": 8, "num_hash_layers": 1, "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"]},
     "num_hash_layers"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"first_k_dense_replace": 1}, "first_k_dense_replace"),
    ({"swiglu_limit": -1.0}, "swiglu_limit"),
    ({"hc_mult": 0}, "hc_mult"),  # only null is the plain residual
    ({"compress_ratios": [0, 4, 8, 4, 0, 0]}, "compress_ratios"),  # neither 4 nor 4 + 1 MTP entries
    ({"compress_ratios": [0, 4, 8]}, "compress_ratios"),
    ({"compress_ratios": [0, 4, 8, 128, 0]}, "compress_ratios"),  # two HCA ratios
    ({"compress_ratios": [0, 1, 8, 4, 0]}, "compress_ratios"),  # 1: readers disagree
    ({"compress_ratios": [0, -4, 8, 4, 0]}, "compress_ratios"),
    ({"compress_ratios": "__absent__"}, "compress_ratios"),
    ({"compress_rates": {"compressed_sparse_attention": 8}}, "compress_rates.compressed_sparse_attention"),
    ({"layer_types": ["sliding_attention"] * 4}, "layer_types"),  # disagrees with compress_ratios
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "deepseek_v3"}, "model_type"),
    ({"engram_layer_ids": [1]}, "engram_layer_ids"),  # unknown keys are refused
    ({"n_shared_experts": 0}, "n_shared_experts"),
    ({"vocab_size": "__absent__"}, "vocab_size"),
    ({"q_lora_rank": "__absent__"}, "q_lora_rank"),
    ({"moe_intermediate_size": "__absent__"}, "moe_intermediate_size"),
    ({"hidden_size": "64"}, "hidden_size"),
    ({"sliding_window": 16.0}, "sliding_window"),
    ({"index_topk": True}, "index_topk"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    ({"compress_ratios": {"0": 0}}, "compress_ratios"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),  # odd
    ({"qk_rope_head_dim": 64}, "qk_rope_head_dim"),  # more than head_dim
    ({"intermediate_size": 128}, "intermediate_size"),  # disagrees with moe_intermediate_size
])
def test_each_refusal_names_the_key(overrides: dict[str, Any], key: str) -> None:
    cfg = {**TINY, **overrides}
    cfg = {k: v for k, v in cfg.items() if v != "__absent__"}
    with pytest.raises(ConfigFieldError) as info:
        dsv4_geometry(cfg)
    assert info.value.key == key
    assert str(info.value).startswith(key) and info.value.hint


def test_the_geometry_validates_itself_naming_the_config_key() -> None:
    with pytest.raises(ConfigFieldError, match="sliding_window"):
        dataclasses.replace(EXPECTED, window=0)
    with pytest.raises(ConfigFieldError, match="compress_ratios"):
        dataclasses.replace(EXPECTED, compress_ratios=(0, 5))
    listed = dataclasses.replace(EXPECTED, compress_ratios=[0, 4])  # type: ignore[arg-type]
    assert listed.compress_ratios == (0, 4)


def test_the_reader_imports_no_torch() -> None:
    code = "import sys, dspark.formats.dsv4_config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
