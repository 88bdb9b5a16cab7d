"""The DSV4 Ascend attention backend's calls into its operators, against a stand-in that records them.

The stand-in (tests/dsv4_fake_npu.py) takes torch_npu's place: its operators are the CPU models of
`dspark.runtime.families.dsv4.ascend_op_models` and check each call against the operators' schemas, the
step's device arrays are wrapped so that reading their values on the host fails, and a fake NPU graph records
what a stream capture would (the operators' launches and the backend's own in-place tensor ops) and replays
it on the same memory, so a captured tier can be checked after `update_captured` against an eager run of the
new step.

Caches are filled at random (the backend only routes them; the CPU models are checked against naive attention
in tests/test_dsv4_ascend_op_models.py), and compared with `run_dsv4_layer_reference` on every real row.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import pytest
import torch

from dspark.runtime.families.dsv4 import Dsv4PageTables, Dsv4StepConfig, Dsv4VerifyMetadata, plan_dsv4_verify
from dspark.runtime.families.dsv4.ascend_attention import (
    SGLANG_OPS,
    Dsv4AscendAttention,
    Dsv4AscendBackendError,
)
from dspark.runtime.families.dsv4.ascend_op_models import run_dsv4_layer_reference
from dspark.runtime.families.dsv4.cpu_paged import Dsv4LayerCache
from tests.dsv4_fake_npu import (
    LI,
    LI_PLAN,
    OPS,
    SAS,
    SAS_PLAN,
    FakeGraph,
    FakeNpu,
    device_only,
    install_fake_npu,
    plain,
)

D, H, IH, ID, SCALE = 8, 4, 3, 8, 0.3  # head dim, query heads, indexer heads, indexer head dim, softmax scale
CFG = Dsv4StepConfig(num_draft_tokens=6, window=5, compress_ratios=(4, 128), swa_page_size=4,
                     swa_ring_size=12, cmp_page_sizes={4: 4, 128: 2}, index_topk=3)
LAYERS = (4, 0, 128, 4)  # C4, window only, C128, C4
MAX_REQ, MAX_LEN = 4, 300  # page tables hold 4 requests of up to 300 positions
SLOTS = {12: 4, 24: 8}  # tier -> slots of its graph
STEPS = {  # tier -> two compact steps (verify_lens, prefix_lens) of the same requests, padded to the tier
    12: (([3, 1, 5], [126, 7, 253]), ([2, 4, 1], [129, 8, 255])),
    24: (([6, 2, 1, 4], [122, 0, 7, 250]), ([1, 6, 3, 5], [128, 2, 9, 254])),
}


def _pages(count: int, width: int, seed: int) -> np.ndarray:
    ids = np.random.default_rng(seed).permutation(np.arange(1, 1 + count * width)).astype(np.int32)
    return ids.reshape(count, width)


SWA_PAGES = _pages(MAX_REQ, CFG.swa_ring_pages, 1)
CMP_PAGES = {r: _pages(MAX_REQ, -(-(MAX_LEN // r) // CFG.cmp_page_sizes[r]), 2 + r)
             for r in CFG.compress_ratios}


def plan(lens: list[int], prefix: list[int], tier: int, num_slots: int | None = None) -> Dsv4VerifyMetadata:
    r = len(lens)
    tables = Dsv4PageTables(swa=SWA_PAGES[:r], compressed={k: v[:r] for k, v in CMP_PAGES.items()})
    return plan_dsv4_verify(lens, prefix, CFG, tables, tier=tier, num_slots=num_slots or SLOTS[tier],
                            max_kv_len=MAX_LEN)


# ----------------------------------------------------------------------------------------------------------
# the stand-in for torch_npu and torch.npu (tests/dsv4_fake_npu.py)


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> FakeNpu:
    return install_fake_npu(monkeypatch)


# ----------------------------------------------------------------------------------------------------------
# caches, inputs and the CPU attention


def backend(**kw: Any) -> Dsv4AscendAttention:
    return Dsv4AscendAttention(LAYERS, num_heads=H, head_dim=D, softmax_scale=SCALE, index_num_heads=IH,
                               index_head_dim=ID, **kw)


def make_caches(seed: int) -> list[Dsv4LayerCache]:
    g = torch.Generator().manual_seed(seed)
    swa_pages = 1 + SWA_PAGES.size
    caches = []
    for ratio in LAYERS:
        cache = Dsv4LayerCache(ratio, torch.randn(swa_pages, CFG.swa_page_size, D, generator=g))
        if ratio:
            pages, cps = 1 + CMP_PAGES[ratio].size, CFG.cmp_page_sizes[ratio]
            cache.cmp_kv = torch.randn(pages, cps, D, generator=g)
            if ratio == 4:
                cache.index_kv = torch.randn(pages, cps, ID, generator=g)
        caches.append(cache)
    return caches


def refill(caches: list[Dsv4LayerCache], seed: int) -> None:
    """New cache contents, in place (a captured graph reads the same memory)."""
    g = torch.Generator().manual_seed(seed)
    for cache in caches:
        for t in cache.tensors().values():
            t.copy_(torch.randn(t.shape, generator=g))


def make_inputs(tier: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    c4_pages = 1 + CMP_PAGES[4].size
    page = CFG.cmp_page_sizes[4]
    # the quantised indexer's inputs: int8 codes and float16 dequant scales (quant mode 0)
    return [dict(q=torch.randn(tier, H, D, generator=g), sinks=torch.randn(H, generator=g),
                 index_query=torch.randint(-127, 128, (tier, IH, ID), generator=g, dtype=torch.int8),
                 index_weights=torch.randn(tier, IH, generator=g),
                 query_dequant_scale=(torch.rand(tier, IH, generator=g) + 0.5).half(),
                 index_key=torch.randint(-127, 128, (c4_pages, page, ID), generator=g, dtype=torch.int8),
                 key_dequant_scale=(torch.rand(c4_pages, page, 1, generator=g) + 0.5).half())
            for _ in LAYERS]


def layer_kwargs(inp: dict[str, torch.Tensor], ratio: int) -> dict[str, torch.Tensor]:
    keys = ("sinks", "index_query", "index_weights", "query_dequant_scale", "index_key", "key_dequant_scale")
    return {k: inp[k] for k in (keys if ratio == 4 else keys[:1])}


def run_layers(attn: Dsv4AscendAttention, caches: list[Dsv4LayerCache], inputs: list[dict[str, torch.Tensor]],
               meta: Dsv4VerifyMetadata) -> list[torch.Tensor]:
    return [attn.attend(i, inputs[i]["q"], caches[i], meta, **layer_kwargs(inputs[i], ratio))
            for i, ratio in enumerate(LAYERS)]


def cpu_attention(meta: Dsv4VerifyMetadata, cache: Dsv4LayerCache, inp: dict[str, torch.Tensor], ratio: int,
                  **kw: Any) -> Any:
    extra: dict[str, Any] = {}
    if ratio:
        extra["cmp_kv"] = cache.cmp_kv.unsqueeze(2)
    if ratio == 4:
        # the float indexer on the dequantised inputs: the same scores up to rounding
        extra.update(index_query=inp["index_query"].float() * inp["query_dequant_scale"].float()[..., None],
                     index_key=(inp["index_key"].float() * inp["key_dequant_scale"].float()).unsqueeze(2),
                     index_weights=inp["index_weights"])
    return run_dsv4_layer_reference(meta, compress_ratio=ratio, q=inp["q"], ori_kv=cache.swa_kv.unsqueeze(2),
                                    softmax_scale=SCALE, sinks=inp["sinks"], **extra, **kw)


def check_real_rows(meta: Dsv4VerifyMetadata, caches: list[Dsv4LayerCache],
                    inputs: list[dict[str, torch.Tensor]], outs: list[torch.Tensor],
                    topk: torch.Tensor | None = None) -> None:
    real = meta.total_rows
    for i, ratio in enumerate(LAYERS):
        want = cpu_attention(meta, caches[i], inputs[i], ratio)
        torch.testing.assert_close(outs[i][:real], want.attention_out[:real], rtol=1e-5, atol=1e-5)
        if ratio == 4 and i == len(LAYERS) - 1 and topk is not None:  # the buffer holds the last C4 layer's
            assert torch.equal(topk[:real], want.topk_indices[:real, 0])


# ----------------------------------------------------------------------------------------------------------
# eager steps


def test_the_steps_cross_compressed_boundaries_with_padding() -> None:
    for tier, steps in STEPS.items():
        for lens, prefix in steps:
            meta = plan(lens, prefix, tier)
            assert meta.num_slots == SLOTS[tier] and meta.total_rows < tier  # padding requests, empty slots
            assert all(int(meta.compressed[r].host.cmp_writes.sum()) > 0 for r in (4, 128))
            assert (meta.host.kv_lens >= 1).all()


@pytest.mark.parametrize("tier", sorted(STEPS))
def test_eager_layers_match_the_cpu_attention_with_arguments_built_once_per_step(npu: FakeNpu, tier: int
                                                                                  ) -> None:
    attn = backend()
    caches = make_caches(tier)
    topk_ptrs = set()
    for n, (lens, prefix) in enumerate(STEPS[tier]):
        meta = plan(lens, prefix, tier)
        guarded = device_only(meta)
        inputs = make_inputs(tier, 100 * tier + n)
        start = len(npu.calls)
        outs = run_layers(attn, caches, inputs, guarded)
        calls = npu.calls[start:]
        # the step's tiling plans once (one per layer kind, and the indexer's), then each layer's operators
        assert [name for name, _ in calls] == [SAS_PLAN] * 3 + [LI_PLAN] + [LI, SAS, SAS, SAS, LI, SAS]
        plans = [kw for name, kw in calls if name == SAS_PLAN]
        assert [(kw["cmp_ratio"], kw["has_cmp_kv"], kw["cmp_topk"]) for kw in plans] == [
            (1, False, 0), (4, True, CFG.index_topk), (128, True, 0)]
        assert all((kw["batch_size"], kw["max_seqlen_q"], kw["max_seqlen_kv"])
                   == (meta.num_slots, CFG.num_draft_tokens, meta.max_seqlen_kv) for kw in plans)
        sas = [kw for name, kw in calls if name == SAS]
        li = [kw for name, kw in calls if name == LI]
        dev = guarded.device
        # the metadata's own device arrays, the same objects in every layer's call: nothing rebuilt per layer
        assert all(kw["cu_seqlens_q"] is dev.cu_seqlens_q and kw["seqused_kv"] is dev.kv_lens for kw in sas)
        assert all(kw["ori_block_table"] is dev.ori_block_table for kw in sas)
        assert sas[0]["cmp_block_table"] is guarded.compressed[4].device.cmp_block_table
        assert sas[2]["cmp_block_table"] is guarded.compressed[128].device.cmp_block_table
        assert all(kw["actual_seq_lengths_query"] is li[0]["actual_seq_lengths_query"] for kw in li)
        assert all(kw["actual_seq_lengths_key"] is dev.kv_lens for kw in li)
        assert sas[3]["cmp_sparse_indices"] is sas[0]["cmp_sparse_indices"]
        assert sas[3]["metadata"] is sas[0]["metadata"] and sas[1]["metadata"] is not sas[0]["metadata"]
        assert [kw["cmp_ratio"] for kw in sas] == [4, 1, 128, 4]
        assert "cmp_kv" not in sas[1] and "cmp_sparse_indices" not in sas[2]
        topk = sas[0]["cmp_sparse_indices"]
        assert topk.shape == (tier, 1, CFG.index_topk)
        topk_ptrs.add(topk.data_ptr())
        check_real_rows(meta, caches, inputs, outs, topk[:, 0])
    assert len(topk_ptrs) == 1  # the tier's top-k buffer is allocated once


def test_window_layers_can_take_the_window_as_explicit_slots(npu: FakeNpu) -> None:
    attn = backend(window_via_indices=True)
    caches = make_caches(5)
    meta = plan(*STEPS[12][0], 12)
    inputs = make_inputs(12, 5)
    outs = run_layers(attn, caches, inputs, device_only(meta))
    sas = [kw for name, kw in npu.calls if name == SAS]
    assert sas[1]["ori_sparse_indices"].shape == (12, 1, CFG.window)
    assert "ori_sparse_indices" not in sas[0]  # the compressed kernels ignore it
    want = cpu_attention(meta, caches[1], inputs[1], 0, use_swa_indices=True).attention_out
    torch.testing.assert_close(outs[1][: meta.total_rows], want[: meta.total_rows], rtol=1e-5, atol=1e-5)


def test_layer_and_cache_mismatches_are_refused(npu: FakeNpu) -> None:
    attn = backend()
    caches = make_caches(0)
    meta = plan(*STEPS[12][0], 12)
    inputs = make_inputs(12, 0)
    with pytest.raises(Dsv4AscendBackendError, match="its cache"):
        attn.attend(1, inputs[1]["q"], caches[0], meta)
    with pytest.raises(Dsv4AscendBackendError, match="needs index_query"):
        attn.attend(0, inputs[0]["q"], caches[0], meta, sinks=inputs[0]["sinks"])


# ----------------------------------------------------------------------------------------------------------
# graphs per tier


def capture(npu: FakeNpu, attn: Dsv4AscendAttention, caches: list[Dsv4LayerCache], tier: int
            ) -> tuple[FakeGraph, list[dict[str, torch.Tensor]], list[torch.Tensor]]:
    meta = device_only(plan(*STEPS[tier][0], tier))
    inputs = make_inputs(tier, tier)  # the graph's static inputs
    graph = FakeGraph()
    with attn.capturing(tier, meta), npu.graph_capture(graph):
        outs = run_layers(attn, caches, inputs, meta)
    return graph, inputs, outs


def test_captured_tiers_own_their_buffers_and_replay_the_updated_step(npu: FakeNpu) -> None:
    attn = backend()
    caches = make_caches(1)
    captured = {tier: capture(npu, attn, caches, tier) for tier in (12, 24)}
    tiers = {tier: attn._tiers[tier].args for tier in captured}
    for tier in tiers:
        graph = captured[tier][0]
        assert graph.entries[0][0].endswith("wait")  # the replay waits for update_captured's event first
        assert [name for name, _ in graph.entries].count(SAS) == len(LAYERS)
        assert not any(name in (SAS_PLAN, LI_PLAN) for name, _ in graph.entries)  # plans stay outside
    sas_calls = [kw for name, kw in npu.calls if name == SAS]
    for k, tier in enumerate((12, 24)):  # per tier, shared by its layers; distinct between tiers
        args, layer_calls = tiers[tier], sas_calls[k * len(LAYERS):(k + 1) * len(LAYERS)]
        assert all(kw["cu_seqlens_q"] is args.cu_seqlens_q and kw["seqused_kv"] is args.seqused_kv
                   for kw in layer_calls)
        assert [kw["metadata"] for kw in layer_calls] == [args.tiling[r] for r in LAYERS]
        assert layer_calls[0]["cmp_sparse_indices"] is layer_calls[3]["cmp_sparse_indices"] is args.topk_view
        assert args.topk.shape == (tier, CFG.index_topk)
    assert tiers[12].cu_seqlens_q is not tiers[24].cu_seqlens_q and tiers[12].topk is not tiers[24].topk
    assert all(tiers[12].tiling[k] is not tiers[24].tiling[k] for k in tiers[12].tiling)
    before_24 = {k: plain(v).clone() for k, v in tiers[24].tiling.items()}

    # the next step of tier 12: new lengths and tables, new cache contents, new inputs in the static buffers
    meta2 = plan(*STEPS[12][1], 12)
    refill(caches, 7)
    graph, inputs, outs = captured[12]
    for static, new in zip(inputs, make_inputs(12, 77), strict=True):
        for name, t in static.items():
            t.copy_(new[name])
    npu.log.clear()
    start = len(npu.calls)
    attn.update_captured(12, device_only(meta2))
    # the patch waits for the compute stream (a replay in flight), runs on the update stream, then signals
    assert npu.log == ["update waits compute"] + [f"{SAS_PLAN}@update"] * 3 + [f"{LI_PLAN}@update",
                                                                                "event1 record@update"]
    plans = [kw for _, kw in npu.calls[start:]]
    assert all(kw["cu_seqlens_q"] is tiers[12].cu_seqlens_q for kw in plans[:3])  # read from the tier
    assert all(kw["max_seqlen_kv"] == meta2.max_seqlen_kv for kw in plans[:3])
    assert torch.equal(plain(tiers[12].cu_seqlens_q), meta2.device.cu_seqlens_q)
    assert torch.equal(plain(tiers[12].seqused_kv), meta2.device.kv_lens)
    assert torch.equal(plain(tiers[12].cmp_block_table[4]), meta2.compressed[4].device.cmp_block_table)
    assert all(int(plain(tiers[12].tiling[k])[0]) > int(before_24[k][0]) for k in tiers[12].tiling)
    assert all(torch.equal(plain(tiers[24].tiling[k]), before_24[k]) for k in before_24)  # tier 24 untouched

    graph.replay()
    eager = run_layers(attn, caches, inputs, device_only(meta2))
    for got, want in zip(outs, eager, strict=True):  # the replayed graph is the eager step, padding rows too
        assert torch.equal(got, want)
    check_real_rows(meta2, caches, inputs, outs, tiers[12].topk)


def test_update_refuses_a_step_planned_for_other_shapes(npu: FakeNpu) -> None:
    attn = backend()
    caches = make_caches(2)
    capture(npu, attn, caches, 12)
    with pytest.raises(Dsv4AscendBackendError, match="num_slots=4"):
        attn.update_captured(12, plan(*STEPS[12][1], 12, num_slots=5))
    with pytest.raises(Dsv4AscendBackendError, match="was not captured"):
        attn.update_captured(24, plan(*STEPS[24][1], 24))


# ----------------------------------------------------------------------------------------------------------
# construction


def test_without_torch_npu_the_constructor_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    with pytest.raises(RuntimeError, match="needs torch_npu on an Ascend machine"):
        backend()


def test_operators_are_resolved_in_the_chosen_namespace(npu: FakeNpu, monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    custom = types.SimpleNamespace(**{name: getattr(npu, name) for name in OPS})
    monkeypatch.setattr(torch.ops, "custom", custom, raising=False)
    attn = backend(ops=SGLANG_OPS)
    assert attn._sas == npu.npu_sparse_attn_sharedkv and attn._indexer == npu.npu_quant_lightning_indexer
    delattr(sys.modules["torch_npu"], LI)
    # a model without C4 layers needs no indexer
    Dsv4AscendAttention((0, 128), num_heads=H, head_dim=D, softmax_scale=SCALE)
    with pytest.raises(RuntimeError, match="torch_npu has no operator npu_quant_lightning_indexer"):
        backend()
