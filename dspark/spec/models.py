"""The deployment spec as pydantic models: the single source of truth for field names and docs.

Models are strict (no "7" → 7 coercion), frozen, and reject unknown keys, so a typo in a spec is an
error with a position instead of a silently ignored setting. Checks that need more than one section
live in `dspark.spec.rules`; cost-model and calibration tables in `dspark.spec.tables`.
"""

from __future__ import annotations

import keyword
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails

from dspark.backends import ATTENTION_BY_BACKEND, default_attention
from dspark.families import DENSE_FAMILIES, MODEL_FAMILIES, ModelFamily
from dspark.formats.dsv4_config import Dsv4Geometry, GeometryFieldError
from dspark.formats.fields import FieldValueError, IntTuple, Section, strictly_increasing
from dspark.formats.hf_config import RopeScaling
from dspark.modes import SpeculationOff, VerifyMode
from dspark.spec.tables import CalibrationSpec, CostModelSpec

NAME_PATTERN = r"^[a-z][a-z0-9_]{0,63}$"
DEVICES_BY_BACKEND: dict[str, tuple[str, ...]] = {
    "cpu": ("generic",),
    "cuda": ("h100", "h200", "a100", "b200", "l40s"),
    "ascend": ("910b", "910c"),
}


class RopeScalingSpec(Section):
    """RoPE scaling as transformers resolves config.json's `rope_parameters` / `rope_scaling`."""

    rope_type: Literal["linear", "dynamic", "llama3", "yarn"] = Field(
        description="linear: frequencies divided by factor; dynamic: dynamic NTK (exactly plain RoPE "
                    "up to max_position_embeddings, the longest context served); llama3: Llama 3.1's "
                    "banded interpolation; yarn: YaRN.")
    factor: float = Field(gt=0, description="Context extension factor.")
    original_max_position_embeddings: int | None = Field(
        default=None, ge=1,
        description="Pretraining context (llama3, yarn); dynamic: max_position_embeddings.")
    low_freq_factor: float | None = Field(default=None, gt=0, description="llama3 low-frequency factor.")
    high_freq_factor: float | None = Field(default=None, gt=0, description="llama3 high-frequency factor.")
    attention_factor: float | None = Field(default=None, gt=0, description="yarn cos/sin scale.")
    beta_fast: float | None = Field(default=None, gt=0, description="yarn ramp start (rotations).")
    beta_slow: float | None = Field(default=None, gt=0, description="yarn ramp end (rotations).")
    truncate: bool | None = Field(default=None, description="yarn: round the ramp's bounds outwards.")

    @model_validator(mode="after")
    def _complete(self) -> RopeScalingSpec:
        try:
            RopeScaling(**self.model_dump())
        except ValueError as exc:
            raise FieldValueError(str(exc), "give every parameter its rope_type needs") from None
        return self


