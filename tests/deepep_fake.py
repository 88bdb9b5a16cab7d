"""A stand-in for DeepEP (`deep_ep`), for expert parallelism's tests on the CPU: DeepEP runs on CUDA only and
is never installed here. `Buffer`'s normal-mode (high-throughput, intranode) `get_dispatch_layout`,
`dispatch` and `combine` follow DeepEP's documented semantics (its `deep_ep/buffer.py` docstrings) over
torch.distributed, and check their arguments as DeepEP does: rows bfloat16 [T, H], expert ids int64 [T, k]
(-1: none), weights float32 [T, k]; a row goes once to every rank holding one of its experts, in row order
per source rank, with the receiving rank's local expert ids (-1 for the others); `combine` adds, without
weights, the parts coming back to each row (here in ascending rank order, in float32) and returns bfloat16.
The cached-handle dispatch, events, low-latency mode and internode (RDMA) buffers are not modelled."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor


class EventOverlap:
    """DeepEP's event wrapper: nothing is asynchronous here."""

    def current_stream_wait(self) -> None:
        pass


class Config:
    def __init__(self, num_sms: int, *tuning: int) -> None:
        self.num_sms, self.tuning = num_sms, tuning

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes * num_ranks * 4096  # a size that holds the tests' rows

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0  # intranode: no RDMA buffer


def _exchange(send: Tensor, send_counts: list[int], recv_counts: list[int], group: Any) -> Tensor:
    """all_to_all_single by per-rank counts; bfloat16 (gloo does not carry it) travels as float32, exactly."""
    wire = send.float() if send.dtype == torch.bfloat16 else send
    recv = wire.new_empty(sum(recv_counts), *wire.shape[1:])
    dist.all_to_all_single(recv, wire.contiguous(), recv_counts, send_counts, group=group)
    return recv.to(send.dtype)


class Buffer:
    num_sms = 20
    created: list[Buffer] = []

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 12,
                 allow_nvlink_for_low_latency_mode: bool = True) -> None:
        assert num_nvl_bytes > 0 and not low_latency_mode, "intranode normal mode needs an NVLink buffer"
        self.group, self.rank, self.group_size = group, dist.get_rank(group), dist.get_world_size(group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.calls: list[str] = []
        Buffer.created.append(self)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, 24, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, 10, 256, 6, 128)

    def get_dispatch_layout(self, topk_idx: Tensor, num_experts: int, previous_event: Any = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> tuple[Tensor, None, Tensor, Tensor, EventOverlap]:
        assert topk_idx.dtype == torch.int64 and topk_idx.dim() == 2, "topk_idx must be int64 [T, k]"
        assert num_experts % self.group_size == 0
        self.calls.append("get_dispatch_layout")
        per = num_experts // self.group_size
        valid = topk_idx >= 0
        owner = torch.where(valid, topk_idx // per, -1)
        in_rank = torch.stack([(owner == r).any(1) for r in range(self.group_size)], dim=1)  # [T, R]
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        return in_rank.sum(0).to(torch.int32), None, per_expert, in_rank, EventOverlap()

    def dispatch(self, x: Tensor, handle: Any = None, num_tokens_per_rank: Tensor | None = None,
                 num_tokens_per_rdma_rank: Tensor | None = None, is_token_in_rank: Tensor | None = None,
                 num_tokens_per_expert: Tensor | None = None, topk_idx: Tensor | None = None,
                 topk_weights: Tensor | None = None, expert_alignment: int = 1, config: Config | None = None,
                 previous_event: Any = None, async_finish: bool = False, allocate_on_comm_stream: bool = False
                 ) -> tuple[Tensor, Tensor, Tensor, list[int], tuple[Any, ...], EventOverlap]:
        assert handle is None, "the cached-handle dispatch is not modelled"
        assert x.dtype == torch.bfloat16 and x.dim() == 2, "x must be bfloat16 [T, H]"
        assert topk_idx is not None and topk_idx.dtype == torch.int64
        assert topk_weights is not None and topk_weights.dtype == torch.float32
        assert topk_weights.shape == topk_idx.shape and topk_idx.shape[0] == x.shape[0]
        assert num_tokens_per_rank is not None and is_token_in_rank is not None
        assert num_tokens_per_expert is not None and num_tokens_per_rdma_rank is None  # intranode
        self.calls.append("dispatch")
        size = self.group_size
        per = num_tokens_per_expert.shape[0] // size
        send_idx = torch.cat([torch.nonzero(is_token_in_rank[:, r], as_tuple=True)[0] for r in range(size)])
        send_counts = num_tokens_per_rank.tolist()
        recv_counts_t = torch.empty_like(num_tokens_per_rank)
        dist.all_to_all_single(recv_counts_t, num_tokens_per_rank, group=self.group)
        recv_counts = recv_counts_t.tolist()
        recv_x = _exchange(x[send_idx], send_counts, recv_counts, self.group)
        recv_ids = _exchange(topk_idx[send_idx], send_counts, recv_counts, self.group)
        recv_weights = _exchange(topk_weights[send_idx], send_counts, recv_counts, self.group)
        mine = (recv_ids >= 0) & (recv_ids // per == self.rank)
        local = torch.where(mine, recv_ids - self.rank * per, -1)
        counts = [int((local == e).sum()) for e in range(per)]
        aligned = [-(-c // expert_alignment) * expert_alignment for c in counts]
        handle = (send_idx, send_counts, recv_counts, x.shape[0])
        return recv_x, local, recv_weights, aligned, handle, EventOverlap()

    def combine(self, x: Tensor, handle: tuple[Any, ...], topk_weights: Tensor | None = None,
                config: Config | None = None, previous_event: Any = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple[Tensor, None, EventOverlap]:
        send_idx, send_counts, recv_counts, n_rows = handle
        assert x.dtype == torch.bfloat16 and x.shape[0] == sum(recv_counts), "x: the rows dispatched, bf16"
        self.calls.append("combine")
        back = _exchange(x, recv_counts, send_counts, self.group)  # each row's part from each rank it went to
        out = torch.zeros(n_rows, x.shape[1], dtype=torch.float32)
        start = 0
        for count in send_counts:  # the parts added in ascending rank order
            rows = send_idx[start:start + count]
            out[rows] = out[rows] + back[start:start + count].float()
            start += count
        return out.to(torch.bfloat16), None, EventOverlap()


def install_fake_deepep(monkeypatch: pytest.MonkeyPatch | None = None) -> types.ModuleType:
    """Put a `deep_ep` module with this `Buffer` in sys.modules (undone with `monkeypatch` where given)."""
    module = types.ModuleType("deep_ep")
    module.Buffer = Buffer  # type: ignore[attr-defined]
    module.Config = Config  # type: ignore[attr-defined]
    if monkeypatch is None:
        sys.modules["deep_ep"] = module
    else:
        monkeypatch.setitem(sys.modules, "deep_ep", module)
    return module
