"""What the engine asks a model family, answered in one place per family: how this rank's target is loaded and
split, which attention backend runs it, what bounds a request's rows in one extend step, what the target
computes on a backend, and whether a draft shares the target's embeddings. The engine reads
`family_runtime(deployment.model.family)` once and never branches on the family itself.
"""

from __future__ import annotations

from typing import Protocol

import torch

from dspark.families import ModelFamily
from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.runtime.attention.metadata import AttentionBackend
from dspark.runtime.config import DeploymentConfig, ModelGeometry
from dspark.runtime.distributed.dp_attention import DPAttentionGroups, shard_dp_attention_target
from dspark.runtime.distributed.launch import Ranks
from dspark.runtime.distributed.sharded_load import load_sharded_target
from dspark.runtime.distributed.tensor_parallel import shard_dense_target
from dspark.runtime.families.dsv4.family import Dsv4Family
from dspark.runtime.families.dsv4.target import Dsv4LayerBackend
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


FAMILY_RUNTIMES: dict[ModelFamily, FamilyRuntime] = {
    ModelFamily.LLAMA: DenseFamily(), ModelFamily.QWEN3: DenseFamily(), ModelFamily.DSV4: Dsv4Family(),
}
assert set(FAMILY_RUNTIMES) == set(ModelFamily), "every family the compiler accepts has a runtime here"


def family_runtime(family: str) -> FamilyRuntime:
    try:
        return FAMILY_RUNTIMES[family]
    except KeyError:
        raise ValueError(f"model family {family!r} is not one of {', '.join(FAMILY_RUNTIMES)}") from None
