"""Expert parallelism for DeepSeek-V4's MoE (`parallelism.ep`): the routed experts sharded over the ranks of a
model instance, each token's slots computed on the rank holding their expert.

Rank r of `ep` holds experts `[r·E/ep, (r+1)·E/ep)` (`shard_dsv4_experts`; the router, its bias and hash table
and the shared expert stay whole on every rank). A layer's MoE routes its rows as one process does, then:

* **rows replicated on every rank** (plain tensor parallelism: attention's output is summed over the ranks, so
  all ranks hold the same rows), `ReplicatedRowsExperts`: each rank computes the slots of its own experts
  for all rows, and the slot outputs are all-gathered; a slot's output is taken from its expert's rank;
* **rows differing per rank** (DP attention: a DP rank holds only its requests' rows, every rank the step's
  global tier of them, padding rows routed with their token's valid ids like any other),
  `DispatchedExperts`: each (row, slot) is sent to its expert's rank with its expert id
  (`all_to_all_single` with per-rank counts, the counts exchanged first: the step's shapes agreed), the
  receiving rank runs its experts on what it received and sends the outputs back the same way, where the
  sending rank weights them. A
  DP rank's attention ranks hold the same rows: each dispatches its share of them, and the shares' slot
  outputs are all-gathered among them.

Either way a slot's output is its expert's SwiGLU of that row alone, times its weight, and `MoE.combine`
adds a row's slots in ascending expert id: the bits of one process, whatever rows or ranks share
the step. Padding rows' outputs are computed and discarded by the engine as one process's are. On a CUDA
deployment where DeepEP is installed its dispatch and combine replace the pairs' all-to-all (`DeepEPExperts`,
within bfloat16 rounding of one process). The all-to-all reads its counts on the host, so device backends
that capture graphs take the static-shape path instead (`static_shapes`): every rank's rows all-gathered,
each rank's experts run on all of them and the slot outputs all-gathered back (more traffic and work, no
shape set by the routing).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dspark.runtime.distributed.tensor_parallel import (
    COMM_CLOCK,
    TPGroup,
    gather_rows,
    own_rows,
)
from dspark.runtime.families.dsv4.moe import MoE
from dspark.runtime.families.dsv4.target import Dsv4ForCausalLM
from dspark.runtime.families.dsv4.w8a8 import kept


def check_experts_split(n_experts: int, ep: TPGroup) -> None:
    if n_experts % ep.size:
        raise ValueError(f"expert parallelism over {ep.size} ranks needs n_routed_experts ({n_experts}) to "
                         f"be a multiple of {ep.size}")


class ReplicatedRowsExperts:
    """Slots over `ep` ranks that all hold the same rows: each computes its experts' slots, all-gathered."""

    def __init__(self, ep: TPGroup) -> None:
        self.ep = ep

    def routed(self, moe: MoE, x: Tensor, ids: Tensor, weights: Tensor,
               static_shapes: bool = False) -> Tensor:
        local = moe.slot_outputs(x, ids, weights, static_shapes)  # [L, k, dim], this rank's experts' slots
        return MoE.combine(_from_owners(local, ids, moe.experts.w1.shape[0], self.ep))


def _from_owners(local: Tensor, ids: Tensor, held: int, ep: TPGroup) -> Tensor:
    """Every rank's slot outputs [L, k, dim] for the same rows, all-gathered: each slot from its expert's
    rank."""
    every = gather_rows(local, ep).view(ep.size, *local.shape)  # [ep, L, k, dim]
    owner = ids // held  # [L, k]: the rank holding each slot's expert
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
    return every[owner, rows, torch.arange(ids.shape[1], device=ids.device)]


