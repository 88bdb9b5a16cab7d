"""DeepSeek-V4's (DSV4) geometry: `Dsv4Geometry`, the compiler's geometry and the model's config in one
(`dspark.runtime.families.dsv4.model.DSV4Model` takes it), its RoPE (`Rope`) and the paged cache layout the
compiler sizes (`Dsv4CacheLayout`). A field's value the reference does not implement is refused with a
`GeometryFieldError` naming the field and the config.json key it is read from (`DSV4_GEOMETRY_KEYS`).
Reading a config.json into a geometry is `dsv4_hf_config`'s. Torch-free: the compiler imports it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, fields

from dspark.formats.hf_config import ConfigFieldError, yarn_ramp

# The config.json key each geometry field is read from: the key an error about the field names.
DSV4_GEOMETRY_KEYS = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "compress_ratios": "compress_ratios",
    "csa_ratio": "compress_rates.compressed_sparse_attention",
    "hca_ratio": "compress_rates.heavily_compressed_attention",
    "n_heads": "num_attention_heads",
    "head_dim": "head_dim",
    "rope_dim": "qk_rope_head_dim",
    "q_lora_rank": "q_lora_rank",
    "window": "sliding_window",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "inter_dim": "moe_intermediate_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta",
    "rope_factor": "rope_scaling.factor",
    "rope_original_max_position": "rope_scaling.original_max_position_embeddings",
    "rope_beta_fast": "rope_scaling.beta_fast",
    "rope_beta_slow": "rope_scaling.beta_slow",
    "ffn": "n_routed_experts",
    "n_routed_experts": "n_routed_experts",
    "n_activated_experts": "num_experts_per_tok",
    "n_hash_layers": "num_hash_layers",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "swiglu_limit": "swiglu_limit",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "index_quant": "index_quant (the backend's, not config.json's)",
}
# Fields the runtime sets for a backend; the spec and config.json do not carry them.
DSV4_RUNTIME_FIELDS = ("index_quant",)
SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")  # the MoE's (dspark.runtime.families.dsv4.moe)
FP8_BLOCK = (128, 128)  # the release's FP8 scale block, rows x columns


@dataclass(frozen=True)
class Rope:
    """RoPE of a layer: interleaved pairs of the trailing `dim` channels at base `theta`; with `yarn_factor`
    above 1 the frequencies YaRN stretches for contexts past `yarn_original_max` positions (DeepSeek-V4's
    compressed layers), without YaRN's attention scaling (V4 applies none)."""

    theta: float
    dim: int
    yarn_factor: float = 1.0
    yarn_original_max: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0

    def frequencies(self) -> list[float]:
        """One angle per position step for each rotated pair, in double precision."""
        half = self.dim // 2
        if self.yarn_factor == 1.0:
            return [self.theta ** (-2.0 * i / self.dim) for i in range(half)]
        low, high = yarn_ramp(self.dim, self.theta, self.yarn_original_max, self.yarn_beta_fast,
                              self.yarn_beta_slow)
        span = high - low
        out = []
        for i in range(half):
            base = self.theta ** (-2.0 * i / self.dim)
            keep = 1.0 - min(max((i - low) / span, 0.0), 1.0)
            out.append(base / self.yarn_factor * (1.0 - keep) + base * keep)
        return out


class GeometryFieldError(ConfigFieldError):
    """A `Dsv4Geometry` field's value refused: named by the config.json key it is read from, and `field`."""

    def __init__(self, field: str, problem: str, hint: str) -> None:
        super().__init__(DSV4_GEOMETRY_KEYS[field], f"{problem} (Dsv4Geometry.{field})", hint)
        self.field = field


