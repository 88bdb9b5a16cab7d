"""Tensor parallelism of the dense target families (Llama, Qwen3), Megatron-style, and of DeepSeek-V4.

Each rank of a tensor-parallel group holds a slice of every large weight and computes its share of
each product; torch.distributed collectives on the group (gloo on the CPU, NCCL on CUDA, HCCL on
Ascend) join the shares:

- q/k/v and gate/up are column-parallel (`ColumnParallelLinear`): a rank owns whole attention heads
  (query heads and the KV heads they read, so grouped-query attention stays rank-local) and a slice
  of the MLP's columns, and computes them with no communication;
- o_proj and down_proj are row-parallel (`RowParallelLinear`): a rank multiplies its heads' / columns'
  input features by its slice of the weight, and the partial products are summed over the group;
- the embedding and the LM head are split by vocabulary (`VocabParallelEmbedding`,
  `VocabParallelLMHead`); with tied embeddings both read one sharded tensor.

RMSNorms (Qwen3's per-head q/k norms included: one scale per feature of a head, shared by all heads)
and RoPE act on whole rows or whole heads and stay as they are. After each row-parallel sum every rank
holds the same residual stream bit for bit, so a step's hidden states and logits are whole and equal
on every rank.

Greedy speculative decoding stays identical to target-only decoding on the CPU only if a row's result
does not depend on the rows beside it (`ops`). The local products go through `ops.linear`, which keeps
that; the sum of the row-parallel partial products must keep it too, and an all-reduce does not over
more than two ranks (two terms add the same in either order): gloo's ring adds the ranks' terms in an
order that follows the element's place in the buffer, so the step's row count changed a row's last
bits over 4 ranks in `tests/test_tensor_parallel.py`. On the CPU the partial products are
therefore all-gathered and added in rank order (`_sum_over_ranks`); on an accelerator, where the
local products are not row-invariant either, the all-reduce runs.

The collectives are not differentiable: the sharded model is for inference (its parameters do not
require grad).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dspark.runtime.config import ModelGeometry
from dspark.runtime.models import ops
from dspark.runtime.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class CommClock:
    """Wall time this process spends communicating, by kind ("collective": the layers' all-reduces and
    all-gathers; "command": an engine's step commands; "agreement": the DP ranks' per-step agreements),
    for benchmarks: off unless `enabled`, and then one perf_counter pair per call. gloo's collectives
    return when done, so on the CPU this is the communication time, waits for the slower rank included;
    NCCL's are asynchronous, and a GPU measurement must synchronise around them."""

    def __init__(self) -> None:
        self.enabled = False
        self.seconds: dict[str, float] = {}

    @contextmanager
    def timed(self, kind: str = "collective") -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - start

    def reset(self) -> None:
        self.seconds = {}


COMM_CLOCK = CommClock()


@dataclass(frozen=True)
class TPGroup:
    """This process's place in its tensor-parallel group: `rank` of `size`, collectives on `group`
    (None only for a group of one, which runs no collective)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside a group of {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"a tensor-parallel group of {self.size} ranks needs a process group")

    @classmethod
    def single(cls) -> TPGroup:
        """One process holding the whole model."""
        return cls(0, 1, None)

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> TPGroup:
        """This process's rank in an initialised process group, and the group's size."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)


def gather_rows(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """`[n, ...]` on each rank of `group` -> `[group.size · n, ...]`, rank 0's rows first, on every rank."""
    if group.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size)]
    with COMM_CLOCK.timed():
        dist.all_gather(parts, x, group=group.group)
    return torch.cat(parts)


def own_rows(x: torch.Tensor, n: int, group: TPGroup) -> torch.Tensor:
    """This rank's `[n, ...]` of `gather_rows`' `[group.size · n, ...]`."""
    return x if group.size == 1 else x[group.rank * n:(group.rank + 1) * n]