class GeometrySpec(Section):
    """Shape of a dense target model (Hugging Face config.json names in parentheses)."""

    vocab_size: int = Field(ge=1, description="Vocabulary size (vocab_size).")
    hidden_size: int = Field(ge=1, description="Model width (hidden_size).")
    intermediate_size: int = Field(ge=1, description="MLP width (intermediate_size).")
    num_layers: int = Field(ge=1, description="Decoder layers (num_hidden_layers).")
    num_heads: int = Field(ge=1, description="Attention query heads (num_attention_heads).")
    num_kv_heads: int = Field(ge=1, description="Key/value heads (num_key_value_heads).")
    head_dim: int | None = Field(
        default=None, ge=1,
        description="Per-head width (head_dim); defaults to hidden_size / num_heads.")
    max_position_embeddings: int = Field(
        ge=1, description="Longest supported position (max_position_embeddings).")
    rope_theta: float = Field(gt=0, description="RoPE base frequency (rope_theta).")
    rms_norm_eps: float = Field(gt=0, description="RMSNorm epsilon (rms_norm_eps).")
    rope_scaling: RopeScalingSpec | None = Field(
        default=None, description="RoPE scaling (rope_parameters / rope_scaling with a rope_type "
                                  "other than default); none: plain RoPE at rope_theta.")
    tie_word_embeddings: bool = Field(
        default=False, description="The LM head is the embedding matrix (tie_word_embeddings).")
    attention_bias: bool = Field(
        default=False, description="q/k/v/o projections have a bias (attention_bias).")
    mlp_bias: bool = Field(default=False, description="MLP projections have a bias (mlp_bias; Llama only).")

    @model_validator(mode="before")
    @classmethod
    def _not_dsv4(cls, data: Any) -> Any:
        foreign = _foreign_keys(data, cls, Dsv4GeometrySpec)
        if foreign:
            raise FieldValueError(
                f"a DeepSeek-V4 geometry ({', '.join(foreign)}) for a dense model family",
                f"set model.family: {ModelFamily.DSV4}, or give the dense fields ({required_fields(cls)})")
        return data

    @field_validator("num_kv_heads")
    @classmethod
    def _kv_heads_divide_heads(cls, value: int, info: ValidationInfo) -> int:
        heads = info.data.get("num_heads")
        if heads is not None and heads % value:
            raise FieldValueError(f"num_heads ({heads}) is not a multiple of num_kv_heads ({value})",
                                 "grouped-query attention needs num_heads = k * num_kv_heads")
        return value

    @model_validator(mode="after")
    def _default_head_dim_exists(self) -> GeometrySpec:
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise FieldValueError(
                f"head_dim is not given and hidden_size ({self.hidden_size}) is not divisible by "
                f"num_heads ({self.num_heads})", "set head_dim explicitly")
        return self

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads


