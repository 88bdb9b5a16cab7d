"""Ascend attention over `AscendTndMetadata` through `torch_npu.npu_fused_infer_attention_score`.

`torch_npu` is imported only when this backend is constructed on an Ascend machine: installed
elsewhere it breaks `import torch`, and nothing here is needed to build or test the metadata.

`reference_fused_infer_attention_tnd` implements the operator's documented TND semantics on
plain torch so the generated Ascend metadata can be checked on any CPU:

* `query` is `[T, H, D]` with requests packed back to back; `actual_seq_lengths[b]` is the
  cumulative end of request b's rows (so request b owns rows `[ends[b-1], ends[b])`);
* with a `block_table`, `key`/`value` are the paged caches `[num_blocks, block_size, Hkv * D]`
  and `actual_seq_lengths_kv[b]` is request b's KV length (not cumulative);
* `sparse_mode=3` is the right-down causal mask: the last query row of a request sees all of
  its KV, and row i of `q_b` rows sees keys `j <= kv_b - q_b + i`;
* grouped-query attention maps query head h to KV head `h // (H // Hkv)`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from dspark.runtime.attention.metadata import AscendTndMetadata
from dspark.runtime.kv_cache import PagedKVCache

RIGHT_DOWN_CAUSAL = 3
COMPRESSED_MASK_SIZE = 2048  # sparse_mode 3 takes a 2048 x 2048 upper-triangular mask


def reference_fused_infer_attention_tnd(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
    actual_seq_lengths: torch.Tensor, actual_seq_lengths_kv: torch.Tensor,
    block_table: torch.Tensor, block_size: int, num_heads: int, num_key_value_heads: int,
    scale: float, sparse_mode: int = RIGHT_DOWN_CAUSAL,
) -> torch.Tensor:
    """CPU model of `npu_fused_infer_attention_score(input_layout="TND")` with paged KV."""
    if sparse_mode != RIGHT_DOWN_CAUSAL:
        raise NotImplementedError("only sparse_mode=3 (right-down causal) is modelled")
    head_dim = query.shape[-1]
    group = num_heads // num_key_value_heads
    out = torch.zeros_like(query)
    start = 0
    for b, end in enumerate(actual_seq_lengths.tolist()):
        kv_len = int(actual_seq_lengths_kv[b])
        q_len = end - start
        if q_len == 0:
            continue
        pos = torch.arange(kv_len)
        blocks = block_table[b, pos // block_size].long()
        k = key[blocks, pos % block_size].view(kv_len, num_key_value_heads, head_dim)
        v = value[blocks, pos % block_size].view(kv_len, num_key_value_heads, head_dim)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[start:end].transpose(0, 1).float()
        scores = q @ k.float().transpose(1, 2) * scale
        limit = kv_len - q_len + torch.arange(q_len)
        scores = scores.masked_fill(pos[None, None, :] > limit[None, :, None], float("-inf"))
        out[start:end] = (scores.softmax(-1) @ v.float()).transpose(0, 1).to(query.dtype)
        start = end
    return out


def import_torch_npu() -> ModuleType:
    """torch_npu, imported where an Ascend backend is built and nowhere else: installed on a machine
    without an NPU it breaks `import torch`, so no module imports it at load time."""
    try:
        import torch_npu  # registers the NPU device and its operators
    except (ImportError, RuntimeError, OSError) as err:
        raise RuntimeError(
            "the Ascend backend needs torch_npu on an Ascend machine (pip install "
            "'dspark[ascend]'); to dry-run this deployment here, compile it with "
            "backend.kind: cpu") from err
    return torch_npu


@dataclass
class _CapturedTask:
    """One layer's attention inside a captured NPU graph, kept so it can be re-issued."""

    handle: Any
    event: Any
    args: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    kwargs: dict[str, Any]
    workspace: torch.Tensor
    out: list[torch.Tensor]


