"""DeepSeek-V4's tensor parallelism and DP attention: which share of a loaded `dsv4` target a rank keeps.

DeepSeek-V4 (`dsv4`) splits the same way where it can, SGLang-style (`shard_dsv4_target`): a rank owns whole
query heads (their rows of the query up-projection wq_b, their attention sinks, their part of the output
projection, which is row-parallel: wo's columns, or whole groups of wo_a and those groups' columns of wo_b),
a share of a dense MLP (w1 / w3 rows, w2 columns, w2 row-parallel; the MoE stays whole, or its routed experts
go over the ranks by expert parallelism, `expert_parallel`) and its vocabulary rows. Its attention has one
latent K=V head that every query head reads, which cannot be split, so the KV projection, the KV
compressors and the lightning indexer are replicated: each rank computes the same cache entries and the same
top-k. The indexer must stay whole in any case, as a row's top-k ranks entries by a sum over every index
head's scores. Its layers keep their weights as tensors, so
`DSV4Layer.partial_sum` (a `PartialSum`) adds wo's and w2's partial products as `RowParallelLinear` does.

DeepSeek-V4 splits the same way (`shard_dp_attention_target`'s dsv4 branch): a layer's query heads (wq_b
rows, sinks, wo columns, wo row-parallel) over `groups.attention`, with the K=V head, the compressors and the
indexer replicated on each of them as under plain tensor parallelism (`shard_dsv4_target`); its MLP
(w1 / w3 rows, w2 columns) and its vocabulary over `groups.world`, the embedding and the LM head wrapped as
the dense ones are (`DPGatheredVocab`). Its layers keep their weights as tensors, so a layer becomes a
`DPAttentionDsv4Layer`, whose `dense_rows` runs the MLP on the rows gathered across `dp` (wo's partial
products are summed over the attention ranks by the layer's own `partial_sum`).
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.runtime.distributed.dp_attention import DPAttentionGroups, DPGatheredVocab
from dspark.runtime.distributed.tensor_parallel import (
    PartialSum,
    TPGroup,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    VocabShard,
    frozen_param,
    gather_rows,
    own_rows,
    rank_share,
)
from dspark.runtime.families.dsv4.model import DSV4Layer
from dspark.runtime.families.dsv4.target import Dsv4ForCausalLM
from dspark.runtime.families.dsv4.w8a8 import kept


def check_dsv4_heads_split(n_heads: int, tp: TPGroup, o_groups: int = 0) -> None:
    """Refuse a group whose size does not divide the query heads (a rank owns whole heads; the one K=V head
    is replicated, so it sets no condition), or with the grouped output projection the groups (a rank owns
    whole groups of wo_a)."""
    if n_heads % tp.size:
        raise ValueError(f"tensor parallelism over {tp.size} ranks needs n_heads ({n_heads}) to be a "
                         f"multiple of {tp.size}")
    if o_groups and o_groups % tp.size:
        raise ValueError(f"tensor parallelism over {tp.size} ranks needs o_groups ({o_groups}) to be a "
                         f"multiple of {tp.size}: a rank projects whole groups of heads")


def shard_dsv4_heads(layer: DSV4Layer, tp: TPGroup) -> None:
    """Keep rank r's query heads `[r·H/size, (r+1)·H/size)` of one layer: their rows of wq_b (the query
    up-projection from the replicated latent qr), their sinks and their part of the output projection
    (row-parallel: wo's columns, or with groups their wo_a rows and wo_b's columns of those groups);
    `partial_sum` then adds the projection's partial products over `tp` (None for a group of one). The
    caller has checked the split (`check_dsv4_heads_split`)."""
    cfg = layer.cfg
    heads, hd = cfg.n_heads // tp.size, cfg.head_dim
    h0, h1 = tp.rank * heads, (tp.rank + 1) * heads  # this rank's query heads
    q0, q1 = h0 * hd, h1 * hd  # their wq_b rows, wo columns
    layer.wq_b = kept(layer.wq_b[q0:q1])  # [heads·D, q_lora]
    layer.attn_sink = frozen_param(layer.attn_sink[h0:h1])  # [heads]
    if cfg.o_groups:
        groups = cfg.o_groups // tp.size
        r0, r1 = tp.rank * groups * cfg.o_lora_rank, (tp.rank + 1) * groups * cfg.o_lora_rank
        layer.wo_a = kept(layer.wo_a[r0:r1])  # [groups·R, heads per group·D]
        layer.wo_b = kept(layer.wo_b[:, r0:r1])  # [dim, groups·R]
    else:
        layer.wo = kept(layer.wo[:, q0:q1])  # [dim, heads·D]
    layer.local_heads = heads
    layer.partial_sum = PartialSum(tp) if tp.size > 1 else None


def shard_dsv4_mlp(layer: DSV4Layer, tp: TPGroup) -> PartialSum:
    """Keep rank r's MLP columns `[r·I/size, …)` of one layer (w1 / w3 rows, w2 columns, row-parallel), and
    return what adds w2's partial products over `tp`. The MoE is not split: every rank keeps every expert
    (replicated) until expert parallelism shards them."""
    if layer.ffn is not None:
        return PartialSum(tp)
    i0, i1 = rank_share(layer.cfg.inter_dim, tp)
    layer.w1 = kept(layer.w1[i0:i1])  # [I / size, dim]
    layer.w3 = kept(layer.w3[i0:i1])
    layer.w2 = kept(layer.w2[:, i0:i1])  # [dim, I / size]
    return PartialSum(tp)


def shard_dsv4_layer(layer: DSV4Layer, tp: TPGroup) -> None:
    """Keep this rank's query heads and MLP columns of one layer, both over `tp`, so that `partial_sum` adds
    wo's and w2's partial products over the group. The rest stays whole (`shard_dsv4_target` says why)."""
    shard_dsv4_heads(layer, tp)
    shard_dsv4_mlp(layer, tp)  # the same group: the layer's partial_sum adds w2's products too


def shard_dsv4_vocab(model: Dsv4ForCausalLM, tp: TPGroup
                     ) -> tuple[VocabParallelEmbedding, VocabParallelLMHead]:
    """The embedding and the (untied) LM head of this rank's `ceil(V/size)` vocabulary rows, for the caller
    to install; the whole tables are dropped."""
    ref = model.model
    shard = VocabShard.of(ref.cfg.vocab_size, tp)
    embed = VocabParallelEmbedding(frozen_param(shard.slice(ref.embed)), shard, tp)
    head = VocabParallelLMHead(frozen_param(shard.slice(ref.head)), shard, tp)
    del ref.embed, ref.head  # the whole tables: only this rank's rows stay
    return embed, head


@torch.no_grad()
def shard_dsv4_target(model: nn.Module, tp: TPGroup) -> None:
    """Keep only this rank's share of a dsv4 target, in place (every rank builds or loads the model whole,
    then drops what it does not own).

    Rank r keeps query heads `[r·H/size, (r+1)·H/size)` of every layer (`shard_dsv4_layer`), its MLP columns
    and `ceil(V/size)` vocabulary rows of the embedding and of the (untied) LM head. Replicated on every rank,
    and so computed identically by each: the query down-projection wq_a and its norm (the latent qr every
    head's query comes from), the single latent K=V head (wkv, kv_norm: one head that every query head reads
    cannot be split by heads), the KV compressors (they pool that head's entries) and the lightning indexer
    with its own compressor (a row's top-k ranks entries by a sum over all the index heads' scores, so
    no rank could choose from a share of them). Each rank's caches therefore hold the same entries, and its
    attention backend runs its local heads over them (`Dsv4ForCausalLM.local_num_heads`). A group of one
    leaves the model as it is.
    """
    if not isinstance(model, Dsv4ForCausalLM):
        raise ValueError(f"shard_dsv4_target shards a dsv4 target, not {type(model).__name__}")
    cfg = model.model.cfg
    if model.local_num_heads != cfg.n_heads:
        raise ValueError("the model is already sharded")
    if tp.size == 1:
        return
    check_dsv4_heads_split(cfg.n_heads, tp, cfg.o_groups)
    ref = model.model
    embed, head = shard_dsv4_vocab(model, tp)
    ref.vocab_embed, ref.vocab_head = embed, head
    model.lm_head = head  # the engine reads the model's dtype and device off it
    for layer in ref.layers:
        shard_dsv4_layer(layer, tp)


class DPAttentionDsv4Layer(DSV4Layer):
    """A dsv4 layer under DP attention: its query heads split over this DP rank's attention ranks
    (`partial_sum` adds wo's partial products over them, None with one), its MLP columns over the world
    (`mlp_sum` adds w2's partial products over it) on the rows of every DP rank, gathered across `dp`.

    A `DSV4Layer` becomes one in place (`shard_dp_attention_target` sets its class and the two attributes):
    everything else, the paged and the device backends' calls included, is the layer's own, and both reach
    the dense MLP through `output_rows` -> `mlp_rows` -> `dense_rows`."""

    mlp_sum: PartialSum
    dp: TPGroup

    def dense_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The dense MLP on the gathered rows: x [n, dim] of this DP rank -> its [n, dim]. The products are
        the base class's (`mlp_partial`), on every DP rank's rows, summed over the world in rank order. (An
        MoE runs on this DP rank's own rows: whole, or with its experts over the world, expert parallelism
        dispatching the rows.)"""
        gathered = gather_rows(x, self.dp)  # [dp · n, dim]
        return own_rows(self.mlp_sum(self.mlp_partial(gathered)), x.shape[0], self.dp)


def shard_dsv4_dp_attention(model: Dsv4ForCausalLM, groups: DPAttentionGroups) -> None:
    """Keep this rank's share of a dsv4 target under DP attention, in place (see the module docstring): query
    heads over `groups.attention` (the K=V head, compressors and indexer replicated, as `shard_dsv4_target`
    says why), the MLP and the vocabulary over `groups.world`, rows gathered across `groups.dp`. With one
    DP rank this is `shard_dsv4_target` over the world."""
    cfg = model.model.cfg
    if model.local_num_heads != cfg.n_heads or model.model.vocab_embed is not None:
        raise ValueError("the model is already sharded")  # its heads, or (one attention rank) its vocabulary
    if groups.dp.size == 1:
        shard_dsv4_target(model, groups.world)
        return
    check_dsv4_heads_split(cfg.n_heads, groups.attention, cfg.o_groups)
    ref = model.model
    embed, head = shard_dsv4_vocab(model, groups.world)
    ref.vocab_embed = DPGatheredVocab(embed, groups.dp)
    ref.vocab_head = DPGatheredVocab(head, groups.dp)
    model.lm_head = ref.vocab_head  # the engine reads the model's dtype and device off it
    for layer in ref.layers:
        shard_dsv4_heads(layer, groups.attention)
        mlp_sum = shard_dsv4_mlp(layer, groups.world)
        layer.__class__ = DPAttentionDsv4Layer
        layer.mlp_sum, layer.dp = mlp_sum, groups.dp
