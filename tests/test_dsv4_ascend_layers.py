"""The DSV4 Ascend layers (dspark.runtime.families.dsv4.ascend_layers) against the paged CPU forward
(dsv4.paged), on the torch_npu stand-in of tests/dsv4_fake_npu.py: its operators are the CPU models of
dsv4.ascend_op_models, the step's device arrays refuse host reads, and its graph records and replays.

What is equal and how:
* raw K=V and the compressors' per-position rows in the ring: bitwise (the same ops on the same inputs);
* compressed entries and index keys: within 1e-6 (CPU torch's softmax over the positions of a batch of blocks
  rounds differently from one block's, by about an ulp);
* a layer's output: within 1e-5 (the operator model's attention sums in another order than `attend_row`);
* logits of multi-step runs: within 1e-4 (the differences above carried through the layers);
* a replayed graph and the eager step: bitwise, every row and every cache page (the same ops).
The geometry is small, with a C128-kind ratio of 8 so both kinds of block close every few positions; the
device operator takes compress ratios 4 and 128 only, so the stand-in's SAS model is let accept 8 as well
(its math is ratio-generic). The CPU path scores the lightning indexer as the device's int8 operator does
(`index_quant`, which `Dsv4Geometry.for_backend` sets for Ascend).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dspark.formats.dsv4_config import dsv4_cache_layout
from dspark.runtime.families.dsv4 import ascend_op_models
from dspark.runtime.families.dsv4.ascend_attention import Dsv4AscendAttention, Dsv4AscendBackendError
from dspark.runtime.families.dsv4.ascend_layers import Dsv4AscendLayers
from dspark.runtime.families.dsv4.cpu_attention import Dsv4PagedAttention, step_config
from dspark.runtime.families.dsv4.cpu_paged import (
    Dsv4PagedCaches,
    layer_forward,
    max_rows_per_request,
    prefill_config,
    slot_page_tables,
)
from dspark.runtime.families.dsv4.device_layers import Dsv4RopeTables, pool_blocks
from dspark.runtime.families.dsv4.target import Dsv4ForCausalLM
from dspark.runtime.families.dsv4.verify_metadata import plan_dsv4_verify
from tests.dsv4_fake_npu import FakeGraph, FakeNpu, device_only, install_fake_npu, plain
from tests.dsv4_layers_common import (
    CFG,
    ENTRIES,
    GRAPH_STEPS,
    LAYER_STEPS,
    MAX_LEN,
    MAX_REQ,
    PROMPTS,
    RING,
    SCRIPT,
    SLOTS,
    STEP,
    TIER,
    N,
    assert_caches_match,
    check_host_refusals,
    cpu_forward,
    forward,
    geometry,
    model,
    plan,
    prefilled,
    step_tokens,
    tokens,
)

QUANT = CFG.for_backend("ascend").index_quant  # True: the int8 indexer, as Ascend serves


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> FakeNpu:
    monkeypatch.setattr(ascend_op_models, "CMP_RATIOS", (*ascend_op_models.CMP_RATIOS, CFG.hca_ratio))
    return install_fake_npu(monkeypatch)


def ascend(caches: Dsv4PagedCaches) -> Dsv4AscendLayers:
    attention = Dsv4AscendAttention(CFG.compress_ratios, num_heads=CFG.n_heads, head_dim=CFG.head_dim,
                                    softmax_scale=CFG.head_dim**-0.5, index_num_heads=CFG.index_n_heads,
                                    index_head_dim=CFG.index_head_dim)
    return Dsv4AscendLayers(caches, attention, max_rows_per_request(CFG, RING), MAX_LEN)


# ---------------------------------------------------------------------------------------------------------
# the batched pooling against Compressor.close_block


def test_pooling_many_blocks_is_close_block() -> None:
    m = model(QUANT)
    comps = [m.layers[0].compressor, m.layers[2].compressor, m.layers[0].indexer.compressor]  # C4, C8, index
    g = torch.Generator().manual_seed(0)
    blocks = torch.tensor([0, 1, 2, 5, 0, 9, 3])
    for comp in comps:
        r, width = comp.ratio, comp.wkv.shape[0]
        kv, score, prev_kv, prev_score = (torch.randn(len(blocks), r, width, generator=g) for _ in range(4))
        prev_kv[blocks == 0] = prev_score[blocks == 0] = float("nan")  # block 0 has no predecessor to read
        cos, sin = Dsv4RopeTables([comp.rope], 100, torch.device("cpu")).at(comp.rope, blocks * r)
        got = pool_blocks(comp, kv, score, prev_kv, prev_score, blocks > 0, cos, sin)
        want = torch.stack([comp.close_block(int(b), kv[i], score[i], *((prev_kv[i], prev_score[i])
                                                                       if b else (None, None)))
                            for i, b in enumerate(blocks.tolist())])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for i in (0, 1):  # one block at a time: bitwise (only a batch's softmax rounds otherwise)
            one = slice(i, i + 1)
            alone = pool_blocks(comp, kv[one], score[one], prev_kv[one], prev_score[one], blocks[one] > 0,
                                cos[one], sin[one])
            assert torch.equal(alone[0], want[i]), (comp.ratio, comp.overlap, i)


# ---------------------------------------------------------------------------------------------------------
# (1) one step, layer by layer, against paged.layer_forward

@pytest.mark.parametrize("name", sorted(LAYER_STEPS))
def test_each_layer_equals_the_paged_forward_and_writes_the_same_caches(npu: FakeNpu, name: str) -> None:
    lens, tier, num_slots = LAYER_STEPS[name]
    base = prefilled(QUANT)
    meta = plan(base, lens, list(PROMPTS), tier=tier, num_slots=num_slots)
    real, m = meta.total_rows, model(QUANT)
    for ratio in STEP.compress_ratios:  # real boundaries, block 0 among them, and padding entries
        plan_r = meta.compressed[ratio].host
        closing = plan_r.cmp_positions[plan_r.boundary_rows >= 0]
        assert 0 in closing and 0 < closing.size < plan_r.boundary_rows.size, (name, ratio)
    cpu, mine = base.clone(), base.clone()
    layers = ascend(mine)
    guarded = device_only(meta)
    toks = step_tokens(meta, seed=len(name))
    h = m.embed_tokens(toks)
    with torch.no_grad():
        for i, layer in enumerate(m.layers):
            got = plain(layers.forward_layer(i, layer, h, toks, guarded))
            want = layer_forward(layer, cpu.layers[i], h, toks, meta, None)
            torch.testing.assert_close(got[:real], want[:real], rtol=1e-5, atol=1e-5)
            assert_caches_match(cpu.layers[i], mine.layers[i])
            for cache in ENTRIES:  # padding entries land in slot 0 of the null page, nowhere else
                g, w = getattr(mine.layers[i], cache), getattr(cpu.layers[i], cache)
                if g is not None:
                    assert torch.equal(g[0, 1:], w[0, 1:]) and not torch.equal(g[0, 0], w[0, 0]), (i, cache)
            h = want
    for i, (before, after) in enumerate(zip(base.layers, mine.layers, strict=True)):
        for cache, t in before.tensors().items():  # the step did write every cache
            assert not torch.equal(t[1:], getattr(after, cache)[1:]), (i, cache)


def test_steps_are_checked_on_the_host(npu: FakeNpu) -> None:
    check_host_refusals(ascend(prefilled(QUANT).clone()), Dsv4AscendBackendError)


# ---------------------------------------------------------------------------------------------------------
# (2) prefill, then verify steps with scripted acceptances, through the whole model

def test_prefill_and_verify_steps_with_rollback_give_the_paged_logits(npu: FakeNpu) -> None:
    cpu = Dsv4PagedCaches.allocate(geometry(QUANT), STEP, MAX_REQ, MAX_LEN, seed=3)
    layers = ascend(cpu.clone())
    reqs = range(MAX_REQ)
    seqs = [tokens(n, seed=20 + i) for i, n in enumerate(PROMPTS)]
    chunk = prefill_config(CFG, STEP)
    done = [0] * MAX_REQ
    pending = [0] * MAX_REQ  # each request's next token: the argmax of its last row's logits
    with torch.no_grad():
        while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
            rows = [s[d : d + chunk.num_draft_tokens] for d, s in zip(done, seqs, strict=True)]
            live = [r for r in reqs if rows[r]]
            meta = plan_dsv4_verify([len(rows[r]) for r in live], [done[r] for r in live], chunk,
                                    cpu.page_tables(live))
            toks = torch.tensor([t for r in live for t in rows[r]])
            want = cpu_forward(cpu, toks, meta, index_quant=QUANT)
            got = forward(layers, toks, device_only(meta), index_quant=QUANT)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            for slot, r in enumerate(live):
                done[r] += len(rows[r])
                pending[r] = int(want[meta.host.cu_seqlens_q[slot + 1] - 1].argmax())
        prefix = list(PROMPTS)
        rejected_boundaries = dict.fromkeys(STEP.compress_ratios, 0)
        for k, (tier, script) in enumerate(SCRIPT):
            lens = [n for n, _ in script]
            meta = plan(cpu, lens, prefix, tier=tier, num_slots=None if tier is None else 8)
            toks = step_tokens(meta, seed=100 + k)
            cu = meta.host.cu_seqlens_q
            for r in reqs:
                toks[cu[r]] = pending[r]  # each request's first row is the token its last step predicted
            got = forward(layers, toks, device_only(meta), index_quant=QUANT)
            want = cpu_forward(cpu, toks, meta, index_quant=QUANT)
            torch.testing.assert_close(got[: meta.total_rows], want[: meta.total_rows], rtol=1e-4, atol=1e-4)
            assert torch.equal(got[: meta.total_rows].argmax(-1), want[: meta.total_rows].argmax(-1))
            for r, (n, accepted) in enumerate(script):  # the rest is rejected: forgotten, not undone
                for q in range(prefix[r] + accepted, prefix[r] + n):
                    for ratio in rejected_boundaries:
                        rejected_boundaries[ratio] += (q + 1) % ratio == 0
                pending[r] = int(want[cu[r] + accepted - 1].argmax())
                prefix[r] += accepted
    assert min(rejected_boundaries.values()) > 0  # rejected rows closed blocks of both kinds
    for want_layer, got_layer in zip(cpu.layers, layers.caches.layers, strict=True):
        assert_caches_match(want_layer, got_layer, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# (3) NPU graphs: a captured tier replays other steps of the tier as the eager path runs them

@contextmanager
def logging_copies(npu: FakeNpu) -> Iterator[list[tuple[str, int]]]:
    """(stream, destination data_ptr) of every copy_ issued inside, also noted in npu.log."""
    copies: list[tuple[str, int]] = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.ops.aten.copy_.default:
                copies.append((npu.stream_name, args[0].data_ptr()))
                npu.log.append(f"copy@{npu.stream_name}")
            return func(*args, **(kwargs or {}))

    with Log():
        yield copies


def test_a_captured_tier_replays_the_updated_steps_as_eager(npu: FakeNpu) -> None:
    m = model(QUANT)
    base = prefilled(QUANT)
    graph_layers, eager_layers, cpu = ascend(base.clone()), ascend(base.clone()), base.clone()
    static_h = torch.zeros(TIER, CFG.hc_mult, CFG.dim)  # the graph's input buffer: the residual streams
    static_ids = torch.zeros(TIER, dtype=torch.long)  # the rows' tokens (hash-routed experts read them)
    graph = FakeGraph()
    prefix = list(PROMPTS)
    with torch.no_grad():
        for k, (lens, accepted) in enumerate(GRAPH_STEPS):
            meta = plan(base, lens, prefix, tier=TIER, num_slots=SLOTS, max_kv_len=MAX_LEN)
            guarded = device_only(meta)
            toks = step_tokens(meta, seed=200 + k)
            static_h.copy_(m.embed_tokens(toks))
            static_ids.copy_(toks)
            if k == 0:
                with graph_layers.capturing(TIER, guarded), npu.graph_capture(graph):
                    h = static_h
                    for i, layer in enumerate(m.layers):
                        h = graph_layers.forward_layer(i, layer, h, static_ids, guarded)
                    static_logits = m.lm_head(h)
                # the graph waits for update_captured's event before anything reads the tier's arrays
                assert graph.entries[0][0].endswith("wait")
                assert [name for name, _ in graph.entries].count("npu_sparse_attn_sharedkv") == len(m.layers)
            else:
                npu.log.clear()
                with logging_copies(npu) as copies:
                    graph_layers.update_captured(TIER, guarded)
                # after the compute stream, on the update stream, before the event the graph waits on
                assert npu.log[0] == "update waits compute" and npu.log[-1].endswith("record@update")
                assert all(entry.endswith("@update") for entry in npu.log[1:])
                written = {ptr for _, ptr in copies}
                assert all(t.data_ptr() in written for t in graph_layers._tiers[TIER].arrays.values())
                graph.replay()
            eager = forward(eager_layers, toks, guarded, index_quant=QUANT)
            assert torch.equal(plain(static_logits), eager)  # padding rows too
            for name, t in graph_layers.caches.tensors().items():
                assert torch.equal(t, eager_layers.caches.tensors()[name]), name
            want = cpu_forward(cpu, toks, meta, index_quant=QUANT)
            real = meta.total_rows
            torch.testing.assert_close(eager[:real], want[:real], rtol=1e-4, atol=1e-4)
            prefix = [p + a for p, a in zip(prefix, accepted, strict=True)]


def test_graph_misuse_is_refused(npu: FakeNpu) -> None:
    layers = ascend(prefilled(QUANT).clone())
    meta = plan(prefilled(QUANT), [2, 4, 1, 3], list(PROMPTS), tier=TIER, num_slots=SLOTS, max_kv_len=MAX_LEN)
    with pytest.raises(Dsv4AscendBackendError, match="was not captured"):
        layers.update_captured(TIER, meta)
    with pytest.raises(Dsv4AscendBackendError, match="capturing tier 12"):
        with layers.capturing(12, meta):
            pass
    with layers.capturing(TIER, meta):
        pass
    other = plan(prefilled(QUANT), [2, 4, 1, 3], list(PROMPTS), tier=TIER, num_slots=SLOTS + 1,
                 max_kv_len=MAX_LEN)
    with pytest.raises(Dsv4AscendBackendError, match=f"num_slots={SLOTS}"):
        layers.update_captured(TIER, other)


# ---------------------------------------------------------------------------------------------------------
# allocation for a serving target, beside the CPU backend


def test_allocate_lays_the_caches_out_as_the_cpu_backend_does(npu: FakeNpu) -> None:
    cfg = geometry(QUANT)
    target = Dsv4ForCausalLM(cfg)
    target.model.load_state_dict(model(QUANT).state_dict())
    layout = dsv4_cache_layout(cfg, N, page_size=STEP.swa_page_size, prefill_rows=N)
    config = step_config(layout, N, padding_request_rows=2)
    cpu = Dsv4PagedAttention.allocate(target, layout, config, MAX_REQ, MAX_LEN)
    layers = Dsv4AscendLayers.allocate(target, layout, config, MAX_REQ, MAX_LEN, device="cpu")
    assert layers.max_extend_rows == cpu.max_extend_rows == layout.max_rows_per_request
    assert (layers.caches.swa_pages == cpu.caches.swa_pages).all()
    assert all((layers.caches.cmp_pages[r] == pages).all() for r, pages in cpu.caches.cmp_pages.items())
    for name, t in cpu.caches.tensors().items():
        got = layers.caches.tensors()[name]
        assert got.shape == t.shape and got.dtype == t.dtype and not got.any(), name
    assert layers.attention.layer_ratios == CFG.compress_ratios
    assert layers.attention.softmax_scale == CFG.head_dim**-0.5

    # the target's forward through both backends: slots 2 and 0 from empty caches, padded to a tier
    meta = plan_dsv4_verify([4, 3], [0, 0], config, slot_page_tables(config, MAX_LEN, [2, 0]), tier=10,
                            num_slots=4)
    toks = step_tokens(meta, seed=5)
    want, _ = target.forward_paged_states(toks, meta.device.positions, cpu, meta)
    got, _ = target.forward_paged_states(toks, meta.device.positions, layers, device_only(meta))
    torch.testing.assert_close(plain(got)[: meta.total_rows], want[: meta.total_rows], rtol=1e-5, atol=1e-5)

    half = Dsv4AscendLayers.allocate(target, layout, config, 1, MAX_LEN, device="cpu", dtype=torch.bfloat16)
    assert {t.dtype for t in half.caches.tensors().values()} == {torch.bfloat16}
