"""A stand-in for torch_npu and torch.npu, for the DSV4 Ascend backends' tests on the CPU.

torch_npu is never installed in the CPU test environment, so a fake module takes its place: its operators
are the CPU models of `dspark.runtime.families.dsv4.ascend_op_models`, and it checks each call against the
operators' schemas (every length is an int32 tensor, `Tensor?` in the schema; the tiling operators' integers
are Python ints). `device_only` wraps a step's device arrays so that reading their values on the host fails.
A fake NPU graph records what a stream capture would (the operators' launches and the caller's own tensor
ops) and replays it on the same memory, so a captured tier can be checked after `update_captured` against an
eager run of the new step. Streams and events only log what is asked of them, in order (`FakeNpu.log`).
`index_quant_everywhere` makes a CPU package a reference for an Ascend one (its indexer scored int8).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.runtime.families.dsv4 import Dsv4VerifyMetadata
from dspark.runtime.families.dsv4.ascend_op_models import (
    reference_quant_lightning_indexer,
    reference_sparse_attn_sharedkv,
)
from dspark.runtime.families.dsv4.ascend_quant_op_models import (
    reference_dynamic_quant,
    reference_quant_matmul,
)

SAS, SAS_PLAN = "npu_sparse_attn_sharedkv", "npu_sparse_attn_sharedkv_metadata"
DYNAMIC_QUANT, QUANT_MATMUL = "npu_dynamic_quant", "npu_quant_matmul"  # a W8A8 linear's two operators
LI, LI_PLAN = "npu_quant_lightning_indexer", "npu_quant_lightning_indexer_metadata"
LENGTHS = ("cu_seqlens_q", "seqused_kv", "actual_seq_lengths_query", "actual_seq_lengths_key")
HOST_INTS = ("batch_size", "max_seqlen_q", "max_seqlen_kv", "max_seqlen_k", "sparse_count", "cmp_ratio",
             "cmp_topk", "num_heads_q", "num_heads_kv", "num_heads_k", "head_dim", "ori_win_left")


class DeviceOnly(torch.Tensor):
    """A device array: the backend may hand it to operators and copy it on the device, never read it back."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the backend read a device tensor's values on the host")

    tolist = item = numpy = __int__ = __index__ = __float__ = __bool__ = _refuse


def device_only(meta: Dsv4VerifyMetadata) -> Dsv4VerifyMetadata:
    """`meta` with every device array wrapped in DeviceOnly (the host arrays untouched)."""
    def wrap(arrays: Any) -> Any:
        return dataclasses.replace(arrays, **{f.name: getattr(arrays, f.name).as_subclass(DeviceOnly)
                                              for f in dataclasses.fields(arrays)})

    compressed = {r: dataclasses.replace(p, device=wrap(p.device)) for r, p in meta.compressed.items()}
    return dataclasses.replace(meta, device=wrap(meta.device), compressed=compressed)


def plain(x: Any) -> Any:
    return x.as_subclass(torch.Tensor) if isinstance(x, torch.Tensor) else x


def index_quant_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every backend's model configured as Ascend's (`Dsv4Geometry.for_backend("ascend")`: the lightning
    indexer scored int8), so a CPU package computes what an Ascend package computes (undone with
    `monkeypatch`)."""
    for_backend = Dsv4Geometry.for_backend
    monkeypatch.setattr(Dsv4Geometry, "for_backend", lambda g, _backend: for_backend(g, "ascend"))


# ----------------------------------------------------------------------------------------------------------
# the stand-in for torch_npu and torch.npu


class FakeGraph:
    """What a stream capture records, replayed in order on the same tensors."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, Callable[[], Any]]] = []

    def record_op(self, name: str, run: Callable[[], Any], result: Any) -> None:
        outs = result if isinstance(result, tuple) else (result,)

        def replay() -> None:  # a replayed kernel writes the memory its captured launch allocated
            fresh = run()
            for out, new in zip(outs, fresh if isinstance(fresh, tuple) else (fresh,), strict=True):
                out.copy_(new)

        self.entries.append((name, replay))

    def pool(self) -> FakeGraph:  # a CUDA graph's memory pool, which later captures share
        return self

    def replay(self) -> None:
        with torch.inference_mode():  # a replay launches the captured kernels (on inference tensors too)
            for _, entry in self.entries:
                entry()


