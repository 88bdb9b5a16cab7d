"""What a DeepSeek-V4 (DSV4) Hugging Face config.json says, read for dspark's DSV4 reference model.

`dsv4_geometry(cfg)` reads a config.json (a dict) into a `Dsv4Geometry` (`dsv4_config`), the compiler's
geometry and the model's config in one (`dspark.runtime.families.dsv4.model.DSV4Model` takes it). A key whose
value changes the computation in a way the reference does not implement is refused with a
`ConfigFieldError` (hf_config's) naming the key and what to do, so a checkpoint is never served with a
computation other than the one it was trained with. Torch-free: the compiler imports it.

Where the key names come from (read, not copied)
-----------------------------------------------
* The released layout: the DeepSeek-V4-Flash config.json on the Hugging Face hub
  (huggingface.co/deepseek-ai/DeepSeek-V4-Flash, written by transformers 4.57.1, as quoted verbatim in
  several public repositories): hidden_size, num_hidden_layers 43, num_attention_heads, num_key_value_heads 1,
  head_dim 512, q_lora_rank, qk_rope_head_dim 64, o_groups, o_lora_rank, sliding_window 128, index_n_heads,
  index_head_dim, index_topk, compress_ratios (44 entries for 43 layers: the last belongs to the one
  num_nextn_predict_layers MTP layer), compress_rope_theta, rope_theta, rope_scaling {type: yarn, ...},
  hc_mult, hc_sinkhorn_iters, hc_eps, n_routed_experts, n_shared_experts, num_experts_per_tok,
  moe_intermediate_size, num_hash_layers, scoring_func, topk_method, routed_scaling_factor, norm_topk_prob,
  swiglu_limit, quantization_config {quant_method fp8, ...}, rms_norm_eps, vocab_size, tie_word_embeddings.
* huggingface/transformers ``src/transformers/models/deepseek_v4/configuration_deepseek_v4.py``: the
  defaults of absent keys (n_routed_experts 256, hc_mult 4, o_groups 8, o_lora_rank 1024, ...), the
  transformers-5 spellings (layer_types, compress_rates, partial_rotary_factor, rope_parameters with main /
  compress, mlp_layer_types), the legacy ones it folds in (compress_ratios, compress_rate_csa / _hca,
  qk_rope_head_dim, num_hash_layers), and ``intermediate_size`` as an alias of ``moe_intermediate_size``.
* vllm-project/vllm ``vllm/model_executor/models/deepseek_v4.py`` and
  ``vllm/transformers_utils/configs/deepseek_v4.py``: the indexer only on ratio-4 layers, only the first
  num_hidden_layers entries of compress_ratios read (MTP layers get none), ratio 1 read as "no compressor"
  (``max(1, ratio)``), compress_rope_theta on compressed layers, interleaved RoPE, swiglu_limit clamping
  the shared expert too, n_shared_experts null meaning no shared expert; vllm-project/vllm-ascend
  ``vllm_ascend/transformers_utils/configs/deepseek_v4.py``; DeepSeek's V4 ``inference/model.py`` (as
  ported publicly): hyper-connection pre/post mixing; transformers' ``modeling_rope_utils`` for YaRN.

Geometry field <- config.json key
---------------------------------
vocab_size <- vocab_size; dim <- hidden_size; n_heads <- num_attention_heads; head_dim <- head_dim;
rope_dim <- qk_rope_head_dim (or head_dim * partial_rotary_factor); q_lora_rank <- q_lora_rank;
window <- sliding_window; index_n_heads, index_head_dim, index_topk <- the same names; norm_eps <-
rms_norm_eps; rope_theta <- rope_theta; compress_rope_theta <- compress_rope_theta (or rope_parameters.main
/ .compress rope_theta); compress_ratios <- the first num_hidden_layers entries of compress_ratios (or
layer_types through compress_rates); csa_ratio <- 4, or compress_rates.compressed_sparse_attention /
compress_rate_csa, which must be 4; hca_ratio <- the ratio of the other compressed layers
(compress_rates.heavily_compressed_attention / compress_rate_hca, else 128).
YaRN of the compressed layers: rope_factor, rope_original_max_position, rope_beta_fast, rope_beta_slow <-
rope_scaling (the release) or rope_parameters.compress (transformers 5) factor (or max_position_embeddings
/ original_max_position_embeddings), original_max_position_embeddings, beta_fast, beta_slow.
The FFN: ffn <- "moe" unless n_routed_experts is 0 or null ("dense": the shared expert's SwiGLU,
n_shared_experts of them wide); inter_dim <- moe_intermediate_size (or intermediate_size);
n_routed_experts, n_activated_experts <- n_routed_experts, num_experts_per_tok; n_hash_layers <-
num_hash_layers (or the leading hash_moe entries of mlp_layer_types); score_func <- scoring_func;
route_scale <- routed_scaling_factor; swiglu_limit <- swiglu_limit (null: 0, no clamp).
hc_mult, hc_sinkhorn_iters, hc_eps <- the same names (hc_mult null: 0, a plain residual); o_groups,
o_lora_rank <- the same names (both null: 0, one output projection). Absent keys take transformers'
defaults (256 experts, top-6, 3 hash layers, scale 1.5, hc_mult 4, 20 iterations, o_groups 8, rank 1024).

Refused
-------
A quantization_config other than the release's FP8 layout (e4m3, float or ue8m0 scales, dynamic
activations, FP8 or FP4 experts; its weight_block_size is read by the loader, `fp8_block`); a RoPE
scaling other than YaRN, YaRN on
the window-only layers (rope_parameters.main), or a YaRN that scales the attention (attention_factor other
than 1, unequal mscale / mscale_all_dim) or does not truncate its ramp; n_shared_experts other than 1
(transformers builds exactly one); a scoring_func other than sqrtsoftplus / sigmoid / softmax; topk_method
other than noaux_tc; group-limited routing (n_group > 1 with topk_group < n_group); norm_topk_prob false;
hash_moe layers after moe ones, or num_hash_layers disagreeing with mlp_layer_types; first_k_dense_replace
other than 0; a CSA ratio other than 4 (DeepSeek's code keys the overlap and the indexer on 4); ratio 1
(vLLM reads it as no compressor, DeepSeek's code as a compressor); two different HCA ratios; a ratio list
whose length is neither num_hidden_layers nor num_hidden_layers + num_nextn_predict_layers; more than one
KV head; attention or MLP bias; tied embeddings; non-interleaved RoPE; an activation other than silu;
o_groups and o_lora_rank not both set or both null; wrong types and missing required keys.

Ignored deliberately, as they do not change the target's computation: architectures, torch_dtype, dtype,
transformers_version, bos/eos/pad_token_id, use_cache, initializer_range, attention_dropout (inference),
max_position_embeddings (read only where a YaRN factor is left out), num_nextn_predict_layers beyond
checking the ratio list (the MTP layers are not part of the target's forward), expert_dtype (the loader
reads each tensor's format from its dtype and scales), output_router_logits, router_aux_loss_coef,
router_jitter_noise (training), and a DSpark-bearing checkpoint's dspark_* keys (`DSV4_DRAFT_STAGE_KEYS`: they
describe the draft stages, not the target).

Unknown keys are refused, unlike the llama / qwen3 reader (which reads the keys it knows and leaves the
rest): the DeepSeek-V4 layout is young and its variants add keys that change the computation (engram,
shared KV source layers, candidate blocks, vision), so a key this reader has not classified is more likely
a feature than noise.
"""