def _local_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` over any leading dimensions, through the row-invariant `ops.linear`."""
    rows = x.reshape(-1, x.shape[-1])  # [N, in]
    return ops.linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


def _sum_over_ranks(partial: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The sum over the group of each rank's `partial`, the same bits on every rank."""
    if tp.size == 1:
        return partial
    if partial.device.type != "cpu":
        with COMM_CLOCK.timed():
            dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=tp.group)
        return partial
    # In rank order, element by element: the order no longer depends on the tensor's size.
    parts = [torch.empty_like(partial) for _ in range(tp.size)]
    with COMM_CLOCK.timed():
        dist.all_gather(parts, partial, group=tp.group)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def frozen_param(t: torch.Tensor) -> nn.Parameter:
    """A parameter of its own storage (a slice would keep the whole tensor alive), not trained."""
    return nn.Parameter(t.detach().clone(memory_format=torch.contiguous_format), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """`nn.Linear` whose output features `[start, end)` live on this rank: `forward` returns those
    columns of `x @ W.T + b` and communicates nothing."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPGroup,
                 span: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.weight = frozen_param(weight)  # [out / size, in]
        self.bias = frozen_param(bias) if bias is not None else None  # [out / size]
        self.tp = tp
        # The dense layer's output features `[start, end)` held here, kept so that a loader can fill a
        # shard built from shapes alone (`sharded_load`) with the same rows of the checkpoint's tensor.
        self.span = span

    @classmethod
    def from_dense(cls, layer: nn.Linear, start: int, end: int, tp: TPGroup) -> ColumnParallelLinear:
        bias = layer.bias[start:end] if layer.bias is not None else None
        return cls(layer.weight[start:end], bias, tp, (start, end))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _local_linear(x, self.weight, self.bias)  # [..., out / size]


class RowParallelLinear(nn.Module):
    """`nn.Linear` whose input features `[start, end)` live on this rank: `forward` takes this rank's
    slice of the input, and every rank returns the whole `x @ W.T + b` (the partial products summed
    over the group, `_sum_over_ranks`; the bias, whole on every rank, added once after the sum)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPGroup,
                 span: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.weight = frozen_param(weight)  # [out, in / size]
        self.bias = frozen_param(bias) if bias is not None else None  # [out]
        self.tp = tp
        self.span = span  # the dense layer's input features `[start, end)` held here (`sharded_load`)

    @classmethod
    def from_dense(cls, layer: nn.Linear, start: int, end: int, tp: TPGroup) -> RowParallelLinear:
        return cls(layer.weight[:, start:end], layer.bias, tp, (start, end))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _sum_over_ranks(_local_linear(x, self.weight), self.tp)  # [..., out]
        return out if self.bias is None else out + self.bias


@dataclass(frozen=True)
class VocabShard:
    """A rank's token ids `[start, start + rows)`: `rows = ceil(vocab / size)` on every rank (the
    last rank's tail past the vocabulary is zero padding), so the gathered logits are equal slices."""

    vocab_size: int
    start: int
    rows: int

    @classmethod
    def of(cls, vocab_size: int, tp: TPGroup) -> VocabShard:
        rows = -(-vocab_size // tp.size)
        return cls(vocab_size, tp.rank * rows, rows)

    def slice(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's `[rows, d]` of a `[vocab, d]` weight, zero-padded past the vocabulary."""
        own = weight[self.start:self.start + self.rows]
        missing = self.rows - own.shape[0]
        return F.pad(own, (0, 0, 0, missing)) if missing else own


class VocabParallelEmbedding(nn.Module):
    """`nn.Embedding` with the rows of this rank's token ids: ids outside them give zero rows, and an
    all-reduce adds each id's one nonzero row (exactly: the other terms are zeros)."""

    def __init__(self, weight: nn.Parameter, shard: VocabShard, tp: TPGroup) -> None:
        super().__init__()
        self.weight = weight  # [rows, d]
        self.shard = shard
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.shard.start
        inside = (local >= 0) & (local < self.shard.rows)
        out = F.embedding(torch.where(inside, local, 0), self.weight)  # [..., d]
        out = out.masked_fill(~inside.unsqueeze(-1), 0.0)
        if self.tp.size > 1:
            with COMM_CLOCK.timed():
                dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.tp.group)
        return out


class VocabParallelLMHead(nn.Module):
    """The bias-free LM head with the rows (vocabulary entries) of this rank's token ids: `forward`
    computes this rank's slice of the logits and all-gathers the slices in rank order, so every rank
    returns the whole `[..., vocab]` logits."""

    def __init__(self, weight: nn.Parameter, shard: VocabShard, tp: TPGroup) -> None:
        super().__init__()
        self.weight = weight  # [rows, d]: the embedding's own tensor when the two are tied
        self.shard = shard
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = _local_linear(x, self.weight)  # [..., rows]
        if self.tp.size == 1:
            return local
        slices = [torch.empty_like(local) for _ in range(self.tp.size)]
        with COMM_CLOCK.timed():
            dist.all_gather(slices, local, group=self.tp.group)
        logits = torch.cat(slices, dim=-1)  # [..., size · rows]
        vocab = self.shard.vocab_size
        return logits if logits.shape[-1] == vocab else logits[..., :vocab].contiguous()


def rank_share(n: int, tp: TPGroup) -> tuple[int, int]:
    """This rank's `[start, end)` of `n` items split as evenly as possible in rank order."""
    return tp.rank * n // tp.size, (tp.rank + 1) * n // tp.size


def dense_target(model: nn.Module) -> LlamaForCausalLM:
    """`model` as a dense target whose weights are still whole, or a ValueError saying why not."""
    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(f"tensor parallelism covers the dense families (Llama, Qwen3), not "
                         f"{type(model).__name__}")
    if model.local_num_heads != model.cfg.num_heads:
        raise ValueError("the model is already sharded")
    return model


def check_heads_split(cfg: ModelGeometry, tp: TPGroup, what: str = "tensor parallelism") -> None:
    """Refuse a group whose size does not divide the query and the KV heads (a rank owns whole heads)."""
    if cfg.num_heads % tp.size or cfg.num_kv_heads % tp.size:
        raise ValueError(f"{what} over {tp.size} ranks needs num_heads ({cfg.num_heads}) and "
                         f"num_kv_heads ({cfg.num_kv_heads}) to be multiples of {tp.size}")


def shard_attention(attn: LlamaAttention, tp: TPGroup) -> None:
    """Keep rank r's query heads `[r·H/size, (r+1)·H/size)` and the KV heads `[r·Hkv/size, …)` they read:
    q/k/v column-parallel, o_proj row-parallel over `tp` (heads checked by `check_heads_split`)."""
    cfg = attn.cfg
    heads, kv_heads, hd = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size, cfg.head_dim
    q0, q1 = tp.rank * heads * hd, (tp.rank + 1) * heads * hd  # this rank's q rows, o_proj columns
    kv0, kv1 = tp.rank * kv_heads * hd, (tp.rank + 1) * kv_heads * hd
    attn.q_proj = ColumnParallelLinear.from_dense(attn.q_proj, q0, q1, tp)
    attn.k_proj = ColumnParallelLinear.from_dense(attn.k_proj, kv0, kv1, tp)
    attn.v_proj = ColumnParallelLinear.from_dense(attn.v_proj, kv0, kv1, tp)
    attn.o_proj = RowParallelLinear.from_dense(attn.o_proj, q0, q1, tp)
    attn.local_num_heads, attn.local_num_kv_heads = heads, kv_heads


def shard_mlp(mlp: LlamaMLP, intermediate_size: int, tp: TPGroup) -> None:
    """Keep rank r's MLP columns `[r·I/size, …)`: gate/up column-parallel, down_proj row-parallel."""
    i0, i1 = rank_share(intermediate_size, tp)
    mlp.gate_proj = ColumnParallelLinear.from_dense(mlp.gate_proj, i0, i1, tp)
    mlp.up_proj = ColumnParallelLinear.from_dense(mlp.up_proj, i0, i1, tp)
    mlp.down_proj = RowParallelLinear.from_dense(mlp.down_proj, i0, i1, tp)


def shard_vocab(model: LlamaForCausalLM, tp: TPGroup) -> tuple[VocabParallelEmbedding, VocabParallelLMHead]:
    """The embedding and the LM head of `ceil(V/size)` vocabulary rows of this rank (one tensor for both
    when tied), for the caller to install."""
    backbone = model.model
    tied = model.lm_head.weight is backbone.embed_tokens.weight
    shard = VocabShard.of(model.cfg.vocab_size, tp)
    embed = frozen_param(shard.slice(backbone.embed_tokens.weight))  # [rows, d]
    head = embed if tied else frozen_param(shard.slice(model.lm_head.weight))
    return VocabParallelEmbedding(embed, shard, tp), VocabParallelLMHead(head, shard, tp)


@torch.no_grad()
def shard_dense_target(model: nn.Module, tp: TPGroup) -> None:
    """Keep only this rank's share of a loaded dense target (Llama, Qwen3), in place.

    First version: every rank loads the whole checkpoint (or the same seeded dummy weights) and then
    drops what it does not own, so loading needs the whole model's memory on each rank for a while.
    The model may also be on the `meta` device (shapes only): `sharded_load.load_sharded_target` shards
    such a model and then reads each rank's slices straight from the checkpoint.
    Whatever reads the unsharded weights (a draft that copies the target's embeddings and LM head)
    must do so before this call.

    Rank r keeps query heads `[r·H/size, (r+1)·H/size)` and KV heads `[r·Hkv/size, …)` (the KV heads
    its query heads read), MLP columns `[r·I/size, …)`, and `ceil(V/size)` vocabulary rows of the
    embedding and the LM head (one tensor for both when tied). `model.local_num_heads` and
    `model.local_num_kv_heads` then give the heads this rank's KV cache and attention backend hold.
    A group of one leaves the model as it is.
    """
    model = dense_target(model)
    if tp.size == 1:
        return
    cfg = model.cfg
    check_heads_split(cfg, tp)
    model.model.embed_tokens, model.lm_head = shard_vocab(model, tp)
    for layer in model.model.layers:
        shard_attention(layer.self_attn, tp)
        shard_mlp(layer.mlp, cfg.intermediate_size, tp)
    model.local_num_heads, model.local_num_kv_heads = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size


# -- DeepSeek-V4 -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartialSum:
    """The sum over `tp` of each rank's partial product (`_sum_over_ranks`: on the CPU in rank order, so a
    row's result does not depend on the rows beside it), for a model whose layers keep their weights as
    tensors (`DSV4Layer.partial_sum`)."""

    tp: TPGroup

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        return _sum_over_ranks(partial, self.tp)
