"""CUDA backend: graph capture per tier and the lossless oracle. Skips cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch

from dspark.runtime.engine import Runtime
from dspark.runtime.package import load_package

from .runtime_helpers import compile_variant

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def cuda_runtime(tmp_path_factory: pytest.TempPathFactory) -> Runtime:
    tmp = tmp_path_factory.mktemp("cuda")
    pkg_dir = compile_variant(tmp, "tiny_cpu_static.yaml", {
        "backend": {"kind": "cuda", "device": "h200"},
        "graph": {"enabled": True, "capture_batch_sizes": [1, 2, 4, 8]},
        "serving": {"max_running_requests": 8},
    }, "tiny_cuda_static")
    return Runtime(load_package(pkg_dir))


def test_graph_replay_matches_eager_forward(cuda_runtime: Runtime) -> None:
    rt = cuda_runtime
    slots = [rt.slots.admit() for _ in range(3)]
    for h in slots:
        rt.slots.reserve(h.slot, 64)
    page_table = rt.slots.page_table[[h.slot for h in slots]].cuda()
    prefix = torch.tensor([5, 9, 17], dtype=torch.int32, device="cuda")
    meta = rt.metadata.build_verify_metadata(prefix, page_table)
    ids = torch.randint(0, 256, (meta.total_rows,), device="cuda")
    replayed = rt.verify_runner.run(ids, meta).clone()
    eager = rt.target.forward_paged(ids, meta.positions, rt.attn, meta)
    torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
    for h in slots:
        rt.slots.release(h.slot)


def test_static_speculative_equals_target_only_on_cuda(cuda_runtime: Runtime) -> None:
    tok = cuda_runtime.package.tokenizer
    prompts = [tok.encode(p) for p in ["def main(argv):\n", "import os\n", "class A:\n    x = 1\n",
                                       "for i in range(10):\n", "x"]]
    ref, _ = cuda_runtime.generate(prompts, 48, target_only=True)
    out, stats = cuda_runtime.generate(prompts, 48)
    assert out == ref
    assert sum(stats.drafts_accepted) > 0