class AscendFusedAttention:
    """Paged attention on an Ascend NPU (the fused infer-attention operator, TND layout).

    Eager calls pass the step's lengths directly. Inside `capturing(key)` each call is recorded
    as an updatable task group (torch_npu's `graph_task_group_begin/end`); `update_captured`
    re-issues those tasks with a later step's lengths before the graph is replayed.
    """

    def __init__(self, cache: PagedKVCache, page_size: int, num_heads: int, scale: float) -> None:
        self._torch_npu = import_torch_npu()
        self.cache = cache
        self.page_size = page_size
        self.num_heads = num_heads
        self.scale = scale
        self.mask = torch.triu(torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE,
                                          dtype=torch.bool, device=cache.k.device), diagonal=1)
        self._capture_key: int | None = None
        self._tasks: dict[int, list[_CapturedTask]] = {}
        # The layers of one graph run one after another on one stream, so they share one workspace,
        # sized once for the tier (the operator's maximum for its shapes), instead of one per layer.
        self._workspaces: dict[int, torch.Tensor] = {}
        self._update_stream: Any = None
        self._kwargs_for: tuple[AscendTndMetadata, int] | None = None  # the step whose kwargs are below
        self._kwargs: dict[str, Any] = {}

    @contextmanager
    def capturing(self, key: int) -> Iterator[None]:
        """Record attention calls as updatable tasks of graph `key` (their sequence lengths come from
        the host fields of the metadata being captured)."""
        self._capture_key = key
        self._tasks[key] = []
        try:
            yield
        finally:
            self._capture_key = None

    def update_captured(self, key: int, q_ends: list[int], kv_lens: list[int]) -> None:
        """Point graph `key`'s attention tasks at this step's query ends and KV lengths.

        Fixed-width steps pass the captured query ends again; compact steps change both.
        """
        npu = torch.npu  # registered by torch_npu
        if self._update_stream is None:
            self._update_stream = npu.Stream()
        # The patch is ordered after everything already queued on the compute stream, the previous
        # replay of this graph included, so a task is never rewritten while it may still run; the
        # events recorded below make the next replay wait for the patch.
        self._update_stream.wait_stream(npu.current_stream())
        with npu.stream(self._update_stream):
            for task in self._tasks[key]:
                npu.graph_task_update_begin(self._update_stream, task.handle)
                self._torch_npu.npu_fused_infer_attention_score.out(
                    *task.args, workspace=task.workspace, out=task.out,
                    **{**task.kwargs, "actual_seq_lengths": q_ends, "actual_seq_lengths_kv": kv_lens})
                npu.graph_task_update_end(self._update_stream)
                task.event.record(self._update_stream)

    def _operator_kwargs(self, meta: AscendTndMetadata, num_kv: int) -> dict[str, Any]:
        """The operator's keyword arguments for this step, built at its first layer and reused by the
        others: the host lengths become the operator's lists once per step, not once per layer."""
        if self._kwargs_for is None or self._kwargs_for[0] is not meta or self._kwargs_for[1] != num_kv:
            self._kwargs = {"atten_mask": self.mask,
                            "actual_seq_lengths": list(meta.host_seq_lengths_q),
                            "actual_seq_lengths_kv": list(meta.host_seq_lengths_kv),
                            "block_table": meta.block_table, "block_size": meta.block_size,
                            "num_heads": self.num_heads, "num_key_value_heads": num_kv, "scale": self.scale,
                            "input_layout": "TND", "sparse_mode": RIGHT_DOWN_CAUSAL}
            self._kwargs_for = (meta, num_kv)
        return self._kwargs

    def _capture_call(self, args: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                      kwargs: dict[str, Any]) -> torch.Tensor:
        npu = torch.npu
        stream = npu.current_stream()
        key = self._capture_key
        assert key is not None
        workspace = self._workspaces.get(key)
        if workspace is None:
            workspace = self._torch_npu._npu_fused_infer_attention_score_get_max_workspace(*args, **kwargs)
            self._workspaces[key] = workspace
        q = args[0]
        out = [torch.empty_like(q), torch.empty(1, dtype=q.dtype, device=q.device)]
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        self._torch_npu.npu_fused_infer_attention_score.out(*args, workspace=workspace, out=out, **kwargs)
        handle = npu.graph_task_group_end(stream)
        self._tasks[key].append(_CapturedTask(handle, event, args, kwargs, workspace, out))
        return out[0]

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AscendTndMetadata) -> torch.Tensor:
        self.cache.write(layer_id, meta.slot_mapping, k, v)
        num_kv = k.shape[1]
        key = self.cache.k[layer_id].view(-1, self.page_size, num_kv * k.shape[2])
        value = self.cache.v[layer_id].view(-1, self.page_size, num_kv * v.shape[2])
        kwargs = self._operator_kwargs(meta, num_kv)
        if self._capture_key is not None:
            return self._capture_call((q, key, value), kwargs)
        out, _ = self._torch_npu.npu_fused_infer_attention_score(q, key, value, **kwargs)
        return out
