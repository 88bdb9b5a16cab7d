"""DeepSeek-V4 checkpoints that carry DSpark stages, written as the release lays them out (the target's
tensors in the release's names, the stages' as mtp.{i}.*, one config.json with the dspark_* keys): shared by
the stage tests and the engine tests that serve them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dspark.formats.dsv4_dspark_config import dsv4_dspark_config
from dspark.formats.dsv4_hf_config import dsv4_geometry
from dspark.runtime.families.dsv4.dspark_stages import Dsv4DSparkStages
from dspark.runtime.families.dsv4.model import DSV4Model
from dspark.runtime.families.dsv4.weights import RELEASE_LAYER_NAMES
from dspark.runtime.tokenizer import BYTE_TOKENIZER_FILE, EOS_ID, VOCAB_SIZE

# DSV4Model's names -> the release's (the first release name of each; experts are split per expert)
_LAYER = {}
for _release, _ours in RELEASE_LAYER_NAMES.items():
    _LAYER.setdefault(_ours, _release)
_TOP = {"embed": "embed.weight", "final_norm": "norm.weight", "head": "head.weight",
        "hc_head.fn": "hc_head_fn", "hc_head.base": "hc_head_base", "hc_head.scale": "hc_head_scale"}
_HEADS = {"norm": "norm.weight", "hc_head.fn": "hc_head_fn", "hc_head.base": "hc_head_base",
          "hc_head.scale": "hc_head_scale", "markov_w1": "markov_head.markov_w1.weight",
          "markov_w2": "markov_head.markov_w2.weight", "confidence": "confidence_head.proj.weight"}

# A DSpark-bearing DeepSeek-V4-Flash config.json at tiny sizes (the release's spellings): hash-routed and
# learned top-k experts, hyper-connections, the grouped output projection, sliding / C4 / C8 layers, and two
# window-only DSpark stages with their own expert counts.
STAGE_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": VOCAB_SIZE,
    "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 16, "qk_rope_head_dim": 4, "q_lora_rank": 16, "sliding_window": 6, "index_n_heads": 4,
    "index_head_dim": 8, "index_topk": 3, "moe_intermediate_size": 24, "n_routed_experts": 6,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "num_hash_layers": 1, "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "swiglu_limit": 10.0, "hc_mult": 2,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "o_groups": 2, "o_lora_rank": 8, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "compress_rope_theta": 160000, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "eos_token_id": EOS_ID, "bos_token_id": 0, "torch_dtype": "float32",
    "num_nextn_predict_layers": 2, "compress_ratios": [0, 4, 8, 4, 0, 0],
    "dspark_block_size": 4, "dspark_noise_token_id": VOCAB_SIZE - 1, "dspark_target_layer_ids": [1, 2],
    "dspark_markov_rank": 8, "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 1,
}


def release_state(stages: Dsv4DSparkStages, seed: int) -> dict[str, torch.Tensor]:
    """Random stage weights in the release's names (mtp.{i}.*, experts one tensor each)."""
    gen = torch.Generator().manual_seed(seed)
    last = stages.cfg.stages - 1
    state = {}
    for name, param in stages.state_dict().items():
        value = torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5
        if name.endswith("norm") or name.endswith("_norm"):
            value = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
        if name in ("main_proj", "main_norm"):
            state[f"mtp.0.{name}.weight"] = value
        elif name in _HEADS:
            state[f"mtp.{last}.{_HEADS[name]}"] = value
        else:
            _, i, rest = name.split(".", 2)
            state.update(_layer_tensors(f"mtp.{i}", rest, value))
    return state


def target_release_state(model: DSV4Model) -> dict[str, torch.Tensor]:
    """A DSV4Model's tensors in the release's names."""
    state = {}
    for name, tensor in model.state_dict().items():
        if name in _TOP:
            state[_TOP[name]] = tensor
            continue
        _, i, rest = name.split(".", 2)
        state.update(_layer_tensors(f"layers.{i}", rest, tensor))
    return state


def _layer_tensors(prefix: str, rest: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A layer's tensor `rest` (DSV4Layer's name) under `prefix` in the release's names; stacked experts one
    tensor each."""
    if rest.startswith("ffn.experts."):
        which = rest.rsplit(".", 1)[-1]
        return {f"{prefix}.ffn.experts.{e}.{which}.weight": tensor[e] for e in range(tensor.shape[0])}
    return {f"{prefix}.{_LAYER[rest]}": tensor}


def write_stage_checkpoint(path: Path, config: dict[str, Any] = STAGE_CONFIG, seed: int = 0) -> Path:
    """A DSpark-bearing DeepSeek-V4 checkpoint at `path`: random target weights (`DSV4Model`'s seeded ones)
    and random stages, in the release's names, with `config` as its config.json and the byte tokenizer."""
    geometry = dsv4_geometry(config)
    target = DSV4Model(geometry, seed=seed)
    stages = Dsv4DSparkStages(dsv4_dspark_config(config, geometry), target.embed.detach(),
                              target.head.detach())
    state = {**target_release_state(target), **release_state(stages, seed + 1)}
    path.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in state.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / BYTE_TOKENIZER_FILE).write_text(json.dumps({"type": "byte"}))
    return path
