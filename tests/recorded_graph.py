"""A recording of every op stands in for a CUDA graph capture on the CPU: captured code that reads a
device value on the host, allocates its inputs anew or bakes a host value in, replays wrong or fails."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

T = TypeVar("T")


def _aliases(out: Any, args: tuple[Any, ...]) -> bool:
    """Whether a view-kind op returned a view of an input (`aten.to` is one by its schema, and copies when
    the dtype or device changes: such a copy is new memory a replay must write)."""
    if not isinstance(out, torch.Tensor):
        return True
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    return out.untyped_storage().data_ptr() in inputs


class RecordedGraph(TorchDispatchMode):
    """Records every op issued inside (views alias and need no replay) and replays them in order on the same
    tensors, as a CUDA graph replays its kernels on the memory its capture allocated. A host read inside
    fails, as it would inside a capture."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Callable[[], None]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("a device value was read on the host while capturing")
        out = func(*args, **kwargs)
        if func.is_view and _aliases(out, args):
            return out
        if func._schema.is_mutable:
            self.ops.append(lambda: func(*args, **kwargs))
        else:
            def rerun(outs: Any = out) -> None:
                fresh = func(*args, **kwargs)
                for o, n in zip(*((outs, fresh) if isinstance(outs, tuple | list) else ((outs,), (fresh,))),
                                strict=True):
                    o.copy_(n)

            self.ops.append(rerun)
        return out

    def replay(self) -> None:
        with torch.inference_mode():  # a replay launches the captured kernels (on inference tensors too)
            for op in self.ops:
                op()


class RecordedGraphs:
    """`runners.graphs.GraphApi` over `RecordedGraph`: warmed up once, then recorded."""

    def __init__(self) -> None:
        self.captured: list[RecordedGraph] = []

    def capture(self, forward: Callable[[], T], context: AbstractContextManager[Any]) -> tuple[Any, T]:
        forward()
        graph = RecordedGraph()
        with context, graph:
            outputs = forward()
        self.captured.append(graph)
        return graph, outputs
