"""The `dsv4` family's answers to what the engine asks a family (`engine.families.FamilyRuntime`)."""

from __future__ import annotations

import torch

from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.modes import DSV4_STAGES
from dspark.runtime.attention.metadata import AttentionBackend
from dspark.runtime.config import DeploymentConfig, ModelGeometry
from dspark.runtime.distributed.dp_attention import DPAttentionGroups
from dspark.runtime.distributed.launch import Ranks
from dspark.runtime.families.dsv4.expert_parallel import deepep_buffer, shard_dsv4_experts
from dspark.runtime.families.dsv4.sharding import shard_dsv4_dp_attention, shard_dsv4_target
from dspark.runtime.families.dsv4.target import Dsv4ForCausalLM, Dsv4LayerBackend
from dspark.runtime.models.checkpoint import load_target_model
from dspark.runtime.models.families import ServingTarget
from dspark.runtime.package import GeneratedPackage


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
            # rows that differ per rank go to their experts' ranks by DeepEP where it is installed (CUDA)
            deepep = None if rows_replicated or device.type != "cuda" else deepep_buffer(ep, target.cfg.dim)
            shard_dsv4_experts(target, ep, rows_replicated=rows_replicated, share=share, deepep=deepep)
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
