"""What a Hugging Face config.json says about a target model: one reading for the compiler and the
runtime, so the model that compiles is the model that loads.

Every key that changes the computation is read here, per model family, the way `transformers` reads
it (its config classes' defaults for absent keys, `rope_parameters` as transformers 5 writes it and
`rope_scaling` / top-level `rope_theta` as earlier versions did), and a value dspark does not
implement is refused with a `ConfigFieldError` naming the key, so a checkpoint is never served with
a computation other than the one it was trained with. Torch-free: the compiler imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

# The geometry field each Hugging Face config key holds (the keys both families share).
HF_GEOMETRY_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "max_position_embeddings": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps",
}
# Defaults of the transformers config classes for keys a config.json may leave out (both families).
HF_DEFAULTS: dict[str, Any] = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6}
HF_OPTIONAL_KEYS = ("head_dim", "num_key_value_heads", *HF_DEFAULTS)
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class Family:
    """A target model family: the config.json it reads and how absent keys resolve."""

    name: str
    model_type: str  # config.json `model_type`
    architecture: str  # config.json `architectures[0]`
    # transformers' defaults for keys both families have but default differently: Qwen3Config has
    # head_dim 128 and 32 KV heads where LlamaConfig derives them from hidden_size and the heads.
    head_dim_default: int | None = None  # None: hidden_size // num_attention_heads
    num_kv_heads_default: int | None = None  # None: num_attention_heads
    has_mlp_bias: bool = False  # LlamaConfig.mlp_bias; Qwen3's MLP has no bias
    sliding_window_keys: bool = False  # Qwen3Config's use_sliding_window / max_window_layers


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "llama", "LlamaForCausalLM", has_mlp_bias=True),
    "qwen3": Family("qwen3", "qwen3", "Qwen3ForCausalLM", head_dim_default=128, num_kv_heads_default=32,
                    sliding_window_keys=True),
}


@dataclass(frozen=True)
class RopeScaling:
    """A resolved `rope_parameters` / `rope_scaling` entry (`rope_type` other than default).

    `factor` and, for yarn, `attention_factor` are resolved as transformers resolves them, so the
    runtime computes the inverse frequencies from these values alone (`ops.rope_frequencies`).
    """

    rope_type: str  # linear, dynamic, llama3 or yarn
    factor: float
    original_max_position_embeddings: int | None = None  # llama3, yarn; dynamic: max_position_embeddings
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    attention_factor: float | None = None  # yarn: the scale of cos and sin
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    truncate: bool | None = None  # yarn: round the correction range outwards

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES[1:]:
            raise ValueError(f"rope_type {self.rope_type!r} is not one of {ROPE_TYPES[1:]}")
        needed = {"dynamic": ("original_max_position_embeddings",),
                  "llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
                  "yarn": ("original_max_position_embeddings", "attention_factor", "beta_fast",
                           "beta_slow", "truncate")}.get(self.rope_type, ())
        absent = [name for name in needed if getattr(self, name) is None]
        if absent:
            raise ValueError(f"{self.rope_type} RoPE scaling needs {', '.join(absent)}")

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


ROPE_SCALING_FIELDS = tuple(f.name for f in fields(RopeScaling))


def yarn_ramp(dim: int, theta: float, original_max: int, beta_fast: float, beta_slow: float,
              truncate: bool = True) -> tuple[float, float]:
    """YaRN's (arXiv 2309.00071) ramp over the rotated pairs -> its ends (low, high): pairs below `low` turn
    more than beta_fast times over the original context and keep their frequency, pairs from `high` on turn
    fewer than beta_slow times and are interpolated; `truncate` rounds the ends outwards to whole pairs. Never
    zero-width, as transformers."""
    def pair_at(turns: float) -> float:
        return dim * math.log(original_max / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_at(beta_fast), pair_at(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    return low, (high + 0.001 if low == high else high)


class ConfigFieldError(ValueError):
    """A config.json key with a value dspark does not implement (or cannot read)."""

    def __init__(self, key: str, problem: str, hint: str) -> None:
        super().__init__(f"{key} {problem}")
        self.key, self.problem, self.hint = key, problem, hint


def family_of_config(cfg: dict[str, Any]) -> Family:
    """The family a config.json's `model_type` names (llama when it names none, as dspark's own
    embedded checkpoints once did)."""
    model_type = cfg.get("model_type", "llama")
    for family in FAMILIES.values():
        if family.model_type == model_type:
            return family
    raise ConfigFieldError("model_type", f"is {model_type!r}, a family dspark does not implement",
                           f"use a checkpoint of one of: {', '.join(FAMILIES)}")


def geometry_values(cfg: dict[str, Any], family: str = "llama") -> dict[str, Any]:
    """The model config fields (`ModelGeometry`'s) read from a Hugging Face config.json of `family`,
    absent keys resolved as transformers resolves them.

    Raises `ConfigFieldError` for a key whose value changes the computation in a way dspark does not
    implement. Values of the wrong type are passed through for the caller's validation to report
    against the field.
    """
    fam = FAMILIES[family]
    _check_family(cfg, fam)
    values = {f: cfg[k] for f, k in HF_GEOMETRY_KEYS.items() if cfg.get(k) is not None}
    if "num_key_value_heads" not in cfg and fam.num_kv_heads_default is not None:
        values["num_kv_heads"] = fam.num_kv_heads_default
    values.setdefault("num_kv_heads", values.get("num_heads"))  # null or absent: multi-head attention
    if fam.head_dim_default is not None:
        values.setdefault("head_dim", fam.head_dim_default)
    hidden, heads = values.get("hidden_size"), values.get("num_heads")
    # Only derive head_dim from sizes that are integers; anything else is left for validation to
    # report against the config key, instead of failing here on arithmetic with a string or null.
    if _positive_int(hidden) and _positive_int(heads):
        values.setdefault("head_dim", hidden // heads)
    theta, scaling = _rope(cfg, values.get("max_position_embeddings"))
    if theta is not None:
        values["rope_theta"] = theta
    values["rope_scaling"] = scaling
    values["tie_word_embeddings"] = _flag(cfg, "tie_word_embeddings")
    values["attention_bias"] = _flag(cfg, "attention_bias")
    values["mlp_bias"] = _flag(cfg, "mlp_bias") if fam.has_mlp_bias else False
    return {**HF_DEFAULTS, **values}


def _check_family(cfg: dict[str, Any], fam: Family) -> None:
    model_type = cfg.get("model_type")
    if model_type is not None and model_type != fam.model_type:
        other = next((f.name for f in FAMILIES.values() if f.model_type == model_type), None)
        raise ConfigFieldError(
            "model_type", f"is {model_type!r}, not the {fam.model_type!r} of model.family {fam.name}",
            f"set model.family: {other}" if other else
            f"point model.checkpoint at a {fam.name} checkpoint (dspark implements {', '.join(FAMILIES)})")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigFieldError("hidden_act", f"is {act!r}; dspark's {fam.name} MLP implements silu only",
                               "use a checkpoint whose hidden_act is silu")
    if not fam.has_mlp_bias and cfg.get("mlp_bias"):
        raise ConfigFieldError("mlp_bias", f"is true, but {fam.name} models have no MLP bias",
                               "remove mlp_bias from config.json or use a llama checkpoint")
    layer_types = cfg.get("layer_types")
    if fam.sliding_window_keys and layer_types is None and cfg.get("use_sliding_window") \
            and cfg.get("sliding_window") is not None:
        # as Qwen3Config derives layer_types: layers from max_window_layers on slide
        layers, first = cfg.get("num_hidden_layers"), cfg.get("max_window_layers", 28)
        if not (_positive_int(layers) and isinstance(first, int) and first >= layers):
            raise ConfigFieldError("use_sliding_window", f"is true (sliding-window attention from layer "
                                   f"{first!r} on); dspark implements full attention only",
                                   "set use_sliding_window: false (released Qwen3 checkpoints do) or use "
                                   "another checkpoint")
    if layer_types is not None:
        kinds = set(layer_types) if isinstance(layer_types, list) else {layer_types}
        if kinds - {"full_attention"}:
            raise ConfigFieldError("layer_types", f"holds {sorted(map(str, kinds))}; dspark implements "
                                   "full_attention layers only", "use a checkpoint without sliding-window "
                                   "layers")


def _flag(cfg: dict[str, Any], key: str) -> Any:
    value = cfg.get(key, False)
    if not isinstance(value, bool):
        raise ConfigFieldError(key, f"is {value!r}, not true or false", f"write {key}: true or false")
    return value


def _rope(cfg: dict[str, Any], max_positions: Any) -> tuple[Any, dict[str, Any] | None]:
    """(rope_theta or None when absent, the scaling's `RopeScaling` fields or None).

    transformers 5 writes `rope_parameters: {rope_type, rope_theta, ...}` and no top-level
    `rope_theta`; earlier versions wrote `rope_theta` and `rope_scaling: {type | rope_type, ...}`.
    Like transformers, `rope_scaling` wins over `rope_parameters`, and a theta inside the parameters
    over the top-level one.
    """
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    if params is None:
        return cfg.get("rope_theta"), None
    if not isinstance(params, dict):
        raise ConfigFieldError(key, f"is {params!r}, not an object", f"write {key} as a JSON object")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigFieldError(f"{key}.partial_rotary_factor", f"is {partial!r}; dspark rotates the whole "
                               "head", "use a checkpoint with partial_rotary_factor 1.0")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigFieldError(f"{key}.rope_type", f"is {rope_type!r}, which dspark does not implement",
                               f"dspark implements {', '.join(ROPE_TYPES)}; use a checkpoint with one "
                               "of them")
    if rope_type == "default":
        return theta, None
    known = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor"} | {
        "llama3": {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
        "yarn": {"original_max_position_embeddings", "attention_factor", "mscale", "mscale_all_dim",
                 "beta_fast", "beta_slow", "truncate"},
    }.get(rope_type, set())
    unknown = sorted(set(params) - known)
    if unknown:
        raise ConfigFieldError(f"{key}.{unknown[0]}", f"is not a {rope_type} RoPE parameter dspark knows",
                               f"remove it, or use a checkpoint whose {key} holds only: "
                               f"{', '.join(sorted(known))}")

    def number(name: str, value: Any) -> Any:
        if value is None:
            raise ConfigFieldError(f"{key}.{name}", f"is missing; {rope_type} RoPE scaling needs it",
                                   f"add {name} to {key}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value <= 0:
            raise ConfigFieldError(f"{key}.{name}", f"is {value!r}, not a positive number",
                                   f"write {key}.{name} as a positive number")
        return value

    # As transformers: a top-level original_max_position_embeddings wins (Phi-3 writes one there),
    # then the parameters' own, then max_position_embeddings.
    original = cfg.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings", max_positions)
    if rope_type == "linear":
        return theta, {"rope_type": "linear", "factor": float(number("factor", params.get("factor")))}
    if rope_type == "dynamic":
        # transformers recomputes dynamic-NTK frequencies from the longest position of the forward
        # call once it passes max_position_embeddings, so a row's result would depend on its batch;
        # below that they are fixed, and dspark serves no position past it (the spec's max_context_len
        # rule), so it computes exactly what transformers does. The frequencies are those at
        # max_position_embeddings, kept as original_max_position_embeddings.
        return theta, {"rope_type": "dynamic", "factor": float(number("factor", params.get("factor"))),
                       "original_max_position_embeddings": int(number("max_position_embeddings",
                                                                      max_positions))}
    if rope_type == "llama3":
        return theta, {"rope_type": "llama3", "factor": float(number("factor", params.get("factor"))),
                       "low_freq_factor": float(number("low_freq_factor", params.get("low_freq_factor"))),
                       "high_freq_factor": float(number("high_freq_factor", params.get("high_freq_factor"))),
                       "original_max_position_embeddings": int(number("original_max_position_embeddings",
                                                                      original))}
    # yarn
    original = number("original_max_position_embeddings", original)
    factor = params.get("factor")
    if factor is None and _positive_int(max_positions):
        factor = max_positions / original  # as transformers: the context extension ratio
    factor = float(number("factor", factor))
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, number("mscale", mscale)) /
                     _yarn_mscale(factor, number("mscale_all_dim", mscale_all))
                     if mscale and mscale_all else _yarn_mscale(factor))
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigFieldError(f"{key}.truncate", f"is {truncate!r}, not true or false",
                               f"write {key}.truncate as true or false")
    return theta, {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(original),
                   "attention_factor": float(number("attention_factor", attention)),
                   "beta_fast": float(number("beta_fast", params.get("beta_fast") or 32)),
                   "beta_slow": float(number("beta_slow", params.get("beta_slow") or 1)),
                   "truncate": truncate}


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def config_json(values: dict[str, Any], family: str) -> dict[str, Any]:
    """A Hugging Face config.json for `family` with `ModelGeometry` field `values` (how dspark saves
    the checkpoints it trains, and what `geometry_values` reads back)."""
    fam = FAMILIES[family]
    out = {HF_GEOMETRY_KEYS[name]: values[name] for name in HF_GEOMETRY_KEYS}
    scaling = values.get("rope_scaling")
    if scaling:
        out["rope_scaling"] = dict(scaling)
    out.update({"architectures": [fam.architecture], "model_type": fam.model_type, "hidden_act": "silu",
                "tie_word_embeddings": bool(values.get("tie_word_embeddings", False)),
                "attention_bias": bool(values.get("attention_bias", False)), "torch_dtype": "float32"})
    if fam.has_mlp_bias:
        out["mlp_bias"] = bool(values.get("mlp_bias", False))
    return out


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
