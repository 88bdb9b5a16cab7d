"""The DSpark draft a DeepSeek-V4 checkpoint carries beside its target (the `mtp.{i}` stages), as its
config.json describes it: `num_nextn_predict_layers` stages, `dspark_block_size`, `dspark_noise_token_id`,
`dspark_target_layer_ids`, `dspark_markov_rank` and the stages' own expert counts
(`dspark_n_routed_experts`, `dspark_num_experts_per_tok`). Torch-free: the compiler reads it to resolve a
spec whose draft is the target's own checkpoint; the runtime builds the stages from it
(`dspark.runtime.families.dsv4.dspark_stages`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.formats.dsv4_hf_config import DSV4_MODEL_TYPE
from dspark.formats.hf_config import ConfigFieldError

_HINT = "use a DSpark-bearing DeepSeek-V4 config.json"


@dataclass(frozen=True)
class Dsv4DSparkConfig:
    block_size: int  # slots per block: the anchor and block_size - 1 noise tokens
    noise_token_id: int
    target_layer_ids: tuple[int, ...]  # target layers whose residual (stream mean) the context reads
    markov_rank: int
    stages: int  # num_nextn_predict_layers
    stage: Dsv4Geometry  # the stages' layers: the target's sizes, window-only, the draft's experts

    @property
    def layers_before_capture(self) -> tuple[int, ...]:
        """The target residuals the context reads, as decoder-layer counts."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def num_layers(self) -> int:
        return self.stages

    @property
    def context_window(self) -> int:
        """Context entries a block reads at most: a row at p sees p - window + 1 .. , the anchor's row
        the window - 1 positions before it."""
        return self.stage.window - 1


def has_dspark_stages(cfg: Any) -> bool:
    """Whether a config.json (parsed) is a DeepSeek-V4 checkpoint that carries DSpark stages."""
    return isinstance(cfg, dict) and cfg.get("model_type") == DSV4_MODEL_TYPE and "dspark_block_size" in cfg


def dsv4_dspark_config(cfg: dict[str, Any], target: Dsv4Geometry) -> Dsv4DSparkConfig:
    """The stages a DeepSeek-V4 config.json describes over its target's geometry, refusing what dspark does
    not implement by key (`ConfigFieldError`)."""
    def int_key(key: str, minimum: int, default: int | None = None) -> int:
        value = cfg.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigFieldError(key, f"is {value!r}, not an integer >= {minimum}", _HINT)
        return value

    stages = int_key("num_nextn_predict_layers", 1)
    ids = cfg.get("dspark_target_layer_ids")
    if not isinstance(ids, list) or not ids or ids != sorted(set(ids)) or any(
            not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < target.n_layers for i in ids):
        raise ConfigFieldError("dspark_target_layer_ids", f"is {ids!r}, not increasing target layer ids "
                               f"in 0..{target.n_layers - 1}", _HINT)
    ratios = cfg.get("compress_ratios", [])
    stage_ratios = ratios[target.n_layers:] if isinstance(ratios, list) else []
    if len(stage_ratios) not in (0, stages) or any(r != 0 for r in stage_ratios):
        raise ConfigFieldError("compress_ratios", f"gives the draft stages {stage_ratios}; dspark's stages "
                               "are window-only layers (ratio 0)",
                               "use a checkpoint whose stages have ratio 0")
    if cfg.get("enable_confidence_head", True) is not True:
        raise ConfigFieldError("enable_confidence_head", "is not true; the stages' confidence head is read "
                               "with them", "use a checkpoint with the confidence head")
    experts = int_key("dspark_n_routed_experts", 1, target.n_routed_experts) if target.n_routed_experts \
        else 0
    topk = int_key("dspark_num_experts_per_tok", 1, target.n_activated_experts) if experts else 0
    if experts and topk > experts:
        raise ConfigFieldError("dspark_num_experts_per_tok", f"is {topk}, more than the stages' {experts} "
                               "experts", _HINT)
    noise = int_key("dspark_noise_token_id", 0)
    if noise >= target.vocab_size:
        raise ConfigFieldError("dspark_noise_token_id", f"is {noise}, outside the vocabulary of "
                               f"{target.vocab_size}", _HINT)
    stage = dataclasses.replace(target, compress_ratios=(0,) * stages, n_hash_layers=0,
                                n_routed_experts=experts, n_activated_experts=topk, index_quant=False)
    return Dsv4DSparkConfig(block_size=int_key("dspark_block_size", 1), noise_token_id=noise,
                            target_layer_ids=tuple(ids), markov_rank=int_key("dspark_markov_rank", 1),
                            stages=stages, stage=stage)
