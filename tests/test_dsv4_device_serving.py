"""Generated dsv4 device packages served on the CPU: the tiny dsv4 specs, with the Ascend operators' C128
ratio, compiled for a 910C and for an H200 with graphs (static: captured batch sizes; compact: token tiers),
and run with torch_npu replaced by the operators' CPU models and torch.cuda's graph API by a fake graph that
replays what the generated runner captured (tests/dsv4_fake_npu.py); the CUDA layers run the Triton kernel's
torch oracle on CPU tensors. Every verify step replays a tier's graph after `update_captured`, and the greedy
output equals the same spec's CPU package's target-only output, token for token, across a C128 boundary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from dspark.compiler import build
from dspark.runtime.engine import forward
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package

from .dsv4_fake_npu import SAS, FakeCuda, FakeGraph, index_quant_everywhere, install_fake_npu

REPO = Path(__file__).resolve().parents[1]
NEW_TOKENS = 12
PROMPT_LENS = (125, 3, 19)  # the first crosses position 127, where the first C128 block closes
DEVICES = {"ascend": "910c", "cuda": "h200"}
GRAPHS = {
    "static": {"enabled": True, "capture_batch_sizes": [1, 2, 4]},  # tiers 8, 16, 32
    "compact": {"enabled": True, "token_tiers": [8, 16, 24, 32]},
}


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def package(mode: str, backend: str, tmp_path: Path) -> Path:
    """specs/dsv4_tiny_cpu_<mode>.yaml with the C128 layer at ratio 128 (as the Ascend operators take it),
    compiled for `backend` (ascend: a 910C with NPU graphs)."""
    spec = yaml.safe_load((REPO / "specs" / f"dsv4_tiny_cpu_{mode}.yaml").read_text())
    spec["model"]["geometry"].update(hca_ratio=128, compress_ratios=[0, 4, 128, 4])
    spec["name"] = f"dsv4_tiny_{backend}_{mode}"
    if backend != "cpu":
        spec.update(backend={"kind": backend, "device": DEVICES[backend]}, graph=GRAPHS[mode])
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return build(path, tmp_path / "generated" / spec["name"]).package_dir


@pytest.mark.parametrize("backend", sorted(DEVICES))
@pytest.mark.parametrize("mode", sorted(GRAPHS))
def test_a_generated_device_package_serves_the_cpu_packages_tokens(
        mode: str, backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as cpu:
        if backend == "ascend":  # the CPU package computing the indexer as Ascend's int8 operator does
            index_quant_everywhere(cpu)
        want, _ = Runtime(load_package(package(mode, "cpu", tmp_path))).generate(prompts(), NEW_TOKENS,
                                                                                target_only=True)
    fake = install_fake_npu(monkeypatch)
    if backend == "cuda":
        monkeypatch.setattr(torch, "cuda", FakeCuda())
    monkeypatch.setitem(forward.DEVICES, backend, "cpu")  # the fake device's tensors live on the host
    rt = Runtime(load_package(package(mode, backend, tmp_path)))
    runner = rt.verify_runner
    assert sorted(runner.graphs) == list(rt.deployment.token_tiers)  # one graph per tier, captured at start

    replays: list[int] = []
    for tier, graph in runner.graphs.items():
        monkeypatch.setattr(graph, "replay", lambda g=graph, t=tier: (replays.append(t), FakeGraph.replay(g)))
    fake.calls.clear()
    got, stats = rt.generate(prompts(), NEW_TOKENS)
    assert got == want
    assert len(replays) == stats.steps  # every verify step replayed a captured tier
    # the Ascend package's eager prefill ran the operator too; the CUDA one never calls an NPU operator
    assert any(name == SAS for name, _ in fake.calls) == (backend == "ascend")
