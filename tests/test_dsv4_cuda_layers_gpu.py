"""The DSV4 CUDA layers (dspark.runtime.families.dsv4.cuda_layers) on a GPU, with the compiled Triton kernel
(skipped without CUDA; in benchmarks/device_check.sh phase 1): fp32 steps against the CPU path (dsv4.paged)
with no host sync inside the layers, a bf16 model finite and close to it, and a CUDA graph captured on one
step and replayed on two others of its tier equal to the eager steps. The CPU checks of the same code (the
torch oracle, and the kernel under the interpreter) are in tests/test_dsv4_cuda_layers.py.

Tolerances: the GPU sums in other orders than the CPU (the indexer's scores, the kernel's online softmax), so
fp32 logits agree within 1e-3 and caches within 1e-4; a replayed graph runs the eager step's kernels on the
same inputs, so it agrees bitwise (the null page aside, where padding rows' duplicate writes land in any
order).
"""

from __future__ import annotations

import pytest
import torch

from dspark.runtime.kernels import dispatch
from tests.dsv4_layers_common import (
    GRAPH_STEPS,
    LAYER_STEPS,
    MAX_LEN,
    PROMPTS,
    SLOTS,
    TIER,
    assert_caches_match,
    caches_on,
    check_bf16,
    cpu_forward,
    cuda_layers,
    forward,
    model_on,
    plan,
    prefilled,
    step_tokens,
)

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and dispatch.HAS_TRITON),
                                reason="needs a CUDA device and Triton")


@pytest.mark.parametrize("name", sorted(LAYER_STEPS))
@torch.no_grad()
def test_fp32_steps_match_the_cpu_path_without_host_sync(name: str) -> None:
    lens, tier, num_slots = LAYER_STEPS[name]
    base = prefilled()
    host_meta = plan(base, lens, list(PROMPTS), tier=tier, num_slots=num_slots)
    meta = plan(base, lens, list(PROMPTS), tier=tier, num_slots=num_slots, device="cuda")
    toks = step_tokens(host_meta, seed=400 + len(name))
    cpu = base.clone()
    want = cpu_forward(cpu, toks, host_meta)
    m, ids = model_on("cuda", torch.float32), toks.cuda()
    forward(cuda_layers(caches_on(base, "cuda", torch.float32), "auto"), ids, meta, m)  # compile the kernels
    layers = cuda_layers(caches_on(base, "cuda", torch.float32), "auto")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = forward(layers, ids, meta, m)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got.cpu(), want, rtol=1e-3, atol=1e-3)  # padding rows too
    for want_layer, got_layer in zip(cpu.layers, layers.caches.layers, strict=True):
        assert_caches_match(want_layer, got_layer, rtol=1e-4)


def test_bf16_is_finite_and_close() -> None:
    check_bf16("cuda", "auto", tol=0.05)


@torch.no_grad()
def test_a_cuda_graph_captured_on_one_step_replays_two_others_as_eager() -> None:
    m, base = model_on("cuda", torch.float32), prefilled()
    graph_layers = cuda_layers(caches_on(base, "cuda", torch.float32), "auto")
    eager_layers = cuda_layers(caches_on(base, "cuda", torch.float32), "auto")
    cpu = base.clone()
    static_ids = torch.zeros(TIER, dtype=torch.long, device="cuda")  # the graph's input buffer
    graph = torch.cuda.CUDAGraph()
    prefix = list(PROMPTS)
    for k, (lens, accepted) in enumerate(GRAPH_STEPS):
        host_meta = plan(base, lens, prefix, tier=TIER, num_slots=SLOTS, max_kv_len=MAX_LEN)
        meta = plan(base, lens, prefix, tier=TIER, num_slots=SLOTS, max_kv_len=MAX_LEN, device="cuda")
        toks = step_tokens(host_meta, seed=500 + k)
        static_ids.copy_(toks)
        if k == 0:
            with graph_layers.capturing(TIER, meta):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up (kernel compilation) outside the graph
                    forward(graph_layers, static_ids, meta, m)
                torch.cuda.current_stream().wait_stream(side)
                with torch.cuda.graph(graph):
                    static_logits = forward(graph_layers, static_ids, meta, m)
        # The copies and the replay queue on the current stream, in that order: no other synchronisation.
        graph_layers.update_captured(TIER, meta)
        graph.replay()
        eager = forward(eager_layers, toks.cuda(), meta, m)
        real = host_meta.total_rows
        assert torch.equal(static_logits[:real], eager[:real]), k
        for cache, t in graph_layers.caches.tensors().items():
            assert torch.equal(t[1:], eager_layers.caches.tensors()[cache][1:]), (k, cache)
        want = cpu_forward(cpu, toks, host_meta)
        torch.testing.assert_close(eager[:real].cpu(), want[:real], rtol=1e-3, atol=1e-3)
        prefix = [p + a for p, a in zip(prefix, accepted, strict=True)]