class Dsv4GeometrySpec(Section):
    """Shape of a DeepSeek-V4 target: `Dsv4Geometry`'s fields (the config.json key each is read from in
    parentheses), validated as `Dsv4Geometry` validates them."""

    vocab_size: int = Field(ge=1, description="Vocabulary size (vocab_size).")
    dim: int = Field(ge=1, description="Model width (hidden_size).")
    compress_ratios: IntTuple = Field(
        description="One ratio per decoder layer: 0 (sliding window only), csa_ratio (compressed sparse "
                    "attention, with the indexer) or hca_ratio (heavily compressed attention) "
                    "(compress_ratios: its first num_hidden_layers entries).")
    csa_ratio: int = Field(
        ge=1, description="Ratio of the compressed sparse attention layers "
                          "(compress_rates.compressed_sparse_attention; 4 in DeepSeek-V4).")
    hca_ratio: int = Field(
        ge=1, description="Ratio of the heavily compressed attention layers "
                          "(compress_rates.heavily_compressed_attention; 128 in DeepSeek-V4).")
    n_heads: int = Field(
        ge=1, description="Attention query heads, sharing one latent K=V head (num_attention_heads).")
    head_dim: int = Field(ge=1, description="Per-head width (head_dim).")
    rope_dim: int = Field(ge=1, description="Rotated channels of each head, even (qk_rope_head_dim).")
    q_lora_rank: int = Field(ge=1, description="Width of the low-rank query projection (q_lora_rank).")
    window: int = Field(
        ge=1, description="Positions of the sliding window every layer reads (sliding_window).")
    index_n_heads: int = Field(
        ge=1, description="Lightning-indexer heads of the CSA layers (index_n_heads).")
    index_head_dim: int = Field(ge=1, description="Lightning-indexer head width (index_head_dim).")
    index_topk: int = Field(
        ge=1, description="Compressed entries a row of a CSA layer reads, as the indexer picks them "
                          "(index_topk).")
    inter_dim: int = Field(
        ge=1, description="Width of each expert and of the shared expert, or of the dense SwiGLU "
                          "(moe_intermediate_size; dense: times n_shared_experts).")
    norm_eps: float = Field(gt=0, description="RMSNorm epsilon (rms_norm_eps).")
    rope_theta: float = Field(gt=0, description="RoPE base of the window-only layers (rope_theta).")
    compress_rope_theta: float = Field(
        gt=0, description="RoPE base of the compressed layers (compress_rope_theta).")
    rope_factor: float = Field(
        default=1.0, ge=1, description="YaRN factor of the compressed layers' RoPE, 1 for none "
                                       "(rope_scaling.factor).")
    rope_original_max_position: int = Field(
        default=0, ge=0, description="The context YaRN stretches from "
                                     "(rope_scaling.original_max_position_embeddings); required with "
                                     "rope_factor > 1.")
    rope_beta_fast: float = Field(default=32.0, gt=0,
                                  description="YaRN's beta_fast (rope_scaling.beta_fast).")
    rope_beta_slow: float = Field(default=1.0, gt=0, description="YaRN's beta_slow (rope_scaling.beta_slow).")
    ffn: Literal["moe", "dense"] = Field(
        description="The feed-forward: moe (routed experts and one shared expert, each inter_dim wide; "
                    "n_routed_experts > 0), or dense (one SwiGLU of inter_dim: a simplification of "
                    "DeepSeek-V4 for small tests only, "
                    "no checkpoint of the release has it).")
    n_routed_experts: int = Field(default=0, ge=0, description="Routed experts per layer (n_routed_experts).")
    n_activated_experts: int = Field(
        default=0, ge=0, description="Routed experts each token runs (num_experts_per_tok).")
    n_hash_layers: int = Field(
        default=0, ge=0, description="The first layers, which route by a fixed token -> experts table "
                                     "(num_hash_layers).")
    score_func: Literal["sqrtsoftplus", "sigmoid", "softmax"] = Field(
        default="sqrtsoftplus", description="Router scores (scoring_func).")
    route_scale: float = Field(default=1.0, ge=0, description="Routed output scale (routed_scaling_factor).")
    swiglu_limit: float = Field(
        default=0.0, ge=0, description="Clamp of every SwiGLU's gate and up projections, 0 for none "
                                       "(swiglu_limit).")
    hc_mult: int = Field(
        ge=0, description="Hyper-connection streams (hc_mult: 4 in DeepSeek-V4), or 0 for a plain "
                          "residual: a "
                          "simplification for small tests only.")
    hc_sinkhorn_iters: int = Field(default=20, ge=1, description="Sinkhorn iterations (hc_sinkhorn_iters).")
    hc_eps: float = Field(default=1e-6, gt=0, description="Hyper-connection epsilon (hc_eps).")
    o_groups: int = Field(
        ge=0, description="Head groups of the grouped low-rank output projection (o_groups: 8 in "
                          "V4-Flash), or 0 "
                          "for one output projection: a simplification for small tests only.")
    o_lora_rank: int = Field(default=0, ge=0,
                             description="Each group's rank (o_lora_rank); 0 without groups.")

    @model_validator(mode="before")
    @classmethod
    def _not_dense(cls, data: Any) -> Any:
        foreign = _foreign_keys(data, cls, GeometrySpec)
        if foreign:
            raise FieldValueError(
                f"a dense model's geometry ({', '.join(foreign)}) for model.family {ModelFamily.DSV4}",
                f"give DeepSeek-V4's fields ({required_fields(cls)}), or set model.family to a dense "
                f"family ({', '.join(DENSE_FAMILIES)})")
        return data

    @model_validator(mode="after")
    def _valid_geometry(self) -> Dsv4GeometrySpec:
        try:
            self.geometry()
        except GeometryFieldError as exc:
            raise _at_field(self, exc) from None
        return self

    def geometry(self) -> Dsv4Geometry:
        """The geometry the compiler and the runtime share."""
        return Dsv4Geometry(**self.model_dump())


# The geometry a resolved spec compiles: a dense section, or DeepSeek-V4's (the runtime's own class).
TargetGeometry = GeometrySpec | Dsv4Geometry
def _at_field(section: Dsv4GeometrySpec, exc: GeometryFieldError) -> ValidationError:
    """`Dsv4Geometry`'s refusal as an error of the field it concerns, so the spec loader points at the
    line that field is written on."""
    field = exc.field
    problem = exc.problem.removesuffix(f" (Dsv4Geometry.{field})")
    error = FieldValueError(f"{field} {problem}", exc.hint)
    return ValidationError.from_exception_data(type(section).__name__, [InitErrorDetails(
        type="value_error", loc=(field,), input=getattr(section, field), ctx={"error": error})])