from __future__ import annotations

from typing import Any

from dspark.formats.dsv4_config import (
    FP8_BLOCK,
    SCORE_FUNCS,
    Dsv4Geometry,
    int_at_least,
    positive_number,
)
from dspark.formats.hf_config import ConfigFieldError

DSV4_MODEL_TYPE = "deepseek_v4"
DSV4_MODEL_TYPE = "deepseek_v4"
CSA_RATIO = 4  # DeepSeek's inference and vLLM give the overlap and the indexer to ratio-4 layers only
DEFAULT_HCA_RATIO = 128
LAYER_TYPE_SLIDING = "sliding_attention"
LAYER_TYPE_CSA = "compressed_sparse_attention"
LAYER_TYPE_HCA = "heavily_compressed_attention"
# transformers' DeepseekV4Config defaults for the keys read here that a config.json may leave out.
DSV4_DEFAULTS: dict[str, Any] = {
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "rms_norm_eps": 1e-6, "num_key_value_heads": 1,
    "n_shared_experts": 1, "num_nextn_predict_layers": 1, "n_routed_experts": 256, "num_experts_per_tok": 6,
    "num_hash_layers": 3, "routed_scaling_factor": 1.5, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "o_groups": 8, "o_lora_rank": 1024,
}
DSV4_IGNORED_KEYS = frozenset({
    "architectures", "torch_dtype", "dtype", "transformers_version", "bos_token_id", "eos_token_id",
    "pad_token_id", "use_cache", "initializer_range", "attention_dropout", "max_position_embeddings",
    "expert_dtype", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
})
# The DSpark stages a checkpoint may carry beside its target (mtp.* tensors, num_nextn_predict_layers of
# them): their keys describe the draft, not the target's computation, so the target reader accepts them and
# its weights reader leaves the mtp.* tensors out (`dsv4_dspark_config` reads the keys, a deployment whose
# draft is this checkpoint drafts with them).
DSV4_DRAFT_STAGE_KEYS = frozenset({
    "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank",
    "dspark_n_routed_experts", "dspark_num_experts_per_tok",
})
DSV4_READ_KEYS = frozenset({
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "q_lora_rank", "qk_rope_head_dim", "partial_rotary_factor",
    "sliding_window", "index_n_heads",
    "index_head_dim", "index_topk", "compress_ratios", "layer_types", "compress_rates", "compress_rate_csa",
    "compress_rate_hca", "num_nextn_predict_layers", "rope_theta", "compress_rope_theta", "rope_scaling",
    "rope_parameters", "rope_interleave", "rms_norm_eps", "n_routed_experts", "n_shared_experts",
    "moe_intermediate_size", "intermediate_size", "swiglu_limit", "hc_mult", "o_groups", "o_lora_rank",
    "quantization_config", "hidden_act", "tie_word_embeddings", "attention_bias", "mlp_bias",
    "num_experts_per_tok", "scoring_func", "topk_method", "routed_scaling_factor", "norm_topk_prob",
    "num_hash_layers", "mlp_layer_types", "n_group", "topk_group", "hc_sinkhorn_iters", "hc_eps",
    "first_k_dense_replace",
})




