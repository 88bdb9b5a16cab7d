"""What the engine asks a model family, answered in one place per family: how this rank's target is loaded and
split, which attention backend runs it, what bounds a request's rows in one extend step, what the target
computes on a backend, and whether a draft shares the target's embeddings. The engine reads
`family_runtime(deployment.model.family)` once and never branches on the family itself.
"""

from __future__ import annotations

from typing import Protocol

import torch

from dspark.formats.dsv4_config import DSV4_FAMILY, Dsv4Geometry
from dspark.formats.hf_config import FAMILIES as DENSE_FAMILIES
from dspark.modes import DSV4_STAGES
from dspark.runtime.attention.metadata import AttentionBackend
from dspark.runtime.config import MODEL_FAMILIES, DeploymentConfig, ModelGeometry
from dspark.runtime.distributed.dp_attention import (
    DPAttentionGroups,
    shard_dp_attention_target,
    shard_dsv4_dp_attention,
)
from dspark.runtime.distributed.expert_parallel import shard_dsv4_experts
from dspark.runtime.distributed.launch import Ranks
from dspark.runtime.distributed.sharded_load import load_sharded_target
from dspark.runtime.distributed.tensor_parallel import shard_dense_target, shard_dsv4_target
from dspark.runtime.dsv4.target import Dsv4ForCausalLM, Dsv4LayerBackend
from dspark.runtime.kv_cache import PagedKVCache
from dspark.runtime.models.checkpoint import load_target_model
from dspark.runtime.models.families import ServingTarget
from dspark.runtime.package import GeneratedPackage


class FamilyRuntime(Protocol):
    def rank_target(self, package: GeneratedPackage, ranks: Ranks, device: torch.device) -> ServingTarget:
        """This rank's target: the whole model for one process, else its share."""
        ...

    def attention(self, package: GeneratedPackage, target: ServingTarget, device: torch.device
                  ) -> AttentionBackend | Dsv4LayerBackend:
        """This rank's attention over its own caches, for the heads it holds."""
        ...

    def max_extend_rows(self, attention: AttentionBackend | Dsv4LayerBackend) -> int | None:
        """Rows one request may append in an extend step (None: no bound beyond the chunk)."""
        ...

    def computed_config(self, deployment: DeploymentConfig) -> ModelGeometry | Dsv4Geometry:
        """The compiled geometry as the target computes it on the deployment's backend."""
        ...

    def shares_draft_embeddings(self, deployment: DeploymentConfig) -> bool:
        """Whether a draft without its own embeddings and LM head takes the target's."""
        ...


class DenseFamily:
    """Llama and Qwen3: one paged K/V cache over the pool's pages; a loaded checkpoint is read shard by shard
    under tensor parallelism (dummy weights are built whole, then sliced)."""

    def rank_target(self, package: GeneratedPackage, ranks: Ranks, device: torch.device) -> ServingTarget:
        dep = package.deployment
        if ranks.world.size == 1:
            return load_target_model(dep, package.directory, device)
        shards = ranks.shards
        if dep.model.load_format != "dummy":
            return load_sharded_target(dep.model.checkpoint, dep.model.dtype, package.directory,
                                       dep.model.family, shards, device)
        target = load_target_model(dep, package.directory, device)
        if isinstance(shards, DPAttentionGroups):
            shard_dp_attention_target(target, shards)
        else:
            shard_dense_target(target, shards)
        return target

    def attention(self, package: GeneratedPackage, target: ServingTarget, device: torch.device
                  ) -> AttentionBackend:
        parts, s, tc = package.parts, package.deployment.serving, target.cfg
        kv = PagedKVCache(tc.num_layers, s.num_pages, s.page_size, target.local_num_kv_heads, tc.head_dim,
                          target.lm_head.weight.dtype, device)
        return parts.attention_backend(kv, s.page_size, target.local_num_heads, tc.head_dim ** -0.5)

    def max_extend_rows(self, attention: AttentionBackend | Dsv4LayerBackend) -> int | None:
        return None

    def computed_config(self, deployment: DeploymentConfig) -> ModelGeometry | Dsv4Geometry:
        return deployment.model.geometry

    def shares_draft_embeddings(self, deployment: DeploymentConfig) -> bool:
        return deployment.draft.load_format != "dummy"


class Dsv4Family:
    """DeepSeek-V4: its own per-slot caches (a raw-KV ring and compressed entries) behind a DSV4 layer
    backend; the target is built whole, then split (query heads over the attention ranks, the K=V head,
    compressors and indexer replicated, `shard_dsv4_target`; under expert parallelism the routed experts over
    every rank, `shard_dsv4_experts`); a request's rows in one step are bounded by its ring."""

    def rank_target(self, package: GeneratedPackage, ranks: Ranks, device: torch.device) -> ServingTarget:
        dep = package.deployment
        target = load_target_model(dep, package.directory, device)
        if ranks.world.size == 1:
            return target
        assert isinstance(target, Dsv4ForCausalLM)
        shards = ranks.shards
        if isinstance(shards, DPAttentionGroups):
            shard_dsv4_dp_attention(target, shards)
            ep, share, rows_replicated = shards.world, shards.attention, shards.dp.size == 1
        else:
            shard_dsv4_target(target, shards)
            ep, share, rows_replicated = shards, None, True
        if dep.parallel.ep > 1:
            shard_dsv4_experts(target, ep, rows_replicated=rows_replicated, share=share)
        return target

    def attention(self, package: GeneratedPackage, target: ServingTarget, device: torch.device
                  ) -> Dsv4LayerBackend:
        s = package.deployment.serving
        return package.parts.attention_backend(target, s.max_running_requests, s.max_context_len)

    def max_extend_rows(self, attention: AttentionBackend | Dsv4LayerBackend) -> int | None:
        return attention.max_extend_rows  # type: ignore[union-attr]

    def computed_config(self, deployment: DeploymentConfig) -> ModelGeometry | Dsv4Geometry:
        geometry = deployment.model.geometry
        assert isinstance(geometry, Dsv4Geometry)
        return geometry.for_backend(deployment.backend)  # Ascend: an int8 indexer

    def shares_draft_embeddings(self, deployment: DeploymentConfig) -> bool:
        # the checkpoint's own DSpark stages draft over the target's tables; a block draft carries its own
        return deployment.draft.architecture == DSV4_STAGES


FAMILY_RUNTIMES: dict[str, FamilyRuntime] = {**{family: DenseFamily() for family in DENSE_FAMILIES},
                                              DSV4_FAMILY: Dsv4Family()}
assert set(FAMILY_RUNTIMES) == set(MODEL_FAMILIES), "every family the compiler accepts has a runtime here"


def family_runtime(family: str) -> FamilyRuntime:
    try:
        return FAMILY_RUNTIMES[family]
    except KeyError:
        raise ValueError(f"model family {family!r} is not one of {', '.join(FAMILY_RUNTIMES)}") from None
