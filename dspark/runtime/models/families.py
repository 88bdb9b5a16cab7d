"""The target model families the runtime serves, by the name a spec's `model.family` gives.

A generated deployment names its family (`DEPLOYMENT.model.family`); the loader builds that
family's model from here, and everything else in the runtime (engine, runners, generated graph
runners) sees only `ServingTarget` (a dense family's model is also a `TargetModel`, which training
and the references run densely). Adding a dense family is one model module and one entry here (and
its config reading in `dspark.formats.hf_config.FAMILIES`); no template changes. DeepSeek-V4 keeps
other caches than paged K/V, so it also has its own attention templates (`dspark/templates/dsv4`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from dspark.families import ModelFamily
from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.runtime.attention.metadata import AttentionBackend, AttentionMetadata
from dspark.runtime.config import ModelGeometry
from dspark.runtime.families.dsv4.target import Dsv4ForCausalLM
from dspark.runtime.models.llama import LlamaForCausalLM
from dspark.runtime.models.qwen3 import Qwen3ForCausalLM


class ServingTarget(Protocol):
    """What the engine asks of every target model (an `nn.Module`) it serves."""

    cfg: ModelGeometry | Dsv4Geometry
    lm_head: torch.nn.Module  # its `.weight` (a vocab shard under TP) gives the dtype and device

    def forward_paged_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any, meta: Any,
                             capture: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`[T, d]` residual stream of a step's packed rows over the caches `attn` owns, planned by `meta`,
        and the streams after `capture` layers (0: the embeddings)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[T, V]` logits of `[T, d]` residual-stream rows, row-invariant."""
        ...


class TargetModel(Protocol):
    """A dense target (Llama, Qwen3): served over the paged KV cache, and run densely for training
    and as the reference."""

    cfg: ModelGeometry
    lm_head: torch.nn.Linear

    def forward_paged(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      attn: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        """`[T, d]` residual stream of ragged rows against the paged KV cache (what the draft reads)."""
        ...

    def forward_paged_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                             meta: AttentionMetadata, capture: Sequence[int] = ()
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward_paged` plus the residual streams after `capture` layers, `[T, len(capture) · d]`
        (0: the embeddings), for a draft that reads several target layers."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[T, V]` logits of `[T, d]` residual-stream rows, row-invariant."""
        ...

    def forward_dense(self, input_ids: torch.Tensor, cache: list[list[torch.Tensor]] | None = None,
                      start: int = 0) -> torch.Tensor:
        """`[b, t, d]` residual stream of a causal batch (reference and training path)."""
        ...

    def forward_dense_states(self, input_ids: torch.Tensor, cache: list[list[torch.Tensor]] | None = None,
                             start: int = 0, capture: Sequence[int] = ()
                             ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def dense_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def greedy_continue(self, prompts: torch.Tensor, steps: int) -> torch.Tensor: ...

    @property
    def tied_weights(self) -> tuple[str, ...]: ...


TARGET_MODELS: dict[ModelFamily, Callable[[Any], ServingTarget]] = {
    ModelFamily.LLAMA: LlamaForCausalLM,
    ModelFamily.QWEN3: Qwen3ForCausalLM,
    ModelFamily.DSV4: Dsv4ForCausalLM,
}
assert set(TARGET_MODELS) == set(ModelFamily), "every family the compiler accepts has a model here"


def target_model_class(family: str) -> Callable[[Any], ServingTarget]:
    try:
        return TARGET_MODELS[family]
    except KeyError:
        raise ValueError(f"model family {family!r} is not one of {', '.join(TARGET_MODELS)}") from None


def build_target(family: str, cfg: ModelGeometry | Dsv4Geometry) -> ServingTarget:
    """An initialised (not loaded) target model of `family` with config `cfg`."""
    return target_model_class(family)(cfg)
