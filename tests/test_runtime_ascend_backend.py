"""The Ascend attention backend's calls into torch_npu, against a stand-in that records them.

torch_npu is never installed in the CPU test environment, so a fake module takes its place: it
computes the operator with the CPU reference model of its TND semantics and records how it was
called. What is checked is the backend's side of the protocol: the host lengths become the
operator's lists once per step (not once per layer), a captured graph's layers share one
workspace per tier, and `update_captured` re-issues every task of a tier with the new lengths.
"""

from __future__ import annotations

import sys
import types
from contextlib import nullcontext
from typing import Any

import pytest
import torch

from dspark.runtime.attention.ascend import AscendFusedAttention, reference_fused_infer_attention_tnd
from dspark.runtime.attention.metadata import AscendTndMetadata
from dspark.runtime.kv_cache import PagedKVCache

PAGE, HEADS, KV_HEADS, DIM, LAYERS = 4, 4, 2, 8, 3


class FakeNpu:
    """`torch_npu` and `torch.npu` in one object, recording what the backend asks of them."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.workspace_queries = 0
        self.task_groups = 0
        self.updates = 0
        self.log: list[str] = []

    # torch_npu's operators
    def npu_fused_infer_attention_score(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                        **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append(kw)
        out = reference_fused_infer_attention_tnd(
            q, key, value, actual_seq_lengths=torch.tensor(kw["actual_seq_lengths"]),
            actual_seq_lengths_kv=torch.tensor(kw["actual_seq_lengths_kv"]), block_table=kw["block_table"],
            block_size=kw["block_size"], num_heads=kw["num_heads"],
            num_key_value_heads=kw["num_key_value_heads"], scale=kw["scale"])
        return out, torch.empty(1)

    def _npu_fused_infer_attention_score_get_max_workspace(self, *args: Any, **kw: Any) -> torch.Tensor:
        self.workspace_queries += 1
        return torch.empty(16)

    # torch.npu's stream and graph-task API; `log` orders stream waits against task updates
    def current_stream(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(name="compute")

    def Stream(self) -> types.SimpleNamespace:  # noqa: N802  (torch.npu's name)
        return types.SimpleNamespace(name="update", wait_stream=lambda other: self.log.append(
            f"update waits {other.name}"))

    def stream(self, s: object) -> nullcontext[None]:
        return nullcontext()

    def ExternalEvent(self) -> types.SimpleNamespace:  # noqa: N802
        return types.SimpleNamespace(wait=lambda s: None, reset=lambda s: None, record=lambda s: None)

    def graph_task_group_begin(self, stream: object) -> None:
        pass

    def graph_task_group_end(self, stream: object) -> int:
        self.task_groups += 1
        return self.task_groups

    def graph_task_update_begin(self, stream: object, handle: int) -> None:
        self.updates += 1
        self.log.append(f"update task {handle}")

    def graph_task_update_end(self, stream: object) -> None:
        pass


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> FakeNpu:
    fake = FakeNpu()

    class Operator:  # callable, with the `.out` variant that captured tasks call
        def __call__(self, *args: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
            return fake.npu_fused_infer_attention_score(*args, **kw)

        def out(self, *args: Any, workspace: torch.Tensor, out: list[torch.Tensor], **kw: Any) -> None:
            out[0].copy_(fake.npu_fused_infer_attention_score(*args, **kw)[0])

    module = types.ModuleType("torch_npu")
    module.npu_fused_infer_attention_score = Operator()
    module._npu_fused_infer_attention_score_get_max_workspace = (
        fake._npu_fused_infer_attention_score_get_max_workspace)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    return fake


def step_metadata(q_lens: list[int], prefix: list[int]) -> AscendTndMetadata:
    ends = torch.tensor(q_lens).cumsum(0).tolist()
    kv = [p + q for p, q in zip(prefix, q_lens, strict=True)]
    table = torch.arange(len(q_lens) * 4, dtype=torch.int32).view(len(q_lens), 4)
    positions = torch.cat([torch.arange(p, p + q) for p, q in zip(prefix, q_lens, strict=True)])
    req = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    slots = table[req, positions // PAGE].long() * PAGE + positions % PAGE
    return AscendTndMetadata(
        actual_seq_lengths_q=torch.tensor(ends, dtype=torch.int32),
        actual_seq_lengths_kv=torch.tensor(kv, dtype=torch.int32), block_table=table, block_size=PAGE,
        positions=positions, slot_mapping=slots, max_seqlen_q=max(q_lens),
        host_seq_lengths_q=tuple(ends), host_seq_lengths_kv=tuple(kv))


def backend() -> AscendFusedAttention:
    cache = PagedKVCache(LAYERS, 16, PAGE, KV_HEADS, DIM, torch.float32)
    return AscendFusedAttention(cache, PAGE, HEADS, DIM ** -0.5)


def qkv(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    return (torch.randn(rows, HEADS, DIM, generator=g), torch.randn(rows, KV_HEADS, DIM, generator=g),
            torch.randn(rows, KV_HEADS, DIM, generator=g))


def test_eager_steps_pass_the_host_lengths_built_once_per_step(npu: FakeNpu) -> None:
    attn = backend()
    for lens, prefix in (([2, 1, 3], [3, 5, 0]), ([1, 1, 1], [5, 6, 3])):
        meta = step_metadata(lens, prefix)
        q, k, v = qkv(sum(lens))
        outs = [attn.attend(layer, q, k, v, meta) for layer in range(LAYERS)]
        calls = npu.calls[-LAYERS:]
        assert all(c["actual_seq_lengths"] == list(meta.host_seq_lengths_q) for c in calls)
        assert all(c["actual_seq_lengths_kv"] == list(meta.host_seq_lengths_kv) for c in calls)
        # the lists were built once for the step: every layer passes the same objects
        assert all(c["actual_seq_lengths"] is calls[0]["actual_seq_lengths"] for c in calls)
        assert all(c["actual_seq_lengths_kv"] is calls[0]["actual_seq_lengths_kv"] for c in calls)
        assert calls[0]["input_layout"] == "TND" and calls[0]["sparse_mode"] == 3
        assert all(torch.equal(o, outs[0]) for o in outs)  # same inputs in every layer here
    assert npu.calls[0]["actual_seq_lengths"] is not npu.calls[-1]["actual_seq_lengths"]  # a new step


def test_a_captured_tier_shares_one_workspace_and_updates_every_layer(npu: FakeNpu) -> None:
    attn = backend()
    for tier, lens in ((8, [4, 4]), (16, [8, 8])):
        meta = step_metadata(lens, [0, 4])
        q, k, v = qkv(tier)
        with attn.capturing(tier):
            for layer in range(LAYERS):
                attn.attend(layer, q, k, v, meta)
    assert npu.workspace_queries == 2  # one per tier, not one per layer
    assert npu.task_groups == 2 * LAYERS
    tasks = attn._tasks[8]
    assert len(tasks) == LAYERS and all(t.workspace is tasks[0].workspace for t in tasks)
    assert attn._tasks[16][0].workspace is not tasks[0].workspace
    before = len(npu.calls)
    attn.update_captured(8, [3, 8], [6, 9])
    assert npu.updates == LAYERS
    # every patch waits for the work already queued on the compute stream (the previous replay)
    assert npu.log == ["update waits compute"] + [f"update task {t.handle}" for t in tasks]
    assert [c["actual_seq_lengths"] for c in npu.calls[before:]] == [[3, 8]] * LAYERS
    assert [c["actual_seq_lengths_kv"] for c in npu.calls[before:]] == [[6, 9]] * LAYERS
