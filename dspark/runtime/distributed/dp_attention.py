"""DP attention of the dense target families (Llama, Qwen3) and of DeepSeek-V4 (dsv4), SGLang-style: the
model half.

A world of `tp` processes runs attention data-parallel over `dp` DP ranks of `tp / dp` processes each:
a DP rank attends only to its own requests (its own KV cache, its own step layout), with its attention
tensor-parallel inside its group of `tp / dp` ranks (`DPAttentionGroups.attention`). The MLP, the
embedding and the LM head stay tensor-parallel over all `tp` ranks (`DPAttentionGroups.world`), so
their weights are split `tp` ways while the KV cache is split `dp` ways by requests and `tp / dp` ways
by heads: the KV cache of a model with few KV heads no longer has to be copied to every rank.

Rank `r` is attention-TP rank `r % (tp / dp)` of DP rank `r // (tp / dp)`: the ranks of a DP rank are
consecutive. Every rank of a step passes the same number of rows (the step's global tier: a DP rank
with fewer rows pads them, an idle DP rank passes only padding rows), and the ranks of one DP rank pass
the same rows. A world-parallel module therefore first all-gathers its input rows across `dp` (the
ranks with this rank's attention-TP rank, one per DP rank, in DP rank order), so that every rank of
the world holds the same rows, runs on all of them, and keeps this DP rank's slice
(`DPGatheredMLP`, `DPGatheredVocab`); the decoder's forward code is the dense families' own.

Row invariance on the CPU (`tensor_parallel`) holds here too: the gather only concatenates rows, the
local products go through `ops.linear` (and the MLP's SiLU through `ops.lanewise`), and every sum over
ranks is added in rank order, so a row's result does not depend on the rows beside it, its own DP
rank's or another's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dspark.runtime.distributed.tensor_parallel import (
    TPGroup,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    check_heads_split,
    dense_target,
    gather_rows,
    own_rows,
    shard_attention,
    shard_dense_target,
    shard_mlp,
    shard_vocab,
)
from dspark.runtime.models.llama import LlamaMLP


@dataclass(frozen=True)
class DPAttentionGroups:
    """This process's places under DP attention: `world` (all ranks: the MLP, the embedding, the LM head),
    `attention` (this DP rank's `tp / dp` ranks: attention heads), `dp` (the `dp` ranks with this rank's
    attention-TP rank, one per DP rank: the group rows are gathered across), and `dp_rank` (this rank's
    DP rank, its rank in `dp`)."""

    world: TPGroup
    attention: TPGroup
    dp: TPGroup
    dp_rank: int

    def __post_init__(self) -> None:
        if self.world.size != self.attention.size * self.dp.size:
            raise ValueError(f"a world of {self.world.size} ranks is not {self.dp.size} DP ranks of "
                             f"{self.attention.size} attention ranks")
        if self.dp.rank != self.dp_rank:
            raise ValueError(f"DP rank {self.dp_rank} must be this rank's place {self.dp.rank} in its "
                             "DP group")

    @classmethod
    def build(cls, tp: int, dp: int) -> DPAttentionGroups:
        """The groups of this rank of an initialised default process group of `tp` ranks.

        `dist.new_group` is collective over the default group: every rank must call this at the same
        point, and it creates every group (its own or not) in the same order on every rank."""
        if dp < 1 or tp % dp:
            raise ValueError(f"DP attention needs dp ({dp}) to divide tp ({tp})")
        if not dist.is_initialized() or dist.get_world_size() != tp:
            raise ValueError(f"DP attention over tp = {tp} ranks needs an initialised default process group "
                             f"of {tp} ranks")
        size = tp // dp  # attention ranks per DP rank
        dp_rank, attention_rank = divmod(dist.get_rank(), size)
        attention = dp_group = None
        for d in range(dp):  # DP rank d's attention ranks: consecutive
            group = dist.new_group(list(range(d * size, (d + 1) * size))) if size > 1 else None
            if d == dp_rank:
                attention = TPGroup(attention_rank, size, group)
        for a in range(size):  # attention rank a of every DP rank, in DP rank order
            group = dist.new_group([a + k * size for k in range(dp)]) if dp > 1 else None
            if a == attention_rank:
                dp_group = TPGroup(dp_rank, dp, group)
        assert attention is not None and dp_group is not None  # this rank is in one of each
        return cls(TPGroup.of(dist.group.WORLD), attention, dp_group, dp_rank)


class DPGatheredVocab(nn.Module):
    """A world-parallel embedding or LM head under DP attention: this DP rank's ids `[n, ...]` (or
    residual rows `[n, ..., d]`) are gathered across `dp`, the module runs on all of them, and this DP
    rank's `[n, ..., d]` embeddings (or `[n, ..., V]` logits) come back."""

    def __init__(self, inner: VocabParallelEmbedding | VocabParallelLMHead, dp: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.dp = dp

    @property
    def weight(self) -> nn.Parameter:
        """The shard's `[rows, d]`: what reads the LM head's dtype and device finds them here."""
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return own_rows(self.inner(gather_rows(x, self.dp)), x.shape[0], self.dp)


class DPGatheredMLP(nn.Module):
    """A world-parallel MLP under DP attention (the paged and the dense forwards of `LlamaMLP`): this
    DP rank's rows are gathered across `dp`, the MLP's columns of this rank run on all of them, the
    row-parallel sum over the world joins them, and this DP rank's rows come back."""

    def __init__(self, inner: LlamaMLP, dp: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.dp = dp

    def forward_paged(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, d]: this DP rank's rows
        return own_rows(self.inner.forward_paged(gather_rows(x, self.dp)), x.shape[0], self.dp)

    def forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        # x [b, t, d]: this DP rank's sequences, gathered as whole sequences
        return own_rows(self.inner.forward_dense(gather_rows(x, self.dp)), x.shape[0], self.dp)


@torch.no_grad()
def shard_dp_attention_target(model: nn.Module, groups: DPAttentionGroups) -> None:
    """Keep this rank's share of a loaded dense target (Llama, Qwen3) under DP attention, in place (a dsv4
    target: `dspark.runtime.families.dsv4.sharding.shard_dsv4_dp_attention`).

    As with `shard_dense_target`, every rank loads the whole model and drops what it does not own, and
    whatever reads the unsharded weights must do so first. The attention's q/k/v/o are split by heads
    over `groups.attention` (whole with one attention rank), the MLP's columns over `groups.world`,
    the embedding and the LM head by vocabulary over `groups.world`; the world-parallel modules are
    wrapped to gather rows across `groups.dp`. `model.local_num_heads` and `model.local_num_kv_heads`
    then give the heads of this rank's KV cache and attention backend. With one DP rank this is
    `shard_dense_target` over the world.
    """
    model = dense_target(model)
    if groups.dp.size == 1:
        shard_dense_target(model, groups.world)
        return
    cfg = model.cfg
    check_heads_split(cfg, groups.attention, "attention tensor parallelism")
    embed, head = shard_vocab(model, groups.world)
    model.model.embed_tokens = DPGatheredVocab(embed, groups.dp)
    model.lm_head = DPGatheredVocab(head, groups.dp)
    for layer in model.model.layers:
        if groups.attention.size > 1:
            shard_attention(layer.self_attn, groups.attention)
        shard_mlp(layer.mlp, cfg.intermediate_size, groups.world)
        layer.mlp = DPGatheredMLP(layer.mlp, groups.dp)
    model.local_num_heads = cfg.num_heads // groups.attention.size
    model.local_num_kv_heads = cfg.num_kv_heads // groups.attention.size