class DispatchedExperts:
    """Slots over `ep` ranks holding different rows: (row, slot) pairs dispatched to their experts' ranks and
    their outputs combined back. `share`: the ranks that hold the same rows as this one (a DP rank's
    attention ranks): each dispatches its share of them and the shares are all-gathered, so no row is
    computed twice."""

    def __init__(self, ep: TPGroup, share: TPGroup | None = None) -> None:
        self.ep = ep
        self.share = share

    def _exchange(self, send: Tensor, send_counts: list[int], recv_counts: list[int]) -> Tensor:
        recv = send.new_empty(sum(recv_counts), *send.shape[1:])
        with COMM_CLOCK.timed():
            dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=self.ep.group)
        return recv

    def routed(self, moe: MoE, x: Tensor, ids: Tensor, weights: Tensor,
               static_shapes: bool = False) -> Tensor:
        if static_shapes:
            return MoE.combine(self._gathered(moe, x, ids, weights))
        share = self.share
        if share is None or share.size == 1:
            return self._dispatched(moe, x, ids, weights)
        n_rows = x.shape[0]
        per = -(-n_rows // share.size)
        mine = slice(min(n_rows, share.rank * per), min(n_rows, (share.rank + 1) * per))
        part = self._dispatched(moe, x[mine], ids[mine], weights[mine])  # [rows of this share, dim]
        padded = part.new_zeros(per, *part.shape[1:])
        padded[: part.shape[0]] = part
        return gather_rows(padded, share)[:n_rows]

    def _dispatched(self, moe: MoE, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """The routed output [L, dim] of rows x whose slots go to their experts' ranks, pair by pair."""
        n_rows, k = ids.shape
        held = moe.experts.w1.shape[0]
        owner = (ids // held).flatten()  # [L·k]
        order = torch.argsort(owner, stable=True)  # by destination rank, then in (row, slot) order
        counts = torch.bincount(owner, minlength=self.ep.size)
        their = torch.empty_like(counts)
        with COMM_CLOCK.timed():
            dist.all_to_all_single(their, counts, group=self.ep.group)
        send_counts, recv_counts = counts.tolist(), their.tolist()
        got_x = self._exchange(x[order // k], send_counts, recv_counts)
        got_ids = self._exchange(ids.flatten()[order], send_counts, recv_counts)
        # the received pairs as one slot each; weighted here by 1, on the sending rank by their weight
        out = moe.slot_outputs(got_x, got_ids[:, None], torch.ones_like(got_x[:, :1]))[:, 0]
        back = self._exchange(out, recv_counts, send_counts)  # in the order the pairs were sent
        slots = x.new_zeros(n_rows * k, x.shape[-1])
        slots[order] = back * weights.flatten()[order][:, None]
        return MoE.combine(slots.view(n_rows, k, x.shape[-1]))

    def _gathered(self, moe: MoE, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """The graph-safe path (no host reads, no shape set by the routing; every rank passes the step's
        global tier of rows): every rank's rows all-gathered, this rank's experts run on all of them, the
        slot outputs all-gathered back and this rank's rows' slots taken from their experts' ranks."""
        ep = self.ep
        all_ids = gather_rows(ids, ep)
        local = moe.slot_outputs(gather_rows(x, ep), all_ids, gather_rows(weights, ep), static_shapes=True)
        return own_rows(_from_owners(local, all_ids, moe.experts.w1.shape[0], ep), x.shape[0], ep)


class DeepEPExperts(DispatchedExperts):
    """`DispatchedExperts` with DeepEP's normal (high-throughput) dispatch and combine in place of the pairs'
    all-to-all, where DeepEP is installed (CUDA): each row goes once to every rank holding one of its experts
    (`Buffer.get_dispatch_layout`, `Buffer.dispatch`: bfloat16 rows, int64 expert ids, float32 weights; a
    receiving rank sees its own experts' local ids and -1 for the others), the rank adds its experts'
    weighted outputs of the row in ascending expert id, and `Buffer.combine` sums the ranks' partial outputs
    back at the sending rank. DeepEP carries rows in bfloat16 and sums the ranks' parts in its own order, so
    the result is one process's within bfloat16 rounding, not bit for bit (the pairs' all-to-all is exact);
    its normal kernels read the received counts on the host, so a captured graph takes the static-shape path
    as `DispatchedExperts` does."""

    def __init__(self, ep: TPGroup, buffer: Any, share: TPGroup | None = None) -> None:
        super().__init__(ep, share)
        self.buffer = buffer

    def _dispatched(self, moe: MoE, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        held, offset = moe.experts.w1.shape[0], moe.experts.expert_offset
        topk = ids.to(torch.int64)
        buffer = self.buffer
        experts = held * self.ep.size
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, experts)
        with COMM_CLOCK.timed():
            got_x, got_ids, got_weights, _, handle, _ = buffer.dispatch(
                x.to(torch.bfloat16), num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
                is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk,
                topk_weights=weights.to(torch.float32))
        # this rank's experts by their global ids; another rank's slots (-1) match none of them: zeros
        global_ids = torch.where(got_ids >= 0, got_ids + offset, -1)
        slots = moe.slot_outputs(got_x.to(x.dtype), global_ids, got_weights.to(x.dtype))
        with COMM_CLOCK.timed():
            out, _, _ = buffer.combine(MoE.combine(slots).to(torch.bfloat16), handle)
        return out.to(x.dtype)


def deepep_buffer(ep: TPGroup, hidden: int) -> Any | None:
    """A DeepEP `Buffer` over `ep` for rows of `hidden` bfloat16 values, sized by DeepEP's own hints for its
    dispatch and combine configs; None where DeepEP is not installed."""
    try:
        import deep_ep
    except ImportError:
        return None
    hidden_bytes = hidden * torch.finfo(torch.bfloat16).bits // 8
    nvl = rdma = 0
    for config in (deep_ep.Buffer.get_dispatch_config(ep.size), deep_ep.Buffer.get_combine_config(ep.size)):
        nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, ep.size))
        rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, ep.size))
    return deep_ep.Buffer(ep.group, nvl, rdma)


@torch.no_grad()
def shard_dsv4_experts(model: Dsv4ForCausalLM, ep: TPGroup, rows_replicated: bool,
                       share: TPGroup | None = None, deepep: Any | None = None) -> None:
    """Keep this rank's routed experts of every MoE layer, in place, and route the other slots through the
    ranks (`rows_replicated`: plain tensor parallelism, else DP attention, where `share` is this DP rank's
    attention ranks, which hold the same rows, and `deepep` a DeepEP buffer to dispatch with, if any). One
    rank leaves the model whole."""
    cfg = model.model.cfg
    if cfg.ffn != "moe":
        raise ValueError("expert parallelism needs a model with routed experts (ffn: moe)")
    if ep.size == 1:
        return
    check_experts_split(cfg.n_routed_experts, ep)
    held = cfg.n_routed_experts // ep.size
    first = ep.rank * held
    for layer in model.model.layers:
        moe = layer.ffn
        assert moe is not None
        if moe.experts.w1.shape[0] != cfg.n_routed_experts:
            raise ValueError("the experts are already sharded")
        experts = moe.experts
        experts.w1 = kept(experts.w1[first:first + held])
        experts.w3 = kept(experts.w3[first:first + held])
        experts.w2 = kept(experts.w2[first:first + held])
        experts.expert_offset = first
        if rows_replicated:
            moe.parallel = ReplicatedRowsExperts(ep)
        else:
            dispatched = DispatchedExperts(ep, share) if deepep is None else DeepEPExperts(ep, deepep, share)
            moe.parallel = dispatched


__all__ = ["DeepEPExperts", "DispatchedExperts", "ReplicatedRowsExperts", "check_experts_split",
           "deepep_buffer", "shard_dsv4_experts"]