def _foreign_keys(data: Any, own: type[Section], other: type[Section]) -> list[str]:
    """The keys of a geometry mapping that only `other` has, when it has none that only `own` has: a
    geometry written for the other kind of model, refused once instead of key by key."""
    if not isinstance(data, dict):
        return []
    own_only = set(own.model_fields) - set(other.model_fields)
    if own_only & set(data):
        return []
    return [key for key in data if key in set(other.model_fields) - set(own.model_fields)]


def required_fields(model: type[Section]) -> str:
    """The fields a section must be given, in order, for a hint."""
    return ", ".join(name for name, field in model.model_fields.items() if field.is_required())


class _TargetModelSection(Section):
    """The target model that verifies draft tokens; each kind of model (dense, DeepSeek-V4) narrows
    `family` and `geometry`."""

    family: str = Field(description="Model family.")
    checkpoint: str = Field(
        min_length=1,
        description="`embedded:<name>` for a checkpoint shipped with dspark, or a directory "
                    "holding a Hugging Face config.json (relative paths are resolved against "
                    "the spec file's directory).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="Weight and activation dtype.")
    geometry: GeometrySpec | Dsv4GeometrySpec | None = Field(default=None, description="Model shape.")
    load_format: Literal["auto", "dummy"] = Field(
        default="auto",
        description="auto: load the checkpoint's weights; dummy: seeded random weights of the "
                    "geometry, built on the device, for profiling and benchmarking a model size "
                    "whose weights are not on this machine (outputs are meaningless). The "
                    "checkpoint then names the model only: its config.json and tokenizer are read "
                    "when present.")


_GEOMETRY_SOURCE = ("Read from the checkpoint's config.json when it exists (an inline geometry must then "
                    "equal it); required when the checkpoint directory is not available at compile time.")


class ModelSpec(_TargetModelSection):
    """A dense target model (llama, qwen3)."""

    family: ModelFamily = Field(
        strict=False,  # the enum from its value, the only way YAML can say it
        json_schema_extra={"enum": list(MODEL_FAMILIES)},  # the registry's names, for editor completion
        description=f"Model family: {', '.join(DENSE_FAMILIES)} (dense) or {ModelFamily.DSV4} (DeepSeek-V4). "
                    "Selects "
                    "the model code, the geometry's fields and how the checkpoint's config.json is read; "
                    "it must match the config's model_type.")
    geometry: GeometrySpec | None = Field(default=None, description=f"Model shape. {_GEOMETRY_SOURCE}")

    @field_validator("family", mode="before")
    @classmethod
    def _known_family(cls, value: Any) -> Any:
        if value not in DENSE_FAMILIES:
            raise FieldValueError(f"model family {value!r} is not implemented",
                                 f"use one of: {', '.join(MODEL_FAMILIES)}")
        return value


class Dsv4ModelSpec(_TargetModelSection):
    """A DeepSeek-V4 target model: compressed sparse attention over a sliding window and compressed
    entries (docs/dsv4.md), routed experts, hyper-connections and the grouped output projection."""

    family: Literal[ModelFamily.DSV4] = Field(description="Model family: dsv4 (DeepSeek-V4).")
    geometry: Dsv4GeometrySpec | None = Field(
        default=None, description=f"Model shape: `Dsv4Geometry`'s fields. {_GEOMETRY_SOURCE}")


def _family_tag(value: Any) -> str | None:
    """The kind of target a model mapping describes, by its family: DeepSeek-V4 or dense (a family
    that is neither is refused by the dense section, which lists them all)."""
    if isinstance(value, dict):
        family = value.get("family")
    elif isinstance(value, _TargetModelSection):
        family = value.family
    else:
        return None  # a list or a scalar: no model at all
    return ModelFamily.DSV4.value if family == ModelFamily.DSV4 else "dense"


TargetModelSpec = Annotated[
    Annotated[ModelSpec, Tag("dense")] | Annotated[Dsv4ModelSpec, Tag(ModelFamily.DSV4.value)],
    Discriminator(_family_tag, custom_error_type="model_mapping",
                  custom_error_message="the model must be a mapping"),
]


class DraftSpec(Section):
    """The DSpark draft model (the published architecture: block drafting from the target's hidden
    states, Markov head, confidence head). Its architecture is read from the checkpoint's
    config.json; the fields below say it where the checkpoint is not on this machine or the draft
    is a dummy, and must match the config.json where they are given and it is present."""

    checkpoint: str = Field(
        min_length=1,
        description="`embedded:<name>` or a draft checkpoint directory (relative to the spec) in the "
                    "released DSpark layout (config.json + safetensors, as DeepSpec and `dspark "
                    "train-draft` write them), or a DeepSeek-V4 checkpoint that carries DSpark stages "
                    "(its `dspark_*` keys and `mtp.*` tensors; usually model.checkpoint itself).")
    architecture: Literal["dspark_block", "dsv4_stages"] | None = Field(
        default=None,
        description="dspark_block: a DSpark block draft (DeepSpec's layout); dsv4_stages: the DSpark stages "
                    "of a DeepSeek-V4 checkpoint (model.family dsv4). Read from the checkpoint; give it for "
                    "a dummy draft (default dspark_block).")
    gamma: int | None = Field(
        default=None, ge=1,
        description="Draft tokens proposed per request per step: at most block_size (default: block_size).")
    confidence_head: bool | None = Field(
        default=None,
        description="Whether the draft has a confidence head (needed by cap-accept and compact); "
                    "default: the checkpoint's `enable_confidence_head` (true where it is not read).")
    load_format: Literal["auto", "dummy"] = Field(
        default="auto",
        description="auto: load the draft checkpoint; dummy: seeded random weights of a draft with "
                    "the target's sizes and the settings below.")
    num_layers: int | None = Field(
        default=None, ge=1, description="Draft decoder layers (config.json `num_hidden_layers`, a V4 "
                                        "checkpoint's `num_nextn_predict_layers`; default 1).")
    block_size: int | None = Field(
        default=None, ge=1,
        description="Slots per draft block: the anchor plus block_size - 1 mask tokens (default 7).")
    mask_token_id: int | None = Field(
        default=None, ge=0,
        description="The block's mask token, inside the target's vocabulary (default: vocab_size - 1).")
    target_layer_ids: IntTuple | None = Field(
        default=None,
        description="Target decoder layers whose output hidden states the draft reads, increasing "
                    "(-1: the embeddings; never the final layer). Default: up to five spread over "
                    "the target, as the released drafts read [1, 9, 17, 25, 33] of 36 layers.")
    markov_rank: int | None = Field(
        default=None, ge=0, description="Rank of the Markov head, 0 for none (default 64).")
    markov_head_type: Literal["vanilla", "gated", "rnn"] | None = Field(
        default=None, description="Kind of Markov head (default vanilla when markov_rank > 0).")
    confidence_with_markov: bool | None = Field(
        default=None,
        description="Whether the confidence head also reads the previous token's Markov embedding "
                    "(default: true when the draft has both heads).")


class ParallelismSpec(Section):
    """How the deployment is split across devices."""

    tp: int = Field(default=1, ge=1, description="Tensor-parallel ranks.")
    dp: int = Field(default=1, ge=1, description="Data-parallel replicas (tp x dp processes), or with "
                                                 "dp_attention the attention's data-parallel groups.")
    ep: int = Field(default=1, ge=1, description="Expert-parallel ranks (1 for dense models).")
    dp_attention: bool = Field(
        default=False,
        description="Data-parallel attention, as in SGLang: the deployment runs as tp processes, attention "
                    "runs data-parallel over dp groups of tp / dp ranks (needs dp > 1 and tp a multiple of "
                    "dp), the other layers tensor-parallel over all tp.")


class BackendSpec(Section):
    """Where the deployment runs."""

    kind: Literal["cpu", "cuda", "ascend"] = Field(description="Backend family.")
    device: str = Field(
        description="Device model: cpu → generic; cuda → h100, h200, a100, b200, l40s; "
                    "ascend → 910b, 910c.")
    attention: str | None = Field(
        default=None,
        description="Attention implementation: cpu → torch; cuda → triton (the project's own kernel, the "
                    "default) or flashinfer (FlashInfer's paged prefill wrapper; needs flashinfer-python "
                    "where the deployment runs); ascend → fused_infer_attention (dense families) or "
                    "sparse_attn_sharedkv (dsv4). Left out: the backend's default for the model family.")

    @field_validator("device")
    @classmethod
    def _device_fits_kind(cls, value: str, info: ValidationInfo) -> str:
        kind = info.data.get("kind")
        allowed = DEVICES_BY_BACKEND.get(kind, ()) if isinstance(kind, str) else ()
        if kind is not None and value not in allowed:
            raise FieldValueError(f"device {value!r} is not a {kind} device",
                                 f"use one of: {', '.join(allowed)}")
        return value

    @field_validator("attention")
    @classmethod
    def _attention_fits_kind(cls, value: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("kind")
        allowed = ATTENTION_BY_BACKEND.get(kind, ()) if isinstance(kind, str) else ()
        if value is not None and kind is not None and value not in allowed:
            # which of the kind's implementations is the default depends on the model family
            raise FieldValueError(f"attention {value!r} does not run on the {kind} backend",
                                 f"leave backend.attention out for the {kind} backend's default, or use "
                                 f"one of: {', '.join(allowed)}")
        return value


class VerifySpec(Section):
    """How the target verifies draft tokens each step."""

    mode: VerifyMode = Field(
        default=VerifyMode.STATIC, strict=False,  # the enum from its value, the only way YAML can say it
        description="static: every request verifies N = gamma + 1 rows; cap-accept: the planner "
                    "caps acceptance but all rows run; compact: only planned rows run.")
    min_verify_len: int = Field(
        default=1, ge=0, description="Fewest rows a request verifies, root included.")
    max_verify_len: int = Field(
        default=0, ge=0, description="Most rows a request verifies, root included (0 = gamma + 1).")
    survival_eps: float = Field(
        default=1e-6, ge=0, lt=1,
        description="Survival values below this are treated as 0 and never planned.")
    align_to_graph_tier: bool = Field(
        default=False,
        description="Fill padding rows of the chosen graph tier with the next-best candidates.")
    lag_steps: int = Field(
        default=0, ge=0,
        description="Steps between the confidence the planner uses and the step it plans.")
    allow_no_cost_model: bool = Field(
        default=False,
        description="Allow compact mode without a cost model; the planner then verifies every "
                    "row (no budget), which only exercises the ragged layout.")
    off: SpeculationOff = Field(
        default=SpeculationOff.AUTO, strict=False,
        description="auto: the planner decodes without speculation while the cost table says a "
                    "target-only step pays more (needs the table's decode term, which dspark profile "
                    "measures; without it, or in static mode, every step speculates); never: every "
                    "step drafts and verifies.")
    off_margin: float = Field(
        default=0.05, ge=0, lt=1,
        description="Speculation is switched off (or on again) only when the other state is predicted "
                    "this share faster.")
    off_patience: int = Field(
        default=3, ge=1,
        description="... at this many consecutive decode steps (hysteresis).")
    probe_every: int = Field(
        default=16, ge=1,
        description="While speculation is off, one drafted step every this many steps refreshes the "
                    "confidence the decision reads.")


class GraphSpec(Section):
    """Graph capture (CUDA graphs / NPU graph mode) of the verify step."""

    enabled: bool = Field(
        default=False,
        description="Capture and replay verify-step graphs (tiers given while false are an error).")
    capture_batch_sizes: IntTuple = Field(
        default=(),
        description="Batch sizes to capture, at most serving.max_running_requests; the tiers are "
                    "batch size × N. Strictly increasing. Give this or token_tiers, not both.")
    token_tiers: IntTuple = Field(
        default=(),
        description="Explicit token-count tiers instead of capture_batch_sizes × N. Strictly "
                    "increasing. A step of M rows replays the smallest tier >= M: the largest tier "
                    "must hold the largest step, every tier must be used by some step, and static "
                    "and cap-accept tiers must be multiples of N.")

    @field_validator("capture_batch_sizes", "token_tiers")
    @classmethod
    def _increasing(cls, value: tuple[int, ...], info: ValidationInfo) -> tuple[int, ...]:
        return strictly_increasing(value, str(info.field_name))


class GenerationSpec(Section):
    """Default sampling parameters."""

    max_new_tokens: int = Field(default=128, ge=1, description="Tokens generated per request.")
    temperature: float = Field(default=0.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(default=0, ge=0, description="Top-k sampling (0 = off).")


class ServingSpec(Section):
    """Scheduler and KV-cache limits."""

    max_running_requests: int = Field(
        default=32, ge=1, description="Most requests decoded together (the largest B).")
    max_total_tokens: int = Field(
        default=65536, ge=1,
        description="KV-cache capacity in tokens; must hold at least one max_context_len request.")
    page_size: int = Field(default=16, ge=1, description="Tokens per KV-cache page.")
    chunked_prefill_tokens: int = Field(
        default=2048, ge=1,
        description="Most prompt tokens prefilled in one step (summed over requests); longer "
                    "prompts are prefilled over several steps, between decode steps of the "
                    "running batch.")
    max_context_len: int = Field(
        default=1024, ge=1,
        description="Longest request: prompt + max_new_tokens + N (the KV slots a request reserves); "
                    "a multiple of page_size and at most the model's max_position_embeddings.")
    generation: GenerationSpec = Field(
        default_factory=GenerationSpec, description="Default sampling parameters.")
    record_steps: int = Field(
        default=0, ge=0,
        description="Decode steps kept in the measurement ring (per-step budget, rows, tier, "
                    "predicted tau and step time, committed tokens) plus calibration shards; "
                    "0 = off. `dspark run --record DIR` turns it on for one run.")

    @field_validator("max_context_len")
    @classmethod
    def _whole_pages(cls, value: int, info: ValidationInfo) -> int:
        page = info.data.get("page_size")
        if page and value % page:
            lower, upper = value // page * page, (value // page + 1) * page
            raise FieldValueError(
                f"{value} is not a multiple of page_size ({page})",
                f"use {upper}" + (f" or {lower}" if lower else ""))
        return value


_Windowed = TypeVar("_Windowed", bound=Section)


def _inside_window(section: _Windowed, name: str) -> _Windowed:
    """`section.name` must be at most `section.window`. Checked after the model, not on the field: a value
    left at its default must fit a small window too, and the error then names the field the spec did write."""
    value, window = getattr(section, name), section.window  # type: ignore[attr-defined]
    if value <= window:
        return section
    if name in section.model_fields_set:
        field, error = name, FieldValueError(f"{value} is more than window ({window})",
                                             f"use at most {window}")
    else:
        field, error = "window", FieldValueError(
            f"{window} is less than {name} ({value})",
            f"use at least {value}, or set {name} to at most {window}")
    raise ValidationError.from_exception_data(type(section).__name__, [InitErrorDetails(
        type="value_error", loc=(field,), input=getattr(section, field), ctx={"error": error})])


class OnlineCalibrationSpec(Section):
    """Refit the planner's STS temperatures from the served steps' own verified drafts, off the step path,
    swapped in between steps (docs/planner.md, "Online calibration"). `dspark serve --online-calibration` /
    `--no-online-calibration` override `enabled`."""

    enabled: bool = Field(default=True, description="Refit while serving (writing the section turns it on).")
    window: int = Field(
        default=65536, ge=1,
        description="Labelled request-steps kept for the refit: the survival map is fitted on all of them, "
                    "the temperatures on the newest 4096.")
    refit_every: int = Field(
        default=128, ge=1,
        description="New labelled request-steps between drift checks; refits at the first, on drift, and at "
                    "intervals doubling up to a quarter of window (at most 1024) between drifts.")
    min_known: int = Field(
        default=200, ge=1,
        description="Known labels a draft position needs before its temperature is refitted.")
    drift_window: int = Field(
        default=384, ge=1, description="The most recent request-steps drift is scored on (at most window).")
    drift_ece: float = Field(
        default=0.03, gt=0, lt=1,
        description="How far their cumulative ECE must exceed what calibrated labels of the same scores "
                    "measure (99th percentile) to count as drift.")
    shift_z: float = Field(
        default=4.5, gt=0,
        description="How many standard errors the traffic may move before it counts as shifted: the newest "
                    "32 prompts' surprise to the target against the prompts' before them (see prompt_probe), "
                    "and the recent steps' mean confidence logit against the other requests' in the window "
                    "(clustered by request).")
    prompt_probe: int = Field(
        default=64, ge=0,
        description="A prompt's last tokens whose negative log-likelihood under the target the prefill "
                    "scores, for the traffic check (that many rows of logits a prompt); 0: prompts are not "
                    "scored.")
    exploration: float = Field(
        default=0.0, ge=0, lt=1,
        description="Share of decode steps (compact) that verify every draft whatever the planner chose, so "
                    "low scores get labels too; each such step runs the full N rows a request.")
    map_bins: int = Field(
        default=10, ge=0,
        description="Quantile groups of the monotone survival map (isotonic) refitted after the "
                    "temperatures, each cut again at multiples of 1/15 where 200 rows a side remain; 0: the "
                    "temperatures alone.")

    @model_validator(mode="after")
    def _drift_window_inside_window(self) -> OnlineCalibrationSpec:
        return _inside_window(self, "drift_window")


class OnlineCostSpec(Section):
    """Refit the additive cost table's knots from the served decode steps' measured seconds and swap the
    refitted table in between steps (docs/planner.md, "Online cost refit"); needs an additive cost_model.
    `dspark serve --online-cost` / `--no-online-cost` override `enabled`."""

    enabled: bool = Field(default=True, description="Refit while serving (writing the section turns it on).")
    window: int = Field(
        default=512, ge=1, description="Decode steps (drafted and without speculation) the refit reads.")
    refit_every: int = Field(
        default=64, ge=1, description="New decode steps between refits (at most window).")
    ridge: float = Field(
        default=4.0, gt=0,
        description="Pseudo-steps at the table's own price that pull each knot's correction towards zero: a "
                    "knot the traffic never visits keeps the table's value.")
    outlier_mads: float = Field(
        default=3.5, gt=0,
        description="A step further than this many robust deviations from the first fit is left out of it.")

    @model_validator(mode="after")
    def _refits_inside_window(self) -> OnlineCostSpec:
        return _inside_window(self, "refit_every")


class DeploymentSpec(Section):
    """A DSpark adaptive-verify speculative decoding deployment."""

    name: str = Field(
        description="Deployment name; becomes the generated package name "
                    "(lowercase identifier, not a Python keyword).")
    model: TargetModelSpec = Field(description="The target model.")
    draft: DraftSpec = Field(description="The draft model.")
    parallelism: ParallelismSpec = Field(
        default_factory=ParallelismSpec, description="Device parallelism.")
    backend: BackendSpec = Field(description="Backend and device.")
    verify: VerifySpec = Field(default_factory=VerifySpec, description="Verification mode.")
    graph: GraphSpec = Field(default_factory=GraphSpec, description="Graph capture.")
    cost_model: CostModelSpec | None = Field(
        default=None,
        description="Step cost model for the planner budget: {type: sps-1d|additive, file: PATH} "
                    "or the table inline.")
    calibration: CalibrationSpec | None = Field(
        default=None,
        description="STS temperatures: {temperatures: [...]} or {file: PATH}.")
    online_calibration: OnlineCalibrationSpec | None = Field(
        default=None,
        description="Refit the STS temperatures while serving (cap-accept and compact with a confidence "
                    "head); left out: the compiled temperatures stay.")
    online_cost: OnlineCostSpec | None = Field(
        default=None,
        description="Refit the additive cost table's knots from the served steps' measured seconds "
                    "(cap-accept and compact with an additive cost_model); left out: the compiled table "
                    "stays.")
    serving: ServingSpec = Field(default_factory=ServingSpec, description="Serving limits.")

    @field_validator("name")
    @classmethod
    def _package_name(cls, value: str) -> str:
        if not re.fullmatch(NAME_PATTERN, value):
            raise FieldValueError(
                f"{value!r} is not a valid deployment name",
                "use a lowercase identifier: a letter, then letters, digits or '_' "
                "(at most 64 characters), e.g. llama31_8b_h200")
        if keyword.iskeyword(value) or keyword.issoftkeyword(value):
            raise FieldValueError(f"{value!r} is a Python keyword and cannot name a package",
                                 f"use e.g. {value}_deploy")
        return value

    @property
    def attention_impl(self) -> str:
        """The attention implementation the deployment runs: backend.attention, or the backend's default
        for the model family."""
        return self.backend.attention or default_attention(self.backend.kind, self.model.family)
