"""The draft step in captured graphs (`runners.draft_graphs.GraphDraftRunner`), on the CPU: a recording of
every op stands in for the CUDA graph (tests/recorded_graph.py, which fails on a host read inside a
capture), the Triton attention runs its torch reference. Each replayed step has the proposal and the cache
writes of the same step run eagerly; the padding requests of a tier write only the null page; the greedy
output of a runtime whose draft replays graphs is target-only's."""

from __future__ import annotations

import pytest
import torch

from dspark.runtime.attention.triton_paged import TritonPagedAttention
from dspark.runtime.engine.forward import PagedDraftBlock
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package
from dspark.runtime.runners.draft_graphs import GraphDraftRunner

from .recorded_graph import RecordedGraphs
from .runtime_helpers import REPO

GAMMA = 7
TIERS = (1, 2, 4, 8)
STEPS = [[3, 70, 128], [17], [200, 5, 40, 90, 16], [33, 64], [120, 7, 9, 11, 13, 15, 250, 1]]


@pytest.fixture(scope="module")
def runtime() -> Runtime:
    return Runtime(load_package(REPO / "generated" / "tiny_cpu_compact"))


def _attention(rt: Runtime) -> TritonPagedAttention:
    cfg = rt.draft.cfg
    return TritonPagedAttention(rt.models.draft_kv, rt.models.page_size, cfg.num_heads, cfg.head_dim ** -0.5,
                                impl="torch")


def _runner(rt: Runtime, attn: TritonPagedAttention) -> GraphDraftRunner:
    return GraphDraftRunner(rt.draft, attn, TIERS, rt.slots.page_table.shape[1], GAMMA, rt.models.page_size,
                            RecordedGraphs())


def test_every_replayed_step_is_the_eager_step(runtime: Runtime) -> None:
    rt, m = runtime, runtime.models
    attn = _attention(rt)
    handles = [rt.slots.admit() for _ in range(max(len(s) for s in STEPS))]
    for h in handles:
        rt.slots.reserve(h.slot, 260 + GAMMA)
    torch.manual_seed(0)
    for layer in range(rt.draft.cfg.num_layers):
        m.draft_kv.k[layer].normal_()
        m.draft_kv.v[layer].normal_()
    graphs = _runner(rt, attn)
    gen = torch.Generator().manual_seed(3)
    for prefix_host in STEPS:
        num = len(prefix_host)
        table = rt.slots.page_table[[h.slot for h in handles[:num]]]
        roots = torch.randint(rt.draft.cfg.vocab_size, (num,), generator=gen)
        prefix = torch.tensor(prefix_host)
        before = [t.clone() for t in (*m.draft_kv.k, *m.draft_kv.v)]
        block = PagedDraftBlock.plan(attn, None, prefix, GAMMA, table, m.page_size)
        eager = rt.draft.propose_paged(roots, prefix, block, None, gamma=GAMMA)
        eager_cache = [t.clone() for t in (*m.draft_kv.k, *m.draft_kv.v)]
        for t, b in zip((*m.draft_kv.k, *m.draft_kv.v), before, strict=True):
            t.copy_(b)
        replayed = graphs.propose(roots, prefix, table)
        assert torch.equal(replayed.drafts, eager.drafts), prefix_host
        torch.testing.assert_close(replayed.conf_logits, eager.conf_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(replayed.logits, eager.logits, rtol=1e-5, atol=1e-5)
        page = m.page_size
        for t, want, b in zip((*m.draft_kv.k, *m.draft_kv.v), eager_cache, before, strict=True):
            real = torch.ones(t.shape[0], dtype=torch.bool)
            real[:page] = False  # the null page: the padding requests' writes land there
            torch.testing.assert_close(t[real], want[real], rtol=1e-6, atol=1e-6)
            assert torch.equal(t[real] != b[real], want[real] != b[real])
    for h in handles:
        rt.slots.release(h.slot)


def test_sampling_recording_other_gammas_and_wide_batches_draft_eagerly(runtime: Runtime) -> None:
    graphs = _runner(runtime, _attention(runtime))
    assert graphs.accepts(8, GAMMA, greedy=True, keep_conf_inputs=False)
    assert not graphs.accepts(9, GAMMA, greedy=True, keep_conf_inputs=False)
    assert not graphs.accepts(2, GAMMA, greedy=False, keep_conf_inputs=False)
    assert not graphs.accepts(2, GAMMA, greedy=True, keep_conf_inputs=True)
    assert not graphs.accepts(2, GAMMA - 1, greedy=True, keep_conf_inputs=False)
    with pytest.raises(ValueError, match="increasing"):
        GraphDraftRunner(runtime.draft, _attention(runtime), (4, 2), 8, GAMMA, 16, RecordedGraphs())


def test_a_runtime_whose_draft_replays_graphs_is_lossless(runtime: Runtime) -> None:
    rt = runtime
    prompts = [list(b"def main():\n    ") + [32] * k for k in range(6)]
    want, _ = rt.generate(prompts, 40, target_only=True)
    rt.models.draft_graphs = _runner(rt, _attention(rt))
    calls = 0
    propose = rt.models.draft_graphs.propose

    def counted(*args: torch.Tensor):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return propose(*args)

    rt.models.draft_graphs.propose = counted  # type: ignore[method-assign]
    try:
        got, stats = rt.generate(prompts, 40)
    finally:
        rt.models.draft_graphs = None
    assert got == want
    assert 0 < calls <= stats.steps
