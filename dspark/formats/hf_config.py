"""What a Hugging Face config.json says about a model's shape: one reading for the compiler and the
runtime, so the geometry that compiles is the geometry that loads."""

from __future__ import annotations

from typing import Any

# Hugging Face LlamaConfig key of each geometry field, and what an absent optional key means.
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
HF_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-5}
HF_OPTIONAL_KEYS = ("head_dim", "num_key_value_heads", *HF_DEFAULTS)


def geometry_values(cfg: dict[str, Any]) -> dict[str, Any]:
    """Geometry fields read from a Hugging Face Llama config.json, absent keys resolved."""
    values = {f: cfg[k] for f, k in HF_GEOMETRY_KEYS.items() if cfg.get(k) is not None}
    values.setdefault("num_kv_heads", values.get("num_heads"))  # absent: multi-head attention
    hidden, heads = values.get("hidden_size"), values.get("num_heads")
    # Only derive head_dim from sizes that are integers; anything else is left for validation to
    # report against the config key, instead of failing here on arithmetic with a string or null.
    if _positive_int(hidden) and _positive_int(heads):
        values.setdefault("head_dim", hidden // heads)
    return {**HF_DEFAULTS, **values}


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
