"""The DSV4 CUDA layers (dspark.runtime.families.dsv4.cuda_layers) on the CPU: the torch oracle of the
attention (`impl="torch"`) and, under the Triton interpreter in a subprocess, the kernel, against the paged
CPU forward (dsv4.paged) with device arrays that refuse host reads (tests/dsv4_fake_npu.py's `device_only`).

What is equal and how:
* a layer's output, padding rows included (they see no key, so the sink gives zeros in both): within 1e-5;
  raw K=V and compressor rows bitwise, pooled entries within 1e-6 (tests/dsv4_layers_common.py);
* the indexer's choice: `Indexer.select`'s, id for id, on a step's real scores and on constructed ties;
The layers run with the float lightning indexer (`index_quant` False, what CUDA serves) and with its int8
option; on the steps checked, the two choose different entries for some rows (asserted), so a layer that
scored the other way would fail.
* logits of prefill chunks and verify steps with rollback through `Dsv4ForCausalLM.forward_paged_states`:
  within 1e-4 and the same argmax;
* a captured tier replayed after `update_captured` (a recording of every op, standing in for a CUDA graph)
  and the eager step: bitwise, every row and every cache page.
The GPU checks (compiled kernel, bf16, real CUDA graphs) are in tests/test_dsv4_cuda_layers_gpu.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark.formats.dsv4_config import dsv4_cache_layout
from dspark.runtime.families.dsv4.cpu_attention import Dsv4PagedAttention, step_config
from dspark.runtime.families.dsv4.cpu_paged import Dsv4LayerTrace, layer_forward
from dspark.runtime.families.dsv4.cuda_layers import Dsv4CudaLayers, indexer_topk
from dspark.runtime.families.dsv4.device_layers import Dsv4DeviceLayersError
from dspark.runtime.families.dsv4.model import Indexer
from dspark.runtime.families.dsv4.triton_attention import dsv4_attention_args
from dspark.runtime.kernels import dispatch
from tests.dsv4_fake_npu import device_only, plain
from tests.dsv4_layers_common import (
    CFG,
    GRAPH_STEPS,
    INTERP_CHECKS,
    LAYER_STEPS,
    MAX_LEN,
    MAX_REQ,
    PROMPTS,
    SLOTS,
    STEP,
    TIER,
    N,
    check_bf16,
    check_host_refusals,
    check_layers,
    check_multi_step,
    cpu_forward,
    cuda_layers,
    forward,
    model,
    plan,
    prefilled,
    step_tokens,
    target,
)
from tests.interp_runner import interpreter_results
from tests.recorded_graph import RecordedGraph

# ---------------------------------------------------------------------------------------------------------
# one step, layer by layer, and many steps through the target, on the torch oracle

QUANT = pytest.mark.parametrize("index_quant", [False, True], ids=["float", "int8"])


@QUANT
@pytest.mark.parametrize("name", sorted(LAYER_STEPS))
def test_each_layer_equals_the_paged_forward_and_writes_the_same_caches(name: str, index_quant: bool) -> None:
    lens, tier, num_slots = LAYER_STEPS[name]
    meta = plan(prefilled(index_quant), lens, list(PROMPTS), tier=tier, num_slots=num_slots)
    visible = meta.compressed[4].host.cmp_visible
    assert visible.max() > CFG.index_topk  # the indexer has a real choice
    assert (meta.host.row_slot >= meta.num_requests).any() == (tier is not None)  # padding rows
    check_layers("torch", name, index_quant)


@QUANT
def test_prefill_and_verify_steps_with_rollback_give_the_cpu_backends_logits(index_quant: bool) -> None:
    check_multi_step("torch", index_quant=index_quant)


def test_bf16_is_finite_and_close() -> None:
    check_bf16("cpu", "torch", tol=0.05)


def test_attention_reads_the_metadatas_arrays() -> None:
    """Eager steps hand the kernel the metadata's own device arrays, as `dsv4_attention_args` names them."""
    layers = cuda_layers(prefilled().clone(), "torch")
    meta = plan(prefilled(), [2, 4, 1, 3], list(PROMPTS), tier=12, num_slots=8)
    step = layers._step_for(0, meta)
    for ratio in (0, *STEP.compress_ratios):
        got, want = layers.attention_args(step, ratio), dsv4_attention_args(meta, ratio)
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] is value if isinstance(value, torch.Tensor) else got[key] == value, (ratio, key)