def dsv4_geometry(cfg: Any) -> Dsv4Geometry:
    """The `Dsv4Geometry` a DeepSeek-V4 config.json (parsed into a dict) describes.

    Raises `ConfigFieldError` naming the key for a value dspark's DSV4 reference does not implement, a
    missing required key, a value of the wrong type, or a key this reader does not know.
    """
    if not isinstance(cfg, dict):
        raise ConfigFieldError("config.json", f"is a {type(cfg).__name__}, not a JSON object",
                               "point at a Hugging Face config.json")
    model_type = cfg.get("model_type", DSV4_MODEL_TYPE)
    if model_type != DSV4_MODEL_TYPE:
        raise ConfigFieldError("model_type", f"is {model_type!r}, not {DSV4_MODEL_TYPE!r}",
                               "point at a DeepSeek-V4 checkpoint, or read it with its own family")
    unknown = sorted(set(cfg) - DSV4_READ_KEYS - DSV4_IGNORED_KEYS - DSV4_DRAFT_STAGE_KEYS)
    if unknown:
        raise ConfigFieldError(unknown[0], "is not a DeepSeek-V4 config key dspark knows, so it may change "
                               "the computation", "remove it if it does not, or use a checkpoint without it")
    layers = _int(cfg, "num_hidden_layers", 1)
    features = _features(cfg, layers)
    head_dim = _int(cfg, "head_dim", 1)
    csa, hca, ratios = _layer_ratios(cfg, layers)
    theta, compress_theta, yarn = _rope(cfg)
    values = {
        "vocab_size": _int(cfg, "vocab_size", 1),
        "dim": _int(cfg, "hidden_size", 1),
        "compress_ratios": ratios,
        "csa_ratio": csa,
        "hca_ratio": hca,
        "n_heads": _int(cfg, "num_attention_heads", 1),
        "head_dim": head_dim,
        "rope_dim": _rope_dim(cfg, head_dim),
        "q_lora_rank": _int(cfg, "q_lora_rank", 1),
        "window": _int(cfg, "sliding_window", 1),
        "index_n_heads": _int(cfg, "index_n_heads", 1),
        "index_head_dim": _int(cfg, "index_head_dim", 1),
        "index_topk": _int(cfg, "index_topk", 1),
        "norm_eps": _number(cfg, "rms_norm_eps"),
        "rope_theta": theta,
        "compress_rope_theta": compress_theta,
        **yarn,
        **features,
    }
    return Dsv4Geometry(**values)


