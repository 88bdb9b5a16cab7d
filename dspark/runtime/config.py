"""Plain, torch-free value objects that a generated package fills in to describe its deployment.

The compiler writes these constructors as literals into `generated/<name>/deployment.py`; the
runtime reads them. They validate themselves so that a hand-edited generated file fails loudly
at import time instead of deep inside a decode step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from dspark.backends import ATTENTION_BY_BACKEND
from dspark.families import MODEL_FAMILIES, ModelFamily
from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.formats.hf_config import (
    HF_DEFAULTS,
    RopeScaling,
    config_json,
    geometry_values,
)
from dspark.modes import BLOCK_DRAFT, DRAFT_ARCHITECTURES, VerifyMode, num_draft_tokens

LOAD_FORMATS = ("auto", "dummy")


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"invalid deployment config: {what}")


@dataclass(frozen=True)
class ModelGeometry:
    """A dense target model's config (Llama and Qwen3 alike), as resolved from the spec and the
    checkpoint's config.json (`dspark.formats.hf_config` reads it)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = HF_DEFAULTS["rope_theta"]
    # dspark's own models' epsilon (the embedded tiny target was trained with it); a config.json
    # without the key reads as transformers' 1e-6 (`hf_config.HF_DEFAULTS`)
    rms_norm_eps: float = 1e-5
    # None: plain RoPE at rope_theta; generated code writes the fields as a dict literal
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False  # the LM head is the embedding matrix
    attention_bias: bool = False  # q/k/v/o projections carry a bias
    mlp_bias: bool = False  # gate/up/down projections carry a bias (Llama only)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], family: str = "llama") -> ModelGeometry:
        values = geometry_values(cfg, family)
        scaling = values.pop("rope_scaling")
        return cls(**values, rope_scaling=RopeScaling(**scaling) if scaling else None)

    def to_hf(self, family: str = "llama") -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["rope_scaling"] = self.rope_scaling.to_json() if self.rope_scaling else None
        return config_json(values, family)

    def __post_init__(self) -> None:
        _require(self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads")
        _require(min(self.vocab_size, self.hidden_size, self.num_layers, self.head_dim) > 0,
                 "geometry sizes must be positive")
        _require(self.head_dim % 2 == 0, "head_dim must be even (RoPE rotates pairs)")
        if isinstance(self.rope_scaling, dict):
            try:
                object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
            except (TypeError, ValueError) as exc:
                _require(False, f"rope_scaling: {exc}")
        _require(self.rope_scaling is None or isinstance(self.rope_scaling, RopeScaling),
                 "rope_scaling must be a RopeScaling or a dict of its fields")


@dataclass(frozen=True)
class ModelRef:
    family: ModelFamily  # written by its value, read into the family here
    checkpoint: str
    dtype: str
    geometry: ModelGeometry | Dsv4Geometry  # Dsv4Geometry exactly for the dsv4 family
    digest: str = ""  # content hash of the checkpoint's config and weights at compile time ("": absent)
    load_format: str = "auto"  # "dummy": seeded random weights of the geometry, no checkpoint read

    def __post_init__(self) -> None:
        _require(self.load_format in LOAD_FORMATS, f"model load_format must be one of {LOAD_FORMATS}")
        _require(self.family in MODEL_FAMILIES,
                 f"model family {self.family!r} is not one of {MODEL_FAMILIES}")
        object.__setattr__(self, "family", ModelFamily(self.family))
        expected = ModelGeometry if self.family.dense else Dsv4Geometry
        _require(isinstance(self.geometry, expected),
                 f"the {self.family} family's geometry is a {expected.__name__}, got "
                 f"{type(self.geometry).__name__}")


@dataclass(frozen=True)
class DraftRef:
    """The DSpark draft (the published architecture): its checkpoint, the drafts per step, and its
    architecture as its config.json says (written here at compile time, so the runtime checks the
    checkpoint it loads against what was compiled; a dummy draft's come from the spec)."""

    checkpoint: str
    gamma: int  # drafts per step: 1 .. block_size
    confidence_head: bool
    digest: str = ""  # content hash of the checkpoint's config and weights at compile time ("": absent)
    load_format: str = "auto"  # "dummy": seeded random weights of these settings, the target's sizes
    num_layers: int = 1
    block_size: int = 7  # slots per block: the anchor plus block_size - 1 mask tokens
    mask_token_id: int = 0
    target_layer_ids: tuple[int, ...] = (0,)  # target layers whose outputs the draft reads (-1: embeddings)
    markov_rank: int = 0
    markov_head_type: str | None = None  # vanilla, gated or rnn when markov_rank > 0
    confidence_with_markov: bool = False
    # a DSpark block draft, or the DSpark stages of a DeepSeek-V4 checkpoint (`dspark.modes`)
    architecture: str = BLOCK_DRAFT

    def __post_init__(self) -> None:
        _require(self.load_format in LOAD_FORMATS, f"draft load_format must be one of {LOAD_FORMATS}")
        _require(self.architecture in DRAFT_ARCHITECTURES,
                 f"draft architecture must be one of {DRAFT_ARCHITECTURES}")
        _require(self.num_layers >= 1, "a draft has at least one layer")
        _require(1 <= self.gamma <= self.block_size,
                 f"draft gamma {self.gamma} must be within 1..block_size {self.block_size}")
        _require(bool(self.target_layer_ids) and min(self.target_layer_ids) >= -1,
                 f"draft target_layer_ids {self.target_layer_ids!r} must be non-empty ids >= -1")
        _require((self.markov_rank == 0) == (self.markov_head_type is None),
                 "draft markov_head_type is set exactly when markov_rank > 0")
        _require(not self.confidence_with_markov or (self.confidence_head and self.markov_rank > 0),
                 "confidence_with_markov needs a confidence head and a Markov head")

    @property
    def num_draft_tokens(self) -> int:
        return num_draft_tokens(self.gamma)

    @property
    def layers_before_capture(self) -> tuple[int, ...]:
        """The target states the draft reads, as decoder-layer counts (0: the embeddings)."""
        return tuple(i + 1 for i in self.target_layer_ids)


@dataclass(frozen=True)
class ParallelPlan:
    tp: int
    dp: int
    dp_attention: bool
    ep: int

    @property
    def world_size(self) -> int:
        """Processes the deployment runs as: tp x dp replicas, or, with DP attention, tp (SGLang's meaning:
        attention runs data-parallel over dp groups of tp / dp ranks inside the tp ranks)."""
        return self.tp if self.dp_attention else self.tp * self.dp

    @property
    def attention_tp(self) -> int:
        """Ranks one request's attention heads are split over: tp, or tp / dp under DP attention."""
        return self.tp // self.dp if self.dp_attention else self.tp


@dataclass(frozen=True)
class ServingConfig:
    max_running_requests: int
    max_total_tokens: int
    page_size: int
    max_context_len: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    chunked_prefill_tokens: int = 2048  # prompt tokens prefilled per step, over all requests
    record_steps: int = 0  # measurement ring size; 0 = off

    def __post_init__(self) -> None:
        _require(self.max_context_len % self.page_size == 0,
                 "max_context_len must be a multiple of page_size")

    @property
    def pages_per_request(self) -> int:
        return self.max_context_len // self.page_size

    @property
    def num_pages(self) -> int:
        """The KV pool's pages, the null page included."""
        return self.max_total_tokens // self.page_size + 1


@dataclass(frozen=True)
class OnlineCalibrationSettings:
    """How the runtime refits the planner's temperatures from its own traffic
    (`dspark.runtime.planner.online_calibration`; the spec's `online_calibration` section)."""

    window: int = 65536  # labelled request-steps kept (the map's; the temperatures take the newest 4096)
    refit_every: int = 128  # new labelled request-steps between drift checks (refits: from it to 1024)
    min_known: int = 200  # known labels a position needs before its temperature is refitted
    drift_window: int = 384  # the most recent request-steps drift is scored on
    drift_ece: float = 0.03  # how far their cumulative ECE must exceed calibrated labels' noise (99th pct.)
    shift_z: float = 4.5  # standard errors the traffic checks allow (confidence logits; prompts' surprise)
    prompt_probe: int = 64  # a prompt's last tokens whose surprise to the target the prefill scores (0: none)
    exploration: float = 0.0  # share of decode steps that verify every draft (labels for low scores)
    map_bins: int = 10  # groups of the monotone survival map fitted after the temperatures (0: none)
    num_bins: int = 15  # as `dspark calibrate` scores
    grid_points: int = 41  # its grid: log-spaced t_min .. t_max
    t_min: float = 0.1
    t_max: float = 10.0

    def __post_init__(self) -> None:
        for name in ("window", "refit_every", "min_known", "drift_window", "num_bins", "grid_points"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"online calibration {name} must be a positive integer, got {value!r}")
        for name, zero in (("map_bins", "temperatures alone"), ("prompt_probe", "prompts not scored")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"online calibration {name} must be 0 ({zero}) or a positive integer, got "
                                 f"{value!r}")
        if self.drift_window > self.window:
            raise ValueError(f"online calibration drift_window {self.drift_window} exceeds window "
                             f"{self.window}")
        if not (math.isfinite(self.exploration) and 0 <= self.exploration < 1):
            raise ValueError(f"online calibration exploration must be in [0, 1), got {self.exploration!r}")
        if not (math.isfinite(self.drift_ece) and 0 < self.drift_ece < 1):
            raise ValueError(f"online calibration drift_ece must be in (0, 1), got {self.drift_ece!r}")
        if not (math.isfinite(self.shift_z) and self.shift_z > 0):
            raise ValueError(f"online calibration shift_z must be a positive number, got {self.shift_z!r}")
        _require(math.isfinite(self.t_min) and math.isfinite(self.t_max) and 0 < self.t_min <= self.t_max,
                 f"online calibration needs 0 < t_min <= t_max, got {self.t_min}, {self.t_max}")


@dataclass(frozen=True)
class OnlineCostSettings:
    """How the runtime refits its additive cost table's knots from its own steps' measured seconds
    (`dspark.runtime.planner.online_cost`; the spec's `online_cost` section)."""

    window: int = 512  # decode steps (drafted and without speculation) the refit reads
    refit_every: int = 64  # new steps between refits
    # Each knot's correction is pulled towards zero as if this many steps there had measured the table's own
    # price: a knot the traffic never visits keeps the table's value, one visited by hundreds follows them.
    ridge: float = 4.0
    outlier_mads: float = 3.5  # a step this many robust deviations off the first fit is left out of the refit

    def __post_init__(self) -> None:
        for name in ("window", "refit_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"online cost {name} must be a positive integer, got {value!r}")
        if self.refit_every > self.window:
            raise ValueError(f"online cost refit_every {self.refit_every} exceeds window {self.window}")
        for name in ("ridge", "outlier_mads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value > 0):
                raise ValueError(f"online cost {name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class DeploymentConfig:
    """Everything the runtime needs to know about one compiled deployment."""

    name: str
    spec_path: str
    spec_sha256: str
    compiler_version: str
    backend: str
    device: str
    attention: str  # backend.attention: torch (cpu), triton or flashinfer (cuda), fused_infer_attention
    verify_mode: VerifyMode
    model: ModelRef
    draft: DraftRef
    parallel: ParallelPlan
    serving: ServingConfig
    token_tiers: tuple[int, ...] = ()  # rows a verify step is padded to; () without graph capture
    online_calibration: OnlineCalibrationSettings | None = None  # None: the compiled temperatures stay
    online_cost: OnlineCostSettings | None = None  # None: the compiled cost table stays

    def __post_init__(self) -> None:
        _require(self.backend in ("cpu", "cuda", "ascend"), f"unknown backend {self.backend!r}")
        _require(self.attention in ATTENTION_BY_BACKEND[self.backend],
                 f"attention {self.attention!r} does not run on the {self.backend} backend")
        _require(isinstance(self.verify_mode, VerifyMode), f"verify_mode must be a VerifyMode, got "
                 f"{self.verify_mode!r}")
        _require(self.model.geometry.num_heads % self.parallel.attention_tp == 0,
                 "the attention's tensor parallelism (tp, or tp / dp with DP attention) must divide "
                 "num_heads")
        tiers = list(self.token_tiers)
        _require(tiers == sorted(set(tiers)) and all(t > 0 for t in tiers),
                 f"token_tiers must be strictly increasing positive row counts, got {self.token_tiers}")