def _aliases(out: Any, args: tuple[Any, ...]) -> bool:
    """Whether a view-kind op returned a view of an input (`aten.to` counts as one, and copies when the
    dtype or device changes: such a copy is new memory a replay must write)."""
    if not isinstance(out, torch.Tensor):
        return True
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    return out.untyped_storage().data_ptr() in inputs


class _Capture(TorchDispatchMode):
    """Records the backend's own tensor ops issued while capturing (views alias and need no replay)."""

    def __init__(self, npu: FakeNpu, graph: FakeGraph) -> None:
        super().__init__()
        self.npu, self.graph = npu, graph

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.npu.inside_op or (func.is_view and _aliases(out, args)):
            return out
        if func.namespace == "c10d":  # a collective: it writes its tensors in place; a replay waits for it
            def collective() -> None:
                for item in func(*args, **kwargs):
                    if hasattr(item, "wait"):
                        item.wait()

            self.graph.entries.append((str(func), collective))
        elif func._schema.is_mutable:
            self.graph.entries.append((str(func), lambda: func(*args, **kwargs)))
        else:  # a replay writes the captured outputs' memory (a tensor, or each of a tuple's: sort, topk)
            outs = out if isinstance(out, tuple) else (out,)
            assert all(isinstance(o, torch.Tensor) for o in outs), f"the fake graph cannot capture {func}"

            def replay() -> None:
                fresh = func(*args, **kwargs)
                for o, f in zip(outs, fresh if isinstance(fresh, tuple) else (fresh,), strict=True):
                    o.copy_(f)

            self.graph.entries.append((str(func), replay))
        return out


