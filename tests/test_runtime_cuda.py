"""CUDA backend: graph capture per tier, Triton kernels compiled for real, and the lossless oracle.

Skips cleanly without a GPU.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from dspark.runtime.engine.forward import PagedDraftBlock
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.kernels import HAS_TRITON, build_verify_rows, pack_rows, scatter_rows
from dspark.runtime.kernels.accept import greedy_accept
from dspark.runtime.package import load_package
from dspark.runtime.runners.eager import EagerVerifyRunner

from .runtime_helpers import compile_variant
from .test_runtime_modes import COSTLY_ROWS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = {"backend": {"kind": "cuda", "device": "h200"}, "serving": {"max_running_requests": 8}}
VARIANTS = {
    "static": {**CUDA, "graph": {"enabled": True, "capture_batch_sizes": [1, 2, 4, 8]}},
    "cap_accept": {**CUDA, "verify": {"mode": "cap-accept"}, "cost_model": COSTLY_ROWS,
                   "graph": {"enabled": True, "capture_batch_sizes": [1, 2, 4, 8]}},
    "compact": {**CUDA, "verify": {"mode": "compact", "align_to_graph_tier": True},
                "cost_model": COSTLY_ROWS,
                "graph": {"enabled": True, "token_tiers": [8, 16, 24, 32, 48, 64]}},
    "compact_eager": {**CUDA, "verify": {"mode": "compact"}, "cost_model": COSTLY_ROWS,
                      "graph": {"enabled": False}},
}


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Runtime]:
    torch.backends.cuda.matmul.allow_tf32 = False
    tmp = tmp_path_factory.mktemp("cuda")
    return {name: Runtime(load_package(compile_variant(tmp, "tiny_cpu_static.yaml", overrides,
                                                       f"tiny_cuda_{name}")))
            for name, overrides in VARIANTS.items()}


@pytest.mark.parametrize(("name", "lens"), [("static", [8, 8, 8]), ("compact", [2, 1, 4]),
                                            ("compact", [8, 3, 5, 1, 1])])
def test_graph_replay_matches_eager_forward(runtimes: dict[str, Runtime], name: str, lens: list[int]) -> None:
    rt = runtimes[name]
    slots = [rt.slots.admit() for _ in lens]
    for h in slots:
        rt.slots.reserve(h.slot, 64)
    try:
        page_table = rt.slots.page_table[[h.slot for h in slots]].cuda()
        prefix = [5, 9, 17, 1, 30][: len(lens)]
        layout = rt.verify_runner.plan(tuple(lens), tuple(lens), prefix, page_table, [h.slot for h in slots])
        assert layout.tier in rt.verify_runner.graphs  # a captured tier
        ids = torch.randint(0, 256, (layout.total_rows,), device="cuda")
        replayed = rt.verify_runner.run(layout, ids).clone()
        # The same layout run eagerly, padding included, through the generated metadata builder.
        build_metadata = importlib.import_module(type(rt.verify_runner).__module__).build_verify_metadata
        eager = EagerVerifyRunner(rt.target, rt.attn, rt.verify_runner.shape, build_metadata)
        torch.testing.assert_close(replayed, eager.run(layout, ids), rtol=1e-4, atol=1e-4)
    finally:
        for h in slots:
            rt.slots.release(h.slot)


@pytest.mark.parametrize("prefix", [[5, 9, 17], [40], [3, 70, 128, 17, 200]])
def test_the_draft_step_replays_its_graph_as_it_runs_eagerly(runtimes: dict[str, Runtime],
                                                             prefix: list[int]) -> None:
    rt = runtimes["compact"]
    m, graphs = rt.models, rt.models.draft_graphs
    assert graphs is not None and rt.models.draft_attn is not None  # a CUDA graph build drafts in graphs
    slots = [rt.slots.admit() for _ in prefix]
    for h in slots:
        rt.slots.reserve(h.slot, 256)
    saved = [t.clone() for t in (*m.draft_kv.k, *m.draft_kv.v)]
    try:
        gen = torch.Generator(device="cuda").manual_seed(len(prefix))
        for t in (*m.draft_kv.k, *m.draft_kv.v):
            t.normal_(generator=gen)
        table = rt.slots.page_table[[h.slot for h in slots]].cuda()
        roots = torch.randint(0, 256, (len(prefix),), device="cuda", generator=gen)
        lens = torch.tensor(prefix, device="cuda")
        replayed = graphs.propose(roots, lens, table)
        drafts, conf = replayed.drafts.clone(), replayed.conf_logits.clone()
        block = PagedDraftBlock.plan(m.draft_attn, prefix, lens, rt.plan.gamma, table, m.page_size)
        eager = rt.draft.propose_paged(roots, lens, block, None, gamma=rt.plan.gamma)
        assert torch.equal(drafts, eager.drafts)
        torch.testing.assert_close(conf, eager.conf_logits, rtol=1e-4, atol=1e-4)
    finally:
        for t, s in zip((*m.draft_kv.k, *m.draft_kv.v), saved, strict=True):
            t.copy_(s)
        for h in slots:
            rt.slots.release(h.slot)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_speculative_equals_target_only_on_cuda(runtimes: dict[str, Runtime], name: str) -> None:
    rt = runtimes[name]
    tok = rt.package.tokenizer
    prompts = [tok.encode(p) for p in ["def main(argv):\n", "import os\n", "class A:\n    x = 1\n",
                                       "for i in range(10):\n", "x", "    return self._"]]
    ref, _ = rt.generate(prompts, 48, target_only=True)
    out, stats = rt.generate(prompts, 48)
    mismatched = [i for i, (a, b) in enumerate(zip(out, ref, strict=True)) if a != b]
    assert not mismatched, f"{name}: prompts {mismatched} differ from target-only"
    assert sum(stats.drafts_accepted) > 0


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_kernels_compiled_for_cuda_match_torch() -> None:
    gen = torch.Generator(device="cpu").manual_seed(0)
    for num_reqs, gamma in [(1, 1), (5, 7), (32, 7), (64, 3)]:
        n = gamma + 1
        lens = torch.randint(1, n + 1, (num_reqs,), generator=gen, dtype=torch.int32).cuda()
        prefix = torch.randint(0, 200, (num_reqs,), generator=gen, dtype=torch.int32).cuda()
        table = torch.randint(1, 500, (num_reqs, 16), generator=gen, dtype=torch.int32).cuda()
        total = int(lens.sum())
        a = build_verify_rows(lens, prefix, table, 16, total, num_draft_tokens=n, impl="triton")
        b = build_verify_rows(lens, prefix, table, 16, total, num_draft_tokens=n, impl="torch")
        for field in ("qo_indptr", "row_req", "positions", "out_cache_loc", "src_index"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        hidden = torch.randn(num_reqs * n, 96, device="cuda")
        packed_t = pack_rows(hidden, a.src_index, impl="triton")
        assert torch.equal(packed_t, pack_rows(hidden, a.src_index, impl="torch"))
        assert torch.equal(scatter_rows(packed_t, a.src_index, num_reqs * n, impl="triton"),
                           scatter_rows(packed_t, a.src_index, num_reqs * n, impl="torch"))
        drafts = torch.randint(0, 3, (num_reqs, gamma), generator=gen).cuda()
        pred = torch.randint(0, 3, (num_reqs, n), generator=gen).cuda()
        x = greedy_accept(drafts, pred, lens, prefix, impl="triton")
        y = greedy_accept(drafts, pred, lens, prefix, impl="torch")
        for field in ("correct_len", "commit_len", "bonus", "new_seq_lens"):
            assert torch.equal(getattr(x, field), getattr(y, field)), field