def _features(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """The FFN, hyper-connection, output-projection and activation keys -> geometry fields, refusing what
    the reference does not implement. An absent key means transformers' default."""
    out: dict[str, Any] = {}
    fp8_block(cfg)  # refuses a quantisation the reader does not know
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigFieldError("hidden_act", f"is {act!r}; DeepSeek-V4's SwiGLU is silu",
                               "use a checkpoint whose hidden_act is silu")
    for key, wanted, why in (("tie_word_embeddings", False, "has separate embedding and LM head weights"),
                             ("attention_bias", False, "has no attention bias"),
                             ("mlp_bias", False, "has no MLP bias"),
                             ("rope_interleave", True, "rotates interleaved pairs"),
                             ("norm_topk_prob", True, "renormalises the chosen experts' weights")):
        value = cfg.get(key, wanted)
        if not isinstance(value, bool):
            raise ConfigFieldError(key, f"is {value!r}, not true or false", f"write {key}: true or false")
        if value != wanted:
            raise ConfigFieldError(key, f"is {str(value).lower()}; DeepSeek-V4 {why}",
                                   f"use a checkpoint with {key}: {str(wanted).lower()}")
    kv_heads = _int(cfg, "num_key_value_heads", 1)
    if kv_heads != 1:
        raise ConfigFieldError("num_key_value_heads", f"is {kv_heads}; DeepSeek-V4 shares one latent KV head",
                               "use a checkpoint with num_key_value_heads: 1")
    if cfg.get("first_k_dense_replace", 0) != 0:
        raise ConfigFieldError("first_k_dense_replace", f"is {cfg['first_k_dense_replace']!r}; every "
                               "DeepSeek-V4 layer has the MoE",
                               "use a checkpoint with first_k_dense_replace 0")
    limit = cfg.get("swiglu_limit")
    if limit is not None and not (positive_number(limit) or limit == 0):
        raise ConfigFieldError("swiglu_limit", f"is {limit!r}, not a number >= 0", "write a number or null")
    out["swiglu_limit"] = float(limit or 0.0)
    out.update(_moe(cfg, layers))
    if cfg.get("hc_mult", DSV4_DEFAULTS["hc_mult"]) is None:
        out["hc_mult"] = 0  # the reference's plain residual: only null turns the streams off
    else:
        out["hc_mult"] = _int(cfg, "hc_mult", 1)
        out["hc_sinkhorn_iters"] = _int(cfg, "hc_sinkhorn_iters", 1)
        out["hc_eps"] = _number(cfg, "hc_eps")
    groups = cfg.get("o_groups", DSV4_DEFAULTS["o_groups"])
    rank = cfg.get("o_lora_rank", DSV4_DEFAULTS["o_lora_rank"])
    if (groups is None) != (rank is None):
        raise ConfigFieldError("o_lora_rank" if groups is None else "o_groups",
                               "is set and the other is null",
                               "give both o_groups and o_lora_rank, or neither (one output projection)")
    if groups is not None:
        out["o_groups"], out["o_lora_rank"] = _int(cfg, "o_groups", 1), _int(cfg, "o_lora_rank", 1)
    return out


_FP8_KEYS = {"quant_method", "fmt", "scale_fmt", "weight_block_size", "activation_scheme", "expert_dtype"}


def fp8_block(cfg: dict[str, Any]) -> tuple[int, int]:
    """The FP8 linears' scale block (`quantization_config.weight_block_size`; 128 x 128 when the config has no
    quantization_config, as the release's). The release's layout only: e4m3 weights, float or ue8m0
    scales, dynamic activations, FP8 or FP4 experts; anything else is refused naming the key."""
    quant = cfg.get("quantization_config")
    if quant is None:
        return FP8_BLOCK
    if not isinstance(quant, dict):
        raise ConfigFieldError("quantization_config", f"is {quant!r}, not an object", "write it as an object")
    where = "quantization_config"
    checks = (("quant_method", ("fp8",)), ("fmt", ("e4m3", None)), ("scale_fmt", ("ue8m0", None)),
              ("activation_scheme", ("dynamic", None)), ("expert_dtype", ("fp4", "fp8", None)))
    for key, allowed in checks:
        if quant.get(key) not in allowed:
            raise ConfigFieldError(f"{where}.{key}", f"is {quant.get(key)!r}; dspark reads DeepSeek-V4's FP8 "
                                   f"layout ({key} one of {[a for a in allowed if a]})",
                                   "use the release's quantisation or an unquantised checkpoint")
    extra = sorted(set(quant) - _FP8_KEYS)
    if extra:
        raise ConfigFieldError(f"{where}.{extra[0]}", "is not a key of DeepSeek-V4's FP8 layout",
                               "remove it, or use an unquantised checkpoint")
    block = quant.get("weight_block_size", list(FP8_BLOCK))
    if not isinstance(block, list) or len(block) != 2 or not all(int_at_least(b, 1) for b in block):
        raise ConfigFieldError(f"{where}.weight_block_size", f"is {block!r}, not two positive integers",
                               "write it as [rows, columns], [128, 128] in the release")
    return (block[0], block[1])


def _moe(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """The routed experts' keys; n_routed_experts 0 or null is the dense stand-in (the shared expert's SwiGLU,
    n_shared_experts of them wide)."""
    experts = cfg.get("n_routed_experts", DSV4_DEFAULTS["n_routed_experts"])
    width = _ffn_width(cfg)
    if experts is None or experts == 0:
        return {"ffn": "dense", "inter_dim": _int(cfg, "n_shared_experts", 1) * width}
    shared = cfg.get("n_shared_experts", DSV4_DEFAULTS["n_shared_experts"])
    if shared != 1:
        raise ConfigFieldError("n_shared_experts", f"is {shared!r}; DeepSeek-V4 has one shared expert of "
                               "moe_intermediate_size (transformers builds exactly one)",
                               "use a checkpoint with n_shared_experts: 1")
    scoring = cfg.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORE_FUNCS:
        raise ConfigFieldError("scoring_func", f"is {scoring!r}, not one of {SCORE_FUNCS}",
                               "use a checkpoint with a scoring DeepSeek-V4 defines")
    method = cfg.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise ConfigFieldError("topk_method", f"is {method!r}; dspark routes by top-k of score + bias "
                               "(noaux_tc)", "use a checkpoint with topk_method noaux_tc or without it")
    groups, top_groups = cfg.get("n_group"), cfg.get("topk_group")
    if groups not in (None, 1) and top_groups != groups:
        raise ConfigFieldError("n_group", f"is {groups!r} with topk_group {top_groups!r}: group-limited "
                               "routing, which DeepSeek-V4 does not use", "remove n_group / topk_group")
    hashed = _hash_layers(cfg, layers)
    return {"ffn": "moe", "inter_dim": width, "n_routed_experts": _int(cfg, "n_routed_experts", 1),
            "n_activated_experts": _int(cfg, "num_experts_per_tok", 1), "n_hash_layers": hashed,
            "score_func": scoring, "route_scale": _number(cfg, "routed_scaling_factor")}


def _hash_layers(cfg: dict[str, Any], layers: int) -> int:
    """num_hash_layers (the release), or the leading hash_moe entries of mlp_layer_types (transformers 5)."""
    kinds = cfg.get("mlp_layer_types")
    if kinds is None:
        return min(_int(cfg, "num_hash_layers", 0), layers)
    if not isinstance(kinds, list) or len(kinds) < layers or any(k not in ("hash_moe", "moe") for k in kinds):
        raise ConfigFieldError("mlp_layer_types", f"is {kinds!r}, not one of hash_moe / moe per layer",
                               "write one entry per layer")
    hashed = kinds[:layers].count("hash_moe")
    if kinds[:hashed] != ["hash_moe"] * hashed:
        raise ConfigFieldError("mlp_layer_types", "has a hash_moe layer after a moe one; DeepSeek-V4 hashes "
                               "the first layers only", "put the hash_moe layers first")
    if "num_hash_layers" in cfg and _int(cfg, "num_hash_layers", 0) != hashed:
        raise ConfigFieldError("num_hash_layers", f"disagrees with mlp_layer_types ({hashed} hash layers)",
                               "remove one of them or make them agree")
    return hashed


def _layer_ratios(cfg: dict[str, Any], layers: int) -> tuple[int, int, tuple[int, ...]]:
    """(csa_ratio, hca_ratio, one ratio per layer) from compress_ratios (the released layout) or
    layer_types with compress_rates (transformers 5)."""
    rates = cfg.get("compress_rates")
    if rates is not None and not isinstance(rates, dict):
        raise ConfigFieldError("compress_rates", f"is {rates!r}, not an object",
                               f"write compress_rates as {{{LAYER_TYPE_CSA!r}: 4, {LAYER_TYPE_HCA!r}: 128}}")
    rates = rates or {}
    strange = sorted(set(rates) - {LAYER_TYPE_CSA, LAYER_TYPE_HCA})
    if strange:
        raise ConfigFieldError(f"compress_rates.{strange[0]}", "is not a DeepSeek-V4 attention type",
                               f"use only {LAYER_TYPE_CSA} and {LAYER_TYPE_HCA}")
    csa_key = "compress_rate_csa" if "compress_rate_csa" in cfg else f"compress_rates.{LAYER_TYPE_CSA}"
    csa = cfg.get("compress_rate_csa", rates.get(LAYER_TYPE_CSA, CSA_RATIO))
    if csa != CSA_RATIO or not int_at_least(csa, 0):
        raise ConfigFieldError(csa_key, f"is {csa!r}; DeepSeek's code gives the overlapping compressor and "
                               "the indexer to ratio-4 layers only",
                               f"use a checkpoint whose CSA ratio is {CSA_RATIO}")
    hca_key = "compress_rate_hca" if "compress_rate_hca" in cfg else f"compress_rates.{LAYER_TYPE_HCA}"
    hca_set = cfg.get("compress_rate_hca", rates.get(LAYER_TYPE_HCA))
    if hca_set is not None and (not int_at_least(hca_set, 2) or hca_set == CSA_RATIO):
        raise ConfigFieldError(hca_key, f"is {hca_set!r}, not an integer >= 2 other than {CSA_RATIO}",
                               "write the HCA ratio as such an integer (128 published)")
    mtp = _int(cfg, "num_nextn_predict_layers", 0)
    lengths = sorted({layers, layers + mtp})
    if "compress_ratios" in cfg or "layer_types" not in cfg:
        key = "compress_ratios"
        listed = _list(cfg, key, lengths, layers, mtp)
        for ratio in listed:
            if not int_at_least(ratio, 0) or ratio == 1:
                why = "vLLM reads 1 as no compressor, DeepSeek's code as one" if ratio == 1 else "not a ratio"
                raise ConfigFieldError(key, f"holds {ratio!r} ({why})",
                                       f"use 0 (window only), {CSA_RATIO} (CSA) or one HCA ratio >= 2")
        hca_seen = sorted({r for r in listed[:layers] if r not in (0, csa)})
        both = sorted({*hca_seen, *([hca_set] if hca_set is not None else [])}) if hca_seen else hca_seen
        if len(both) > 1:
            also = f" (with {hca_key})" if hca_set is not None else ""
            raise ConfigFieldError(key, f"holds{also} the HCA ratios {both}; dspark's DSV4 implements one",
                                   "use a checkpoint with a single HCA ratio")
        hca = hca_seen[0] if hca_seen else hca_set or DEFAULT_HCA_RATIO
        ratios = tuple(listed[:layers])
        if "layer_types" in cfg:
            kinds = _kinds(cfg, lengths, layers, mtp, csa, hca)
            if kinds != ratios:
                raise ConfigFieldError("layer_types", f"disagrees with compress_ratios ({list(ratios)})",
                                       "remove one of them or make them agree")
        return csa, hca, ratios
    hca = hca_set or DEFAULT_HCA_RATIO
    return csa, hca, _kinds(cfg, lengths, layers, mtp, csa, hca)


def _kinds(cfg: dict[str, Any], lengths: list[int], layers: int, mtp: int, csa: int,
           hca: int) -> tuple[int, ...]:
    ratio_of = {LAYER_TYPE_SLIDING: 0, LAYER_TYPE_CSA: csa, LAYER_TYPE_HCA: hca}
    listed = _list(cfg, "layer_types", lengths, layers, mtp)
    for kind in listed:
        if kind not in ratio_of:
            raise ConfigFieldError("layer_types", f"holds {kind!r}, not a DeepSeek-V4 attention type",
                                   f"use only {', '.join(ratio_of)}")
    return tuple(ratio_of[kind] for kind in listed[:layers])


def _list(cfg: dict[str, Any], key: str, lengths: list[int], layers: int, mtp: int) -> list[Any]:
    value = cfg.get(key)
    if value is None:
        raise ConfigFieldError(key, "is missing; dspark needs each layer's attention kind",
                               "write compress_ratios: one ratio per layer (0, 4 or the HCA ratio)")
    if not isinstance(value, list):
        raise ConfigFieldError(key, f"is {value!r}, not a list", f"write {key} as a JSON list, one per layer")
    if len(value) not in lengths:
        raise ConfigFieldError(key, f"has {len(value)} entries, not num_hidden_layers {layers}"
                               + (f" (+ num_nextn_predict_layers {mtp})" if mtp else ""),
                               "write one entry per layer (MTP layers last)")
    return value


def _rope(cfg: dict[str, Any]) -> tuple[float, float, dict[str, Any]]:
    """(rope_theta, compress_rope_theta, the compressed layers' YaRN fields) from rope_scaling (the
    release: YaRN on the compressed layers) or rope_parameters (transformers 5: `main` plain, `compress`
    with YaRN; a flat dict is the compressed layers' scaling)."""
    theta = _number(cfg, "rope_theta")
    compress = _number(cfg, "compress_rope_theta")
    yarn = _yarn(cfg, cfg.get("rope_scaling"), "rope_scaling")
    params = cfg.get("rope_parameters")
    if params is None:
        return theta, compress, yarn
    if not isinstance(params, dict):
        raise ConfigFieldError("rope_parameters", f"is {params!r}, not an object",
                               "write it as a JSON object")
    if set(params) & {"main", "compress"}:
        strange = sorted(set(params) - {"main", "compress"})
        if strange:
            raise ConfigFieldError(f"rope_parameters.{strange[0]}", "is not main or compress",
                                   "write rope_parameters as {main: {...}, compress: {...}}")
        main, sub = params.get("main"), params.get("compress")
        if _yarn(cfg, main, "rope_parameters.main"):
            raise ConfigFieldError("rope_parameters.main.rope_type", "is yarn; DeepSeek-V4 scales only the "
                                   "compressed layers' RoPE", "use rope_type default for main")
        if isinstance(main, dict) and "rope_theta" in main:
            theta = _number(main, "rope_theta", "rope_parameters.main.rope_theta")
        if isinstance(sub, dict) and "rope_theta" in sub:
            compress = _number(sub, "rope_theta", "rope_parameters.compress.rope_theta")
        nested = _yarn(cfg, sub, "rope_parameters.compress")
    else:
        if "rope_theta" in params and _number(params, "rope_theta", "rope_parameters.rope_theta") != theta:
            raise ConfigFieldError("rope_parameters.rope_theta",
                                   f"is {params['rope_theta']!r}, not rope_theta "
                                   f"{theta!r}; transformers would use the top-level one",
                                   "remove one of them or make them agree")
        nested = _yarn(cfg, params, "rope_parameters")
    if yarn and nested and yarn != nested:
        raise ConfigFieldError("rope_parameters", "disagrees with rope_scaling", "remove one of them")
    return theta, compress, yarn or nested


_DEFAULT_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_YARN_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor",
              "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "truncate",
              "mscale", "mscale_all_dim"}


def _yarn(cfg: dict[str, Any], params: Any, key: str) -> dict[str, Any]:
    """The YaRN fields a RoPE parameter dict gives ({} for plain RoPE), refusing other scalings and YaRN
    options that DeepSeek-V4 does not apply (an attention factor, untruncated ramps)."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ConfigFieldError(key, f"is {params!r}, not an object", f"write {key} as a JSON object")
    name = "rope_type" if "rope_type" in params else "type"
    rope_type = params.get(name, "default")
    if rope_type not in ("default", "yarn"):
        raise ConfigFieldError(f"{key}.{name}", f"is {rope_type!r}; DeepSeek-V4 uses plain RoPE or YaRN",
                               f"use a checkpoint with rope_type default or yarn in {key}")
    allowed = _YARN_KEYS if rope_type == "yarn" else _DEFAULT_ROPE_KEYS
    extra = sorted(set(params) - allowed)
    if extra:
        raise ConfigFieldError(f"{key}.{extra[0]}", f"is not a {rope_type} RoPE parameter",
                               f"remove it from {key}")
    if rope_type == "default":
        return {}
    if params.get("attention_factor", 1.0) != 1.0 or params.get("mscale", 1.0) != params.get("mscale_all_dim",
                                                                                             1.0):
        raise ConfigFieldError(f"{key}.attention_factor", "scales the attention; DeepSeek-V4's YaRN does not",
                               "remove attention_factor (and unequal mscale / mscale_all_dim)")
    if params.get("truncate", True) is not True:
        raise ConfigFieldError(f"{key}.truncate", "is not true; DeepSeek-V4 truncates YaRN's ramp",
                               "remove truncate")
    original = params.get("original_max_position_embeddings")
    if not int_at_least(original, 1):
        raise ConfigFieldError(f"{key}.original_max_position_embeddings",
                               f"is {original!r}, not an integer >= 1",
                               "give the context length the model was trained at")
    factor = params.get("factor")
    if factor is None:
        factor = _int(cfg, "max_position_embeddings", 1) / original
    if not positive_number(factor) or factor < 1:
        raise ConfigFieldError(f"{key}.factor", f"is {factor!r}, not a number >= 1", "write the YaRN factor")
    out = {"rope_factor": float(factor), "rope_original_max_position": original}
    for field, name in (("rope_beta_fast", "beta_fast"), ("rope_beta_slow", "beta_slow")):
        if params.get(name) is not None:  # absent or null: transformers' default (32, 1)
            out[field] = _number(params, name, f"{key}.{name}")
    return out


def _rope_dim(cfg: dict[str, Any], head_dim: int) -> int:
    """qk_rope_head_dim, or head_dim * partial_rotary_factor (transformers 5), which must agree."""
    sources = [cfg] + [p for p in _rope_dicts(cfg) if "partial_rotary_factor" in p]
    dims = set()
    for source in sources:
        factor = source.get("partial_rotary_factor")
        if factor is None:
            continue
        if not positive_number(factor) or factor > 1 or not float(head_dim * factor).is_integer():
            raise ConfigFieldError("partial_rotary_factor", f"is {factor!r}, not a fraction of head_dim "
                                   f"{head_dim} giving whole channels", "write qk_rope_head_dim instead")
        dims.add(int(head_dim * factor))
    if "qk_rope_head_dim" in cfg:
        dims.add(_int(cfg, "qk_rope_head_dim", 1))
    if len(dims) > 1:
        raise ConfigFieldError("qk_rope_head_dim", f"disagrees with partial_rotary_factor ({sorted(dims)})",
                               "write one of them")
    # transformers' default: 64 / 512 of head_dim, the published proportion
    return dims.pop() if dims else head_dim // 8


def _rope_dicts(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict):
        return []
    nested = [params.get(k) for k in ("main", "compress") if isinstance(params.get(k), dict)]
    return nested or [params]


def _ffn_width(cfg: dict[str, Any]) -> int:
    """moe_intermediate_size, or intermediate_size (transformers maps it onto moe_intermediate_size)."""
    if "moe_intermediate_size" in cfg and "intermediate_size" in cfg and \
            cfg["moe_intermediate_size"] != cfg["intermediate_size"]:
        raise ConfigFieldError("intermediate_size", f"is {cfg['intermediate_size']!r}, not "
                               f"moe_intermediate_size {cfg['moe_intermediate_size']!r}, and transformers "
                               "reads it as that key",
                               "remove intermediate_size")
    key = "moe_intermediate_size" if "moe_intermediate_size" in cfg or "intermediate_size" not in cfg \
        else "intermediate_size"
    return _int(cfg, key, 1)


def _int(cfg: dict[str, Any], key: str, minimum: int) -> int:
    value = cfg.get(key, DSV4_DEFAULTS.get(key))
    if key not in cfg and value is None:
        raise ConfigFieldError(key, "is missing; dspark's DSV4 needs it", f"add {key} to config.json")
    if not int_at_least(value, minimum):
        raise ConfigFieldError(key, f"is {value!r}, not an integer >= {minimum}",
                               f"write {key} as an integer >= {minimum}")
    return value


def _number(cfg: dict[str, Any], key: str, where: str | None = None) -> float:
    value = cfg.get(key, DSV4_DEFAULTS.get(key))
    if not positive_number(value):
        raise ConfigFieldError(where or key, f"is {value!r}, not a positive number",
                               f"write {where or key} as a positive number")
    return float(value)