class FakeNpu:
    """`torch_npu`'s DSV4 operators and `torch.npu`'s stream / event API, recording what the backend asks."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.log: list[str] = []
        self.stream_name = "compute"
        self.capturing: FakeGraph | None = None  # the graph being captured
        self.inside_op = 0
        self.plans = 0
        self.plan_heads: dict[int, int] = {}  # plan id -> the query heads it was made for
        self.events = 0

    def _call(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        for key in LENGTHS:
            if key in kw:
                value = kw[key]
                assert isinstance(value, torch.Tensor) and value.dtype == torch.int32, (
                    f"{name}: {key} is Tensor? (int32) in the schema, got {type(value).__name__}")
        for key in HOST_INTS:
            if key in kw:
                assert type(kw[key]) is int, f"{name}: {key} must be an int, got {type(kw[key]).__name__}"
        self.calls.append((name, kw))
        self.log.append(f"{name}@{self.stream_name}")
        args_ = tuple(plain(a) for a in args)
        kw_ = {k: plain(v) for k, v in kw.items()}

        def run() -> Any:
            self.inside_op += 1
            try:
                return fn(*args_, **kw_)
            finally:
                self.inside_op -= 1

        result = run()
        if self.capturing is not None and not self.inside_op:
            self.capturing.record_op(name, run, result)
        return result

    # the operators, computed by the CPU models
    def _sas(self, q: torch.Tensor, *, metadata: torch.Tensor, **kw: Any
             ) -> tuple[torch.Tensor, torch.Tensor]:
        assert metadata.dtype == torch.int32 and metadata.shape == (1024,)
        self._check_heads(metadata, q)
        assert int(kw["seqused_kv"].min()) >= 1  # the device side may read it: padding slots too
        return reference_sparse_attn_sharedkv(q, **kw), torch.empty(0)

    def _plan(self, **kw: Any) -> torch.Tensor:
        self.plans += 1  # each plan is distinguishable, so a refreshed buffer shows which one it holds
        self.plan_heads[self.plans] = kw["num_heads_q"]
        return torch.full((1024,), self.plans, dtype=torch.int32)

    def _check_heads(self, metadata: torch.Tensor, query: torch.Tensor) -> None:
        """The plan the operator runs was made for the query's heads (under TP, the rank's own)."""
        planned = self.plan_heads[int(metadata[0])]
        assert planned == query.shape[1], f"planned for {planned} query heads, run on {query.shape[1]}"

    def _indexer(self, *, query: torch.Tensor, key: torch.Tensor, weights: torch.Tensor,
                 query_dequant_scale: torch.Tensor, key_dequant_scale: torch.Tensor, query_quant_mode: int,
                 key_quant_mode: int, metadata: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        assert query_quant_mode == 0 and key_quant_mode == 0 and metadata.shape == (1024,)
        self._check_heads(metadata, query)
        return reference_quant_lightning_indexer(query, key, weights, query_dequant_scale=query_dequant_scale,
                                                 key_dequant_scale=key_dequant_scale, **kw)

    def npu_sparse_attn_sharedkv(self, q: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self._call(SAS, self._sas, (q,), kw)

    def npu_sparse_attn_sharedkv_metadata(self, **kw: Any) -> torch.Tensor:
        return self._call(SAS_PLAN, self._plan, (), kw)

    def npu_quant_lightning_indexer(self, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self._call(LI, self._indexer, (), kw)

    def npu_quant_lightning_indexer_metadata(self, **kw: Any) -> torch.Tensor:
        return self._call(LI_PLAN, self._plan, (), kw)

    def npu_dynamic_quant(self, x: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self._call(DYNAMIC_QUANT, reference_dynamic_quant, (x,), kw)

    def npu_quant_matmul(self, x1: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, **kw: Any
                         ) -> torch.Tensor:
        return self._call(QUANT_MATMUL, reference_quant_matmul, (x1, x2, scale), kw)

    # torch.npu
    def current_stream(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(name=self.stream_name)

    def Stream(self) -> types.SimpleNamespace:  # noqa: N802  (torch.npu's name)
        return types.SimpleNamespace(name="update", wait_stream=lambda other: self.log.append(
            f"update waits {other.name}"))

    @contextmanager
    def stream(self, s: types.SimpleNamespace) -> Iterator[None]:
        before, self.stream_name = self.stream_name, s.name
        try:
            yield
        finally:
            self.stream_name = before

    def ExternalEvent(self) -> types.SimpleNamespace:  # noqa: N802
        self.events += 1
        n = self.events

        def wait(stream: Any) -> None:
            self.log.append(f"event{n} wait@{stream.name}")
            if self.capturing is not None:
                self.capturing.entries.append((f"event{n} wait", lambda: None))

        return types.SimpleNamespace(wait=wait, reset=lambda stream: None,
                                     record=lambda stream: self.log.append(f"event{n} record@{stream.name}"))

    @contextmanager
    def graph_capture(self, graph: FakeGraph) -> Iterator[None]:
        self.capturing = graph
        try:
            with _Capture(self, graph):
                yield
        finally:
            self.capturing = None

    # torch.npu's graph API, as a generated runner calls it
    NPUGraph = FakeGraph
    graph = graph_capture


_REAL_CUDA = torch.cuda


class FakeCuda:
    """torch.cuda's graph and stream API as a generated CUDA runner calls it: a capture records into a
    FakeGraph, and every stream is the one the CPU runs everything on, in order."""

    inside_op = 0  # no fake operators here: every op issued while capturing is the caller's
    CUDAGraph = FakeGraph

    def __getattr__(self, name: str) -> Any:  # what torch's own modules read (dynamo's type tables): the real
        return getattr(_REAL_CUDA, name)

    def Stream(self) -> types.SimpleNamespace:  # noqa: N802  (torch.cuda's name)
        return types.SimpleNamespace(wait_stream=lambda other: None)

    current_stream = Stream

    @contextmanager
    def stream(self, s: types.SimpleNamespace) -> Iterator[None]:
        yield

    @contextmanager
    def graph(self, graph: FakeGraph, pool: object = None) -> Iterator[None]:
        with _Capture(self, graph):  # type: ignore[arg-type]
            yield


OPS = (SAS, SAS_PLAN, LI, LI_PLAN, DYNAMIC_QUANT, QUANT_MATMUL)


def install_fake_npu(monkeypatch: pytest.MonkeyPatch) -> FakeNpu:
    """Put a FakeNpu in the place of the torch_npu module and of torch.npu (undone with `monkeypatch`)."""
    fake = FakeNpu()
    module = types.ModuleType("torch_npu")
    for name in OPS:
        setattr(module, name, getattr(fake, name))
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    return fake
