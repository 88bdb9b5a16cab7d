"""The published DSpark draft's configuration, read from a released checkpoint's `config.json`.

DeepSpec writes a draft's `config.json` as a copy of its target's Hugging Face Qwen3 config with the
draft's own fields added (`block_size`, `mask_token_id`, `target_layer_ids`, `num_target_layers`,
`markov_rank`, `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`, ...),
`num_hidden_layers` set to the draft's layer count and `architectures: ["Qwen3DSparkModel"]`.

Reading is strict, because a draft decoded with a misread field still runs and only drafts badly:
every field that changes the computation is read (and refused when its value is one this module
does not implement), the fields known to change nothing at inference are listed in `IGNORED_FIELDS`,
and any other field is refused. Every error names the file and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
ARCHITECTURE = "Qwen3DSparkModel"

# Fields a released draft config carries that change nothing at inference: token ids of the
# tokenizer, training-only settings (`num_anchors`, `attention_dropout`, `initializer_range`),
# serialization metadata, and the sliding-window bookkeeping of a config whose layers are all
# full attention (`use_sliding_window: false` is checked, and `layer_types` must say so).
IGNORED_FIELDS = frozenset({
    "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
    "dtype", "torch_dtype", "transformers_version", "use_cache", "num_anchors",
    "max_window_layers", "sliding_window", "max_position_embeddings", "_name_or_path",
    "_attn_implementation_autoset",
})

# Fields read by `BlockDraftConfig.from_hf` (with the checks noted there).
READ_FIELDS = frozenset({
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "rms_norm_eps", "attention_bias", "rope_theta", "rope_scaling", "rope_parameters",
    "tie_word_embeddings", "use_sliding_window", "layer_types", "block_size", "mask_token_id",
    "target_layer_ids", "num_target_layers", "markov_rank", "markov_head_type",
    "enable_confidence_head", "confidence_head_with_markov",
})

REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "block_size",
                   "mask_token_id", "target_layer_ids", "num_target_layers", "markov_rank",
                   "enable_confidence_head")


def default_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """The target layers a draft reads when nobody says: up to five, spread from the second layer to
    the third-last (the released Qwen3-8B draft's [1, 9, 17, 25, 33] of 36 layers); a shallow target
    gives every layer but its last, whose output a draft may not read; a one-layer target, its
    embeddings (-1)."""
    if num_target_layers < 2:
        return (-1,)
    if num_target_layers <= 6:
        return tuple(range(min(5, num_target_layers - 1)))
    start, end = 1, num_target_layers - 3
    return tuple(sorted({round(start + i * (end - start) / 4) for i in range(5)}))


class BlockDraftConfigError(ValueError):
    """A draft `config.json` this module cannot run exactly as written (the message names the file
    and the field)."""


@dataclass(frozen=True)
class BlockDraftConfig:
    vocab_size: int
    hidden_size: int  # the draft's width, which is also the target's (the config is the target's copy)
    intermediate_size: int
    num_layers: int  # draft decoder layers (`num_hidden_layers` in config.json)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    block_size: int  # slots per block: the anchor plus `block_size - 1` mask tokens
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # target decoder layers whose outputs the draft reads (-1: embeddings)
    num_target_layers: int
    markov_rank: int  # 0: no Markov head (the draft's logits are the backbone's)
    markov_head_type: str | None  # vanilla, gated or rnn when markov_rank > 0
    confidence_head: bool
    confidence_with_markov: bool  # the confidence head also reads the previous token's Markov embedding

    @property
    def context_width(self) -> int:
        """Width of one context position's target features: the hidden states at every
        `target_layer_ids` entry, concatenated in that order."""
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def context_window(self) -> None:
        """A block reads every committed position's context (no window)."""
        return None

    @property
    def layers_before_capture(self) -> tuple[int, ...]:
        """For each `target_layer_ids` entry, how many target decoder layers have run when its hidden
        state is read: id -1 is the embedding output (0 layers), id i the residual stream leaving
        decoder layer i (i + 1 layers), before any final norm. Index `n` of Hugging Face's
        `output_hidden_states` tuple, which is what DeepSpec's training cache stores."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def confidence_inputs(self) -> int:
        return self.hidden_size + (self.markov_rank if self.confidence_with_markov else 0)

    @classmethod
    def for_target(cls, target: Any, **draft: Any) -> BlockDraftConfig:
        """The config of a draft for `target` (any geometry with the Llama-style size fields): the
        target's sizes, as the released drafts copy their target's config, with the draft's own
        settings (`num_layers`, `block_size`, `mask_token_id`, `target_layer_ids`, `markov_rank`,
        `markov_head_type`, `confidence_head`, `confidence_with_markov`)."""
        return cls(vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                   intermediate_size=target.intermediate_size, num_heads=target.num_heads,
                   num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                   rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
                   attention_bias=target.attention_bias, num_target_layers=target.num_layers, **draft)

    @property
    def default_gamma(self) -> int:
        """Drafts per step when the deployment does not say: one per block slot."""
        return self.block_size

    @classmethod
    def from_file(cls, path: str | Path) -> BlockDraftConfig:
        """The config of a checkpoint directory (or of a `config.json` path)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise BlockDraftConfigError(f"{path}: no such file (a DSpark draft checkpoint directory "
                                        "holds config.json and *.safetensors)") from e
        except json.JSONDecodeError as e:
            raise BlockDraftConfigError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise BlockDraftConfigError(f"{path}: expected a JSON object")
        return cls.from_hf(raw, str(path))

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> BlockDraftConfig:
        return _Reader(cfg, source).read()

    def to_hf(self) -> dict[str, Any]:
        """The fields of a released draft config that determine this config (enough to load it back;
        a released file also carries the metadata in `IGNORED_FIELDS`)."""
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURE], "model_type": "qwen3",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": self.attention_bias,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": False, "use_sliding_window": False,
            "layer_types": ["full_attention"] * self.num_layers,
            "block_size": self.block_size, "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids), "num_target_layers": self.num_target_layers,
            "markov_rank": self.markov_rank, "enable_confidence_head": self.confidence_head,
        }
        if self.markov_rank > 0:
            out["markov_head_type"] = self.markov_head_type
        if self.confidence_head:
            out["confidence_head_with_markov"] = self.confidence_with_markov
        return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Reader:
    """One pass over a config dict; every refusal names `source` and the field."""

    def __init__(self, cfg: dict[str, Any], source: str) -> None:
        self.cfg = cfg
        self.source = source

    def fail(self, field: str, why: str) -> BlockDraftConfigError:
        return BlockDraftConfigError(f"{self.source}: field {field!r}: {why}")

    def int_field(self, name: str, minimum: int = 1, default: int | None = None) -> int:
        if name not in self.cfg or self.cfg[name] is None:
            if default is None:
                raise self.fail(name, "required and missing")
            return default
        v = self.cfg[name]
        if not _is_int(v) or v < minimum:
            raise self.fail(name, f"expected an integer >= {minimum}, got {v!r}")
        return v

    def float_field(self, name: str, value: Any = None) -> float:
        v = self.cfg.get(name) if value is None else value
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise self.fail(name, f"expected a positive number, got {v!r}")
        return float(v)

    def bool_field(self, name: str, default: bool | None = None) -> bool:
        if name not in self.cfg:
            if default is None:
                raise self.fail(name, "required and missing")
            return default
        v = self.cfg[name]
        if not isinstance(v, bool):
            raise self.fail(name, f"expected true or false, got {v!r}")
        return v

    def read(self) -> BlockDraftConfig:
        c = self.cfg
        if "speculators_model_type" in c:
            raise self.fail("speculators_model_type", "a draft trained with the speculators convention "
                            "(slot j predicts anchor+j, slot 0 untrained); this module implements "
                            "DeepSpec's (slot k predicts anchor+k+1)")
        unknown = sorted(set(c) - READ_FIELDS - IGNORED_FIELDS)
        if unknown:
            raise self.fail(unknown[0], "not a field this DSpark draft loader knows; it may change the "
                            f"computation, so the checkpoint is refused (unknown fields: {unknown})")
        for name in REQUIRED_FIELDS:
            if name not in c:
                raise self.fail(name, "required and missing")
        self.check_identity()

        vocab = self.int_field("vocab_size")
        hidden = self.int_field("hidden_size")
        heads = self.int_field("num_attention_heads")
        kv_heads = self.int_field("num_key_value_heads")
        if heads % kv_heads:
            raise self.fail("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads {heads}")
        if "head_dim" in c and c["head_dim"] is not None:
            head_dim = self.int_field("head_dim")
        elif hidden % heads == 0:
            head_dim = hidden // heads
        else:
            raise self.fail("head_dim", f"missing, and hidden_size {hidden} is not a multiple of "
                            f"num_attention_heads {heads}")
        if head_dim % 2:
            raise self.fail("head_dim", f"rotary embeddings need an even head_dim, got {head_dim}")
        num_layers = self.int_field("num_hidden_layers")
        if c.get("hidden_act", "silu") != "silu":
            raise self.fail("hidden_act", f"only 'silu' (SwiGLU) is implemented, got {c['hidden_act']!r}")
        if self.bool_field("tie_word_embeddings", default=False):
            raise self.fail("tie_word_embeddings", "DSpark drafts carry their own untied lm_head; true is "
                            "not a layout DeepSpec writes")
        self.check_layers(num_layers)

        block_size = self.int_field("block_size")
        mask_token_id = self.int_field("mask_token_id", minimum=0)
        if mask_token_id >= vocab:
            raise self.fail("mask_token_id",
                            f"{mask_token_id} is outside the vocabulary (vocab_size {vocab})")
        num_target_layers = self.int_field("num_target_layers")
        layer_ids = self.layer_ids(num_target_layers)

        markov_rank = self.int_field("markov_rank", minimum=0)
        markov_type: str | None = None
        if markov_rank > 0:
            markov_type = c.get("markov_head_type")
            if not isinstance(markov_type, str) or markov_type.lower() not in MARKOV_HEAD_TYPES:
                raise self.fail("markov_head_type", f"expected one of {list(MARKOV_HEAD_TYPES)} when "
                                f"markov_rank > 0, got {markov_type!r}")
            markov_type = markov_type.lower()
        confidence = self.bool_field("enable_confidence_head")
        with_markov = False
        if confidence:
            with_markov = self.bool_field("confidence_head_with_markov")
            if with_markov and markov_rank == 0:
                raise self.fail("confidence_head_with_markov", "true needs a Markov head (markov_rank > 0)")

        eps = self.float_field("rms_norm_eps")
        return BlockDraftConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=self.int_field("intermediate_size"),
            num_layers=num_layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=eps, rope_theta=self.rope_theta(),
            attention_bias=self.bool_field("attention_bias", default=False), block_size=block_size,
            mask_token_id=mask_token_id, target_layer_ids=layer_ids, num_target_layers=num_target_layers,
            markov_rank=markov_rank, markov_head_type=markov_type, confidence_head=confidence,
            confidence_with_markov=with_markov)

    def check_identity(self) -> None:
        c = self.cfg
        if c.get("model_type", "qwen3") != "qwen3":
            raise self.fail("model_type",
                            f"only Qwen3 DSpark drafts are implemented, got {c['model_type']!r}")
        arch = c.get("architectures", [ARCHITECTURE])
        if arch != [ARCHITECTURE]:
            raise self.fail("architectures", f"expected [{ARCHITECTURE!r}], got {arch!r}")

    def check_layers(self, num_layers: int) -> None:
        c = self.cfg
        if self.bool_field("use_sliding_window", default=False):
            raise self.fail("use_sliding_window", "sliding-window draft attention is not implemented")
        types = c.get("layer_types")
        if types is None:
            return
        if not isinstance(types, list) or len(types) != num_layers:
            raise self.fail("layer_types",
                            f"expected one entry per draft layer ({num_layers}), got {types!r}")
        for i, t in enumerate(types):
            if t != "full_attention":
                raise self.fail("layer_types", f"entry {i} is {t!r}; only 'full_attention' is implemented")

    def layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        ids = self.cfg["target_layer_ids"]
        if not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids):
            raise self.fail("target_layer_ids", f"expected a non-empty list of integers, got {ids!r}")
        if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
            raise self.fail("target_layer_ids", f"must be strictly increasing, got {ids}")
        last = num_target_layers - 1
        for i in ids:
            if i < -1 or i > last:
                raise self.fail("target_layer_ids", f"{i} is outside -1 (the embeddings) .. {last} "
                                f"(num_target_layers {num_target_layers})")
            if i == last:
                # Hugging Face's output_hidden_states stores the final *normed* state in that slot
                # while DeepSpec's target cache stores raw layer outputs: the two disagree there.
                raise self.fail("target_layer_ids", f"{i} is the target's final layer, whose hidden state "
                                "DeepSpec's training and inference read differently; refused")
        return tuple(ids)

    def rope_theta(self) -> float:
        c = self.cfg
        scaling = c.get("rope_scaling")
        if scaling is not None and not (isinstance(scaling, dict)
                                        and scaling.get("rope_type", scaling.get("type")) == "default"):
            raise self.fail("rope_scaling",
                            f"only unscaled rotary embeddings are implemented, got {scaling!r}")
        params = c.get("rope_parameters")
        theta: float | None = None
        if params is not None:
            if not isinstance(params, dict):
                raise self.fail("rope_parameters", f"expected an object, got {params!r}")
            extra = sorted(set(params) - {"rope_type", "rope_theta"})
            if params.get("rope_type", "default") != "default" or extra:
                raise self.fail("rope_parameters", "only {rope_type: default, rope_theta} is implemented, "
                                f"got {params!r}")
            if "rope_theta" not in params:
                raise self.fail("rope_parameters", "rope_theta missing")
            theta = self.float_field("rope_parameters", params["rope_theta"])
        if "rope_theta" in c:
            top = self.float_field("rope_theta")
            if theta is not None and top != theta:
                raise self.fail("rope_theta", f"{top} disagrees with rope_parameters.rope_theta {theta}")
            theta = top
        if theta is None:
            raise self.fail("rope_parameters", "no rope theta (neither rope_parameters.rope_theta nor "
                            "rope_theta); refusing to guess a default")
        return theta