@dataclass(frozen=True)
class Dsv4Geometry:
    """A DeepSeek-V4 model as dspark computes it: the compiler's geometry and the model's config
    (`dspark.runtime.families.dsv4.model.DSV4Model` takes it), validated here, errors naming the config.json
    key each field is read from (`DSV4_GEOMETRY_KEYS`). Torch-free."""

    # The defaults are a tiny test geometry; the comments give DeepSeek-V4-Flash's values.
    vocab_size: int = 256
    dim: int = 64  # hidden size (4096)
    compress_ratios: tuple[int, ...] = (0, 4, 128, 4)  # per layer: 0 (window only), csa_ratio or hca_ratio
    csa_ratio: int = 4  # C4: overlapping compressor + indexer top-k
    hca_ratio: int = 128  # C128: compressor, every closed entry read
    n_heads: int = 4  # (64)
    head_dim: int = 32  # the one latent KV head, K = V (512)
    rope_dim: int = 8  # trailing channels RoPE rotates (64)
    q_lora_rank: int = 32  # (1024)
    window: int = 16  # raw positions a row reads, itself included (128)
    index_n_heads: int = 2  # (64)
    index_head_dim: int = 16  # (128)
    index_topk: int = 4  # compressed entries a C4 row reads (512)
    inter_dim: int = 128  # width of each expert and the shared expert, or of the dense SwiGLU (2048)
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # window-only layers
    compress_rope_theta: float = 160000.0  # layers with a compressor
    # YaRN on the compressed layers; factor 1: none
    rope_factor: float = 1.0
    rope_original_max_position: int = 0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    # "moe", or "dense": one SwiGLU of inter_dim for the FFN, a simplification a spec must ask for
    ffn: str = "dense"
    n_routed_experts: int = 0
    n_activated_experts: int = 0
    n_hash_layers: int = 0
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.0
    swiglu_limit: float = 0.0  # 0: no clamp
    hc_mult: int = 0  # 0: a plain residual, a simplification a spec must ask for
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    o_groups: int = 0  # 0: one output projection, a simplification a spec must ask for
    o_lora_rank: int = 0
    # Not a config.json key and not a spec field: how the deployment's backend scores the lightning
    # indexer. True on Ascend, whose quantised indexer takes int8 queries and keys with float16 scales
    # (`ops.quantize_int8`); the runtime sets it (`for_backend`), and a CPU reference with it computes
    # what the Ascend layers compute.
    index_quant: bool = False

    def __post_init__(self) -> None:
        def fail(name: str, problem: str, hint: str) -> None:
            raise GeometryFieldError(name, problem, hint)

        zero_ok = ("rope_original_max_position", "n_routed_experts", "n_activated_experts", "n_hash_layers",
                   "hc_mult", "o_groups", "o_lora_rank")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("norm_eps", "rope_theta", "compress_rope_theta", "rope_factor", "rope_beta_fast",
                          "rope_beta_slow", "hc_eps"):
                if not positive_number(value):
                    fail(f.name, f"is {value!r}, not a positive number", "write it as a positive number")
            elif f.name in ("route_scale", "swiglu_limit"):
                if not (positive_number(value) or value == 0) or isinstance(value, bool):
                    fail(f.name, f"is {value!r}, not a number >= 0", "write it as a number >= 0")
            elif f.name in zero_ok:
                if not int_at_least(value, 0):
                    fail(f.name, f"is {value!r}, not an integer >= 0", "write it as an integer >= 0")
            elif f.name == "index_quant":
                if not isinstance(value, bool):
                    fail(f.name, f"is {value!r}, not true or false", "write true or false")
            elif f.name not in ("compress_ratios", "ffn", "score_func") and not int_at_least(value, 1):
                fail(f.name, f"is {value!r}, not an integer >= 1", "write it as a positive integer")
        if isinstance(self.compress_ratios, list):
            object.__setattr__(self, "compress_ratios", tuple(self.compress_ratios))
        if self.csa_ratio == self.hca_ratio:
            fail("hca_ratio", f"is {self.hca_ratio}, the CSA ratio too", "use distinct CSA and HCA ratios")
        ratios, allowed = self.compress_ratios, (0, self.csa_ratio, self.hca_ratio)
        if not isinstance(ratios, tuple) or not ratios or any(
                not int_at_least(r, 0) or r not in allowed for r in ratios):
            fail("compress_ratios", f"is {ratios!r}, not a non-empty list of ratios in {allowed}",
                 "write one ratio per layer: 0, the CSA ratio or the HCA ratio")
        if self.rope_dim % 2:
            fail("rope_dim", f"is {self.rope_dim}, an odd number", "RoPE rotates pairs: use an even size")
        for name in ("head_dim", "index_head_dim"):
            if self.rope_dim > getattr(self, name):
                fail("rope_dim", f"is {self.rope_dim}, more than {DSV4_GEOMETRY_KEYS[name]} "
                     f"{getattr(self, name)}", f"use a rope size of at most {DSV4_GEOMETRY_KEYS[name]}")
        if self.rope_factor < 1:
            fail("rope_factor", f"is {self.rope_factor}, below 1", "write a YaRN factor >= 1 (1: no YaRN)")
        if self.rope_factor > 1 and self.rope_original_max_position < 1:
            fail("rope_original_max_position", "is missing with a YaRN factor above 1",
                 "give the context length the model was trained at")
        self._check_ffn(fail)
        if self.o_groups and (self.n_heads % self.o_groups or self.o_lora_rank < 1):
            fail("o_groups", f"is {self.o_groups} with o_lora_rank {self.o_lora_rank}; the groups must "
                 "divide "
                 f"num_attention_heads {self.n_heads} and have a rank >= 1", "use the checkpoint's values")
        if not self.o_groups and self.o_lora_rank:
            fail("o_lora_rank", f"is {self.o_lora_rank} without o_groups", "give both or neither")

    def _check_ffn(self, fail: Callable[[str, str, str], None]) -> None:
        if self.ffn not in ("moe", "dense"):
            fail("ffn", f"is {self.ffn!r}", "write ffn: moe (the routed experts) or dense")
        if self.score_func not in SCORE_FUNCS:
            fail("score_func", f"is {self.score_func!r}, not one of {SCORE_FUNCS}",
                 "use a scoring DeepSeek-V4 has")
        if self.ffn == "dense":
            if self.n_routed_experts or self.n_hash_layers:
                fail("ffn", "is dense with routed experts or hash layers",
                     "write ffn: moe, or drop the experts")
            return
        if self.n_routed_experts < 1:
            fail("n_routed_experts", "is 0 with ffn: moe", "give the number of routed experts")
        if not 1 <= self.n_activated_experts <= self.n_routed_experts:
            fail("n_activated_experts", f"is {self.n_activated_experts}, not in 1..{self.n_routed_experts}",
                 "give the experts each token runs (at most n_routed_experts)")
        if self.n_hash_layers > self.n_layers:
            fail("n_hash_layers", f"is {self.n_hash_layers}, more than the {self.n_layers} layers",
                 "give at most one hash layer per layer")

    @property
    def n_layers(self) -> int:
        return len(self.compress_ratios)

    def rope_for(self, ratio: int) -> Rope:
        """A layer's RoPE: plain at rope_theta on window-only layers; compress_rope_theta, with YaRN when
        rope_factor > 1, on compressed ones (their compressor and indexer too)."""
        if not ratio:
            return Rope(float(self.rope_theta), self.rope_dim)
        return Rope(float(self.compress_rope_theta), self.rope_dim, float(self.rope_factor),
                    self.rope_original_max_position, float(self.rope_beta_fast), float(self.rope_beta_slow))

    def is_hash_layer(self, layer_id: int) -> bool:
        return self.ffn == "moe" and layer_id < self.n_hash_layers

    def for_backend(self, backend: str) -> Dsv4Geometry:
        """The model's config on `backend`: on Ascend the lightning indexer scores int8 (`index_quant`)."""
        return dataclasses.replace(self, index_quant=backend == "ascend")

    # The Llama-style size names a DSpark draft copies from its target (`BlockDraftConfig.for_target`),
    # and the names the runtime's shared checks read: one latent K=V head (MQA), no biases.
    @property
    def num_layers(self) -> int:
        return self.n_layers

    @property
    def hidden_size(self) -> int:
        return self.dim

    @property
    def intermediate_size(self) -> int:
        return self.inter_dim

    @property
    def num_heads(self) -> int:
        return self.n_heads

    @property
    def num_kv_heads(self) -> int:
        return 1

    @property
    def rms_norm_eps(self) -> float:
        return self.norm_eps

    @property
    def attention_bias(self) -> bool:
        return False

    @property
    def compressed_ratios(self) -> tuple[int, ...]:
        """The distinct ratios > 0 of the layers, ascending (the caches a step plans)."""
        return compressed_ratios(self.compress_ratios)

    @property
    def ring_reach(self) -> int:
        return ring_reach(self.window, self.compress_ratios, self.csa_ratio)


