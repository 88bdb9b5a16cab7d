"""Graph capture under tensor parallelism and DP attention, on the CPU: the tiny H200 compact build (token
tiers, CUDA graphs) recompiled with `tp: 2` and with `tp: 2, dp: 2` and DP attention, run as two gloo ranks
with torch.cuda's graph API replaced by the fake graph of tests/dsv4_fake_npu.py (a capture records the ops a
rank issues, its collectives included, and a replay re-issues them on the same memory) and the CUDA device
by the host. Each rank captures its own graph per tier at start, every rank's verify steps replay them, and
the greedy output equals one process's target-only decoding of the same build, token for token."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dspark.compiler import build

from .dsv4_fake_npu import FakeCuda, FakeGraph
from .gloo_ranks import as_rank, generate_as_rank, spawn_ranks
from .parallel_builds import PROMPTS, REPO

TIERS = [8, 16, 32, 64]
NEW_TOKENS = 16


class _Cuda(FakeCuda):
    """The fake graph API; the paged-attention kernel, whose CPU stand-in reads the step's lengths on the
    host, is captured as one operator that a replay re-runs on the graph's buffers (as the Triton kernel
    reads them on the device)."""

    capturing: FakeGraph | None = None

    @contextmanager
    def graph(self, graph: FakeGraph, pool: object = None) -> Iterator[None]:
        self.capturing = graph
        try:
            with super().graph(graph, pool):
                yield
        finally:
            self.capturing = None

    def install(self) -> None:
        from dspark.runtime.attention import triton_paged

        kernel = triton_paged.paged_attention

        def attention(*args: Any, **kwargs: Any) -> torch.Tensor:
            if self.capturing is None:
                return kernel(*args, **kwargs)
            self.inside_op += 1  # the kernel's own ops are not the caller's
            try:
                out = kernel(*args, **kwargs)
            finally:
                self.inside_op -= 1
            self.capturing.record_op("paged_attention", lambda: kernel(*args, **kwargs), out)
            return out

        triton_paged.paged_attention = attention


def _compile(root: Path, **parallelism: Any) -> Path:
    spec = yaml.safe_load((REPO / "specs" / "tiny_h200_compact.yaml").read_text())
    for section in ("cost_model", "calibration"):
        if section in spec:
            spec[section]["file"] = str(REPO / "specs" / spec[section]["file"])
    suffix = "".join(f"_{k.replace('_', '')}{int(v)}" for k, v in parallelism.items())
    spec["name"] = f"tiny_h200_graphs{suffix}"
    spec["graph"]["token_tiers"] = TIERS
    spec["serving"]["max_running_requests"] = TIERS[-1] // 8  # every step fits the largest tier
    spec["parallelism"] = parallelism
    path = root / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return build(path, root / "generated" / spec["name"], allow_stale_tables=True).package_dir


def _fake_cuda() -> list[int]:
    """torch.cuda's graphs faked on the host; returns the list every replay appends its graph's id to."""
    from dspark.runtime.distributed import launch
    from dspark.runtime.engine import forward

    cuda = _Cuda()
    cuda.install()
    torch.cuda = cuda  # type: ignore[assignment]
    forward.DEVICES["cuda"] = "cpu"  # the fake device's tensors live on the host
    launch.PROCESS_GROUP_BACKENDS["cuda"] = "gloo"
    replays: list[int] = []
    replay = FakeGraph.replay

    def counted(graph: FakeGraph) -> None:
        replays.append(id(graph))
        replay(graph)

    FakeGraph.replay = counted  # type: ignore[method-assign]
    return replays


def _graph_rank(rank: int, size: int, port: int, package_dir: str, prompts: list[list[int]],
                out_dir: str) -> None:
    as_rank(rank, size, port, check=True)
    replays = _fake_cuda()
    result = {"replays": replays, **generate_as_rank(package_dir, prompts, NEW_TOKENS)}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts, and one process's target-only decoding of the one-process build on the fake device."""
    root = tmp_path_factory.mktemp("graphs_reference")
    with pytest.MonkeyPatch.context() as mp:
        from dspark.runtime.attention import triton_paged
        from dspark.runtime.distributed import launch
        from dspark.runtime.engine import forward
        from dspark.runtime.engine.runtime import Runtime
        from dspark.runtime.package import load_package

        cuda = _Cuda()
        mp.setattr(triton_paged, "paged_attention", triton_paged.paged_attention)  # restored after
        cuda.install()
        mp.setattr(torch, "cuda", cuda)
        mp.setitem(forward.DEVICES, "cuda", "cpu")
        mp.setitem(launch.PROCESS_GROUP_BACKENDS, "cuda", "gloo")
        runtime = Runtime(load_package(_compile(root)))
        prompts = [runtime.package.tokenizer.encode(p) for p in PROMPTS]
        want, _ = runtime.generate(prompts, NEW_TOKENS, target_only=True)
    return prompts, want


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", [{"tp": 2}, {"tp": 2, "dp": 2, "dp_attention": True}],
                         ids=["tp2", "tp2-dp2-dp-attention"])
def test_every_rank_replays_its_own_graphs(parallelism: dict[str, Any], reference: Any,
                                           tmp_path: Path) -> None:
    prompts, want = reference
    package = _compile(tmp_path, **parallelism)
    ranks = spawn_ranks(_graph_rank, 2, (str(package), prompts), tmp_path, 600, "graph-capturing ranks")
    assert ranks[0]["graphs"] == TIERS
    assert ranks[0]["outputs"] == want
    # every verify step replayed a captured tier on both ranks (under DP attention, DP rank 1's engine ran
    # the same number of steps: a step without requests of its own replays padding requests)
    steps = ranks[0]["steps"]
    assert len(ranks[0]["replays"]) == len(ranks[1]["replays"]) >= steps > 0