# ---------------------------------------------------------------------------------------------------------
# the indexer against Indexer.select


def _select_rows(indexer: Indexer, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                 visible: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k]: Indexer.select on each row's first `visible` keys [T, E, ID], padded with -1."""
    out = torch.full((q.shape[0], k), -1, dtype=torch.int32)
    for t, vis in enumerate(visible.tolist()):
        if vis:
            chosen = indexer.select(q[t], w[t], keys[t, :vis])
            out[t, : chosen.numel()] = chosen.to(torch.int32)
    return out


def _step_choices(name: str, index_quant: bool) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A step of LAYER_STEPS through paged.layer_forward (whose top-k is Indexer.select's) with the float or
    the int8 indexer: per C4 layer, the trace's top-k and `indexer_topk` on the trace's own index queries,
    weights and keys, int8 as the model scores and the other way."""
    lens, tier, num_slots = LAYER_STEPS[name]
    meta = plan(prefilled(index_quant), lens, list(PROMPTS), tier=tier, num_slots=num_slots)
    caches, m = prefilled(index_quant).clone(), model(index_quant)
    trace: list[Dsv4LayerTrace] = []
    toks = step_tokens(meta, seed=len(name))
    h = m.embed_tokens(toks)
    for layer, lc in zip(m.layers, caches.layers, strict=True):
        h = layer_forward(layer, lc, h, toks, meta, trace)
    guarded = device_only(meta)
    plan4 = guarded.compressed[4].device
    c4 = [(lc, tr) for lc, tr in zip(caches.layers, trace, strict=True) if tr.topk is not None]
    assert len(c4) == 2
    out = []
    for lc, tr in c4:  # a layer's index keys are written by its own layer only: as its indexer saw them
        assert tr.index_query is not None and tr.index_weights is not None and lc.index_kv is not None
        assert tr.topk is not None
        got, other = (plain(indexer_topk(tr.index_query, tr.index_weights, lc.index_kv,
                                         row_slot=guarded.device.row_slot, cmp_visible=plan4.cmp_visible,
                                         cmp_block_table=plan4.cmp_block_table, topk=CFG.index_topk,
                                         int8=int8))
                      for int8 in (index_quant, not index_quant))
        out.append((tr.topk, got, other))
    return out


@QUANT
@pytest.mark.parametrize("name", sorted(LAYER_STEPS))
def test_indexer_choice_is_indexer_select_on_a_step(name: str, index_quant: bool) -> None:
    """On the step's own index queries, weights and keys, scored as the model scores them (float or int8):
    the same ids as the trace's (Indexer.select's) for every row, padding rows included."""
    for want, got, _ in _step_choices(name, index_quant):
        assert torch.equal(got, want)


@QUANT
def test_the_int8_and_float_indexers_choose_differently_on_the_layer_steps(index_quant: bool) -> None:
    """What makes the float and int8 checks above meaningful: on the steps of LAYER_STEPS, scoring the other
    way chooses other entries for some row (so a layer or `indexer_topk` scoring the wrong way fails)."""
    differ = {name: [int((got != other).any(1).sum()) for _, got, other in _step_choices(name, index_quant)]
              for name in sorted(LAYER_STEPS)}
    assert any(sum(rows) for rows in differ.values()), differ


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
def test_indexer_ties_go_to_the_lower_id_as_indexer_select_orders_them(int8: bool) -> None:
    """Scores built from small dyadic values (exact in any summation order) with many equal scores, zero
    scores (every head's relu at 0) and ties across the top-k boundary; rows see 0, fewer than k, k, and more
    than k entries over shuffled pages of several slots; a table narrower than k pads with -1."""
    g = torch.Generator().manual_seed(0)
    heads, dim, k, page = 3, 4, 4, 2
    cfg = dataclasses.replace(CFG, index_n_heads=heads, index_head_dim=dim, index_topk=k, index_quant=int8)
    indexer = Indexer(cfg, 1.0)
    pool = torch.tensor([[1.0, 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [-1, -1, -1, -1]])
    slots, cols = 3, 5  # 10 entries per slot
    index_kv = torch.zeros(1 + slots * cols, page, dim)
    table = (1 + torch.randperm(slots * cols, generator=g)).view(slots, cols).to(torch.int32)
    entries = pool[torch.randint(0, len(pool), (slots, cols * page), generator=g)]  # duplicates: ties
    for b in range(slots):
        for e in range(cols * page):
            index_kv[table[b, e // page], e % page] = entries[b, e]
    visible = torch.tensor([0, 1, 3, 4, 5, 7, 10, 10, 9, 6, 2, 8], dtype=torch.int32)
    rows = visible.numel()
    row_slot = torch.randint(0, slots, (rows,), generator=g, dtype=torch.int32)
    q = torch.randint(-2, 3, (rows, heads, dim), generator=g).float() / 2
    w = torch.tensor([1.0, 0.5, -0.25])[None, :].expand(rows, heads).clone()
    w[3] = 0.0  # every score 0: the k lowest ids
    keys = entries[row_slot.long()]  # [T, E, ID]: each row's entries in id order
    got = indexer_topk(q, w, index_kv, row_slot=row_slot, cmp_block_table=table, cmp_visible=visible, topk=k,
                       int8=int8)
    assert got.dtype == torch.int32 and got.shape == (rows, k)
    assert torch.equal(got, _select_rows(indexer, q, w, keys, visible, k))
    # ties do decide: some row has equal scores (as the indexer scores them: int8 or float) on both sides of
    # its k-th choice
    ranked = [sorted(indexer.scores(q[t], w[t], keys[t, : int(visible[t])]).tolist(), reverse=True)
              for t in range(rows)]
    assert any(len(r) > k and r[k - 1] == r[k] for r in ranked), "no tie across the top-k boundary"
    narrow = table[:, :1]  # 2 entries per slot < k
    got = indexer_topk(q, w, index_kv, row_slot=row_slot, cmp_block_table=narrow,
                       cmp_visible=visible.clamp(max=page), topk=k, int8=int8)
    assert torch.equal(got, _select_rows(indexer, q, w, keys, visible.clamp(max=page), k))
    assert (got[:, page:] == -1).all()


# ---------------------------------------------------------------------------------------------------------
# graphs: a recording of every op stands in for a CUDA graph capture


def test_a_captured_tier_replays_the_updated_steps_as_eager() -> None:
    base = prefilled()
    graph_layers, eager_layers = cuda_layers(base.clone(), "torch"), cuda_layers(base.clone(), "torch")
    cpu = base.clone()
    static_ids = torch.zeros(TIER, dtype=torch.long)  # the graph's input buffer
    graph = RecordedGraph()
    prefix = list(PROMPTS)
    with torch.no_grad():
        for k, (lens, accepted) in enumerate(GRAPH_STEPS):
            meta = plan(base, lens, prefix, tier=TIER, num_slots=SLOTS, max_kv_len=MAX_LEN)
            guarded = device_only(meta)
            toks = step_tokens(meta, seed=200 + k)
            static_ids.copy_(toks)
            if k == 0:
                with graph_layers.capturing(TIER, guarded):
                    forward(graph_layers, static_ids, guarded)  # a warm-up pass: never part of the graph
                    with graph:
                        static_logits = forward(graph_layers, static_ids, guarded)
            else:
                graph_layers.update_captured(TIER, guarded)
                for name, static in graph_layers._tiers[TIER].arrays.items():  # every static array refreshed
                    assert torch.equal(static, graph_layers._step_arrays(meta)[name]), name
                graph.replay()
            eager = forward(eager_layers, toks, guarded)
            assert torch.equal(static_logits, eager)  # padding rows too
            for name, t in graph_layers.caches.tensors().items():
                assert torch.equal(t, eager_layers.caches.tensors()[name]), name
            want = cpu_forward(cpu, toks, meta)
            real = meta.total_rows
            torch.testing.assert_close(eager[:real], want[:real], rtol=1e-4, atol=1e-4)
            prefix = [p + a for p, a in zip(prefix, accepted, strict=True)]


def test_graph_misuse_is_refused() -> None:
    layers = cuda_layers(prefilled().clone(), "torch")
    meta = plan(prefilled(), [2, 4, 1, 3], list(PROMPTS), tier=TIER, num_slots=SLOTS, max_kv_len=MAX_LEN)
    with pytest.raises(Dsv4DeviceLayersError, match="was not captured"):
        layers.update_captured(TIER, meta)
    with pytest.raises(Dsv4DeviceLayersError, match="capturing tier 12"):
        with layers.capturing(12, meta):
            pass
    with layers.capturing(TIER, meta):
        small = plan(prefilled(), [2, 4, 1, 3], list(PROMPTS), tier=12, num_slots=8)
        with pytest.raises(Dsv4DeviceLayersError, match=f"capturing tier {TIER}"):
            layers.forward_layer(0, model().layers[0], torch.zeros(12, CFG.dim),
                                 torch.zeros(12, dtype=torch.long), small)
    other = plan(prefilled(), [2, 4, 1, 3], list(PROMPTS), tier=TIER, num_slots=SLOTS + 1, max_kv_len=MAX_LEN)
    before = {name: t.clone() for name, t in layers._tiers[TIER].arrays.items()}
    with pytest.raises(Dsv4DeviceLayersError, match=f"num_slots={SLOTS}"):
        layers.update_captured(TIER, other)
    assert all(torch.equal(t, before[name]) for name, t in layers._tiers[TIER].arrays.items())  # untouched


# ---------------------------------------------------------------------------------------------------------
# host-side checks and allocation


def test_steps_are_checked_on_the_host() -> None:
    check_host_refusals(cuda_layers(prefilled().clone(), "torch"), Dsv4DeviceLayersError)
    with pytest.raises(Dsv4DeviceLayersError, match="impl"):
        Dsv4CudaLayers(prefilled().clone(), N, MAX_LEN, impl="cuda")  # type: ignore[arg-type]


def test_allocate_lays_the_caches_out_as_the_cpu_backend_does() -> None:
    t = target()
    layout = dsv4_cache_layout(t.cfg, N, page_size=STEP.swa_page_size, prefill_rows=N)
    config = step_config(layout, N, padding_request_rows=2)
    cpu = Dsv4PagedAttention.allocate(t, layout, config, MAX_REQ, MAX_LEN)
    layers = Dsv4CudaLayers.allocate(t, layout, config, MAX_REQ, MAX_LEN, device="cpu", impl="torch")
    assert layers.max_extend_rows == cpu.max_extend_rows == layout.max_rows_per_request
    assert layers.impl == "torch" and layers.max_context_len == MAX_LEN
    assert (layers.caches.swa_pages == cpu.caches.swa_pages).all()
    assert all((layers.caches.cmp_pages[r] == pages).all() for r, pages in cpu.caches.cmp_pages.items())
    for name, tensor in cpu.caches.tensors().items():
        got = layers.caches.tensors()[name]
        assert got.shape == tensor.shape and got.dtype == tensor.dtype and not got.any(), name
    half = Dsv4CudaLayers.allocate(t, layout, config, 1, MAX_LEN, device="cpu", dtype=torch.bfloat16)
    assert {x.dtype for x in half.caches.tensors().values()} == {torch.bfloat16} and half.impl == "auto"


# ---------------------------------------------------------------------------------------------------------
# the Triton kernel under the interpreter (a subprocess: tests/dsv4_layers_common.py run as a script)


@pytest.fixture(scope="module")
def interp_results() -> dict[str, str]:
    if not dispatch.HAS_TRITON:
        pytest.skip("Triton is not installed")
    return interpreter_results("dsv4_layers_common.py")


@pytest.mark.parametrize("check", sorted(INTERP_CHECKS))
def test_triton_kernel_layers_match_the_paged_forward_under_interpreter(interp_results: dict[str, str],
                                                                        check: str) -> None:
    assert check in interp_results, f"the interpreter checks no longer run {check!r}"
    assert interp_results[check] == "ok", interp_results[check]
