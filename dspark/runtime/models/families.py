"""The target model families the runtime serves, by the name a spec's `model.family` gives.

A generated deployment names its family (`DEPLOYMENT.model.family`); the loader builds that
family's model from here, and everything else in the runtime (engine, runners, generated graph
runners) sees only `TargetModel`. Adding a family is one model module and one entry here (and its
config reading in `dspark.formats.hf_config.FAMILIES`); no template changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from dspark.formats.hf_config import FAMILIES
from dspark.runtime.attention.metadata import AttentionBackend, AttentionMetadata
from dspark.runtime.config import ModelGeometry
from dspark.runtime.models.llama import LlamaForCausalLM
from dspark.runtime.models.qwen3 import Qwen3ForCausalLM


class TargetModel(Protocol):
    """What the runtime asks of a target model (an `nn.Module`)."""

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


TARGET_MODELS: dict[str, Callable[[ModelGeometry], TargetModel]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}
assert set(TARGET_MODELS) == set(FAMILIES), "every family the compiler accepts has a model here"


def target_model_class(family: str) -> Callable[[ModelGeometry], TargetModel]:
    try:
        return TARGET_MODELS[family]
    except KeyError:
        raise ValueError(f"model family {family!r} is not one of {', '.join(TARGET_MODELS)}") from None


def build_target(family: str, cfg: ModelGeometry) -> TargetModel:
    """An initialised (not loaded) target model of `family` with config `cfg`."""
    return target_model_class(family)(cfg)