def compressed_ratios(layer_ratios: tuple[int, ...]) -> tuple[int, ...]:
    """The distinct ratios > 0 of a model's layers, ascending."""
    return tuple(sorted({r for r in layer_ratios if r}))


def ring_reach(window: int, layer_ratios: tuple[int, ...], csa_ratio: int) -> int:
    """Positions up to and including its own that one row reads back from the raw-KV ring: the window,
    and the blocks a compressor pools (two for the overlapping CSA compressor)."""
    reach = window
    for ratio in compressed_ratios(layer_ratios):
        reach = max(reach, (2 if ratio == csa_ratio else 1) * ratio)
    return reach


@dataclass(frozen=True)
class Dsv4CacheLayout:
    """How a deployment pages a DSV4 model's caches, fixed at compile time (torch-free, for the
    compiler; `dspark.runtime.families.dsv4.verify_metadata.Dsv4StepConfig` is built from it).

    Every request owns a raw-KV ring of `swa_ring_size` slots in pages of `swa_page_size`, and, per
    compressed ratio, pages of `cmp_page_size` entries covering `max_context_len // ratio` entries.
    The ring holds a row's reach plus the rows one step runs per request, so a request may run
    `max_rows_per_request` rows at once: N in a verify step, more in a prefill chunk.
    """

    window: int
    compress_ratios: tuple[int, ...]
    swa_page_size: int
    swa_ring_size: int
    cmp_page_size: int
    index_topk: int
    max_rows_per_request: int

    @property
    def swa_ring_pages(self) -> int:
        return self.swa_ring_size // self.swa_page_size


def dsv4_cache_layout(geometry: Dsv4Geometry, num_draft_tokens: int, page_size: int,
                      prefill_rows: int) -> Dsv4CacheLayout:
    """The layout for verify steps of up to N = `num_draft_tokens` rows per request and prefill chunks
    of up to `prefill_rows` rows per request: a ring of reach + rows - 1 slots, rounded up to whole
    pages (whose spare slots only let a chunk run more rows)."""
    rows = max(num_draft_tokens, prefill_rows)
    ring = -(-(geometry.ring_reach + rows - 1) // page_size) * page_size
    return Dsv4CacheLayout(window=geometry.window, compress_ratios=geometry.compressed_ratios,
                           swa_page_size=page_size, swa_ring_size=ring, cmp_page_size=page_size,
                           index_topk=geometry.index_topk,
                           max_rows_per_request=ring + 1 - geometry.ring_reach)


def int_at_least(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def positive_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)
