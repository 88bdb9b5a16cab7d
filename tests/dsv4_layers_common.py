"""What the DSV4 device-layer tests share (tests/test_dsv4_ascend_layers.py, tests/test_dsv4_cuda_layers*.py):
a small geometry whose C4 and C128-kind (ratio 8) blocks close every few positions, four prefilled requests,
the steps they run, the forwards through a layer backend and through `paged.layer_forward`, and the checks of
`Dsv4CudaLayers` that run both on the torch oracle (in pytest) and on the Triton kernel under the interpreter.

The lightning indexer scores in float (`index_quant` False, as CUDA and the CPU run it) unless a function is
given `index_quant=True` (Ascend's int8 indexer, `Dsv4Geometry.for_backend("ascend")`; also an option of the
CUDA layers): the model, its prefilled caches and the CPU forward then score int8 queries and keys. Both
models have the same weights. On the steps of LAYER_STEPS the two scorings choose different entries for some
rows (tests/test_dsv4_cuda_layers.py asserts it), so a backend that scores the other way fails the checks.

`TRITON_INTERPRET` is read when `triton.jit` decorates a kernel, so run as a script this module sets it before
importing anything, in a fresh process (tests/test_dsv4_cuda_layers.py starts it through
`tests.interp_runner.interpreter_results`), and prints one JSON object: check name -> "ok" or the traceback.
Imported, it sets nothing. The interpreter neither computes bf16 correctly nor checks bounds, so the
interpreter checks are fp32 and compare against the paged CPU forward.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import copy  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from dspark.formats.dsv4_config import Dsv4Geometry, dsv4_cache_layout  # noqa: E402
from dspark.runtime.families.dsv4.cpu_attention import Dsv4PagedAttention, extend_config, step_config  # noqa: E402
from dspark.runtime.families.dsv4.cpu_paged import (  # noqa: E402
    Dsv4LayerCache,
    Dsv4PagedCaches,
    layer_forward,
    max_rows_per_request,
    prefill,
    slot_page_tables,
)
from dspark.runtime.families.dsv4.cuda_layers import Dsv4CudaLayers  # noqa: E402
from dspark.runtime.families.dsv4.model import DSV4Model  # noqa: E402
from dspark.runtime.families.dsv4.target import Dsv4ForCausalLM, Dsv4LayerBackend  # noqa: E402
from dspark.runtime.families.dsv4.verify_metadata import (  # noqa: E402
    Dsv4StepConfig,
    Dsv4VerifyMetadata,
    plan_dsv4_verify,
)
from dspark.runtime.kernels.dispatch import Impl  # noqa: E402
from tests.dsv4_fake_npu import device_only, plain  # noqa: E402
from tests.interp_runner import run_checks  # noqa: E402

N = 4  # rows a request verifies at most
# The whole architecture: routed experts (the first layer hash-routed), hyper-connections, the grouped output
# projection, YaRN on the compressed layers. The float indexer (CUDA's and the CPU's); `geometry(True)` is
# Ascend's int8 one. Four index heads (and PROMPTS): some rows of LAYER_STEPS choose otherwise in int8.
CFG = Dsv4Geometry(vocab_size=64, dim=32, compress_ratios=(4, 0, 8, 4), csa_ratio=4, hca_ratio=8, n_heads=2,
                   head_dim=16, rope_dim=4, q_lora_rank=16, window=6, index_n_heads=4, index_head_dim=8,
                   index_topk=3, inter_dim=48, ffn="moe", n_routed_experts=4, n_activated_experts=2,
                   n_hash_layers=1, route_scale=1.5, swiglu_limit=10.0, hc_mult=2, o_groups=2, o_lora_rank=8,
                   rope_factor=4.0, rope_original_max_position=16, index_quant=False)
RING = 12  # required_ring_size(CFG, N) = 8 + N - 1, in whole pages
STEP = Dsv4StepConfig(num_draft_tokens=N, window=CFG.window, compress_ratios=(4, 8), swa_page_size=4,
                      swa_ring_size=RING, cmp_page_sizes={4: 3, 8: 2}, index_topk=CFG.index_topk,
                      padding_request_rows=2)
MAX_REQ, MAX_LEN = 4, 64
# Prefixes 3 and 5: the next step closes C4 block 0 and C8 block 0 (no predecessor), and C4 block 1; 29 and
# 22 give the indexer a choice among up to 8 entries.
PROMPTS = (3, 5, 29, 22)
ENTRIES = ("cmp_kv", "index_kv")  # pooled: compared within 1e-6; every other cache bitwise

LAYER_STEPS = {  # name -> verify_lens, tier, num_slots (prefixes: PROMPTS)
    "static": ([N] * 4, None, None),
    "compact": ([2, 4, 1, 3], 12, 8),
    "compact_padded": ([1, 3, 4, 2], 16, 10),
}
SCRIPT = [  # per step: tier (None: static, every request N rows) and per request (rows, accepted rows)
    (None, [(4, 1), (4, 3), (4, 1), (4, 2)]),
    (12, [(3, 3), (1, 1), (4, 1), (2, 1)]),
    (16, [(4, 2), (2, 1), (3, 3), (1, 1)]),
    (None, [(4, 4), (4, 1), (4, 2), (4, 3)]),
    (12, [(1, 1), (4, 2), (2, 2), (3, 1)]),
]
# Graphs: steps of one tier and slot count (page tables spanning MAX_LEN), per step (rows, accepted rows).
TIER, SLOTS = 16, 12
GRAPH_STEPS = [([2, 4, 1, 3], [1, 2, 0, 3]), ([4, 1, 3, 2], [4, 1, 2, 1]), ([1, 2, 1, 4], [1, 1, 1, 2])]


def geometry(index_quant: bool = False) -> Dsv4Geometry:
    """CFG with the float (False) or the int8 (True) lightning indexer."""
    return dataclasses.replace(CFG, index_quant=index_quant)


@functools.cache
def model(index_quant: bool = False) -> DSV4Model:
    """The model of `geometry(index_quant)`: the same weights either way."""
    return DSV4Model(geometry(index_quant), seed=0)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@functools.cache
def prefilled(index_quant: bool = False) -> Dsv4PagedCaches:
    """The four requests' prompts in the caches (shuffled pages), by the CPU path of `model(index_quant)`;
    never mutated: clone()."""
    caches = Dsv4PagedCaches.allocate(geometry(index_quant), STEP, MAX_REQ, MAX_LEN, seed=7)
    prefill(model(index_quant), caches, range(MAX_REQ),
            [tokens(n, seed=10 + i) for i, n in enumerate(PROMPTS)])
    return caches


def plan(caches: Dsv4PagedCaches, lens: list[int], prefix: list[int], **kw: Any) -> Dsv4VerifyMetadata:
    return plan_dsv4_verify(lens, prefix, kw.pop("config", STEP), caches.page_tables(range(len(lens))), **kw)


def step_tokens(meta: Dsv4VerifyMetadata, seed: int) -> torch.Tensor:
    out = torch.zeros(meta.tier, dtype=torch.long)  # padding rows run token 0
    out[: meta.total_rows] = torch.tensor(tokens(meta.total_rows, seed))
    return out


def forward(layers: Dsv4LayerBackend, toks: torch.Tensor, meta: Dsv4VerifyMetadata,
            m: DSV4Model | None = None, *, index_quant: bool = False) -> torch.Tensor:
    """Logits [T, vocab] of the step through `layers` (with `model(index_quant)` unless `m` is given)."""
    m = model(index_quant) if m is None else m
    h = m.embed_tokens(toks)
    for i, layer in enumerate(m.layers):
        h = layers.forward_layer(i, layer, h, toks, meta)
    return plain(m.lm_head(h))


def cpu_forward(caches: Dsv4PagedCaches, toks: torch.Tensor, meta: Dsv4VerifyMetadata, *,
                index_quant: bool = False) -> torch.Tensor:
    m = model(index_quant)
    h = m.embed_tokens(toks)
    for layer, lc in zip(m.layers, caches.layers, strict=True):
        h = layer_forward(layer, lc, h, toks, meta, None)
    return m.lm_head(h)


def assert_caches_match(want: Dsv4LayerCache, got: Dsv4LayerCache, *, rtol: float = 0.0) -> None:
    """Every page but the null page: bitwise for rows, within 1e-6 (or `rtol`) for pooled entries."""
    for name, w in want.tensors().items():
        g = getattr(got, name).to(w.device)
        if name in ENTRIES or rtol:
            tol = max(rtol, 1e-6)
            torch.testing.assert_close(g[1:], w[1:], rtol=tol, atol=tol, msg=name)
        else:
            assert torch.equal(g[1:], w[1:]), name


# ---------------------------------------------------------------------------------------------------------
# Dsv4CudaLayers against the paged CPU forward, on the torch oracle or the Triton kernel (`impl`)


def cuda_layers(caches: Dsv4PagedCaches, impl: Impl) -> Dsv4CudaLayers:
    return Dsv4CudaLayers(caches, max_rows_per_request(CFG, RING), MAX_LEN, impl=impl)


def caches_on(caches: Dsv4PagedCaches, device: torch.device | str, dtype: torch.dtype) -> Dsv4PagedCaches:
    """A copy of `caches` on `device` in `dtype`."""
    layers = [Dsv4LayerCache(lc.ratio, **{k: t.to(device, dtype) for k, t in lc.tensors().items()})
              for lc in caches.layers]
    return dataclasses.replace(caches, layers=layers)


def model_on(device: torch.device | str, dtype: torch.dtype) -> DSV4Model:
    """A copy of `model()` on `device` in `dtype`."""
    return copy.deepcopy(model()).to(device=device, dtype=dtype)


def check_layers(impl: Impl, name: str, index_quant: bool = False) -> None:
    """One step of LAYER_STEPS, layer by layer, with the float or the int8 indexer (the model's
    `index_quant`): every row's output (padding rows too, which see no key and give the sink's zeros in both)
    within 1e-5, the caches as `assert_caches_match` says."""
    lens, tier, num_slots = LAYER_STEPS[name]
    base = prefilled(index_quant)
    meta = plan(base, lens, list(PROMPTS), tier=tier, num_slots=num_slots)
    cpu, mine = base.clone(), base.clone()
    layers = cuda_layers(mine, impl)
    guarded = device_only(meta)
    m = model(index_quant)
    toks = step_tokens(meta, seed=len(name))
    h = m.embed_tokens(toks)
    with torch.no_grad():
        for i, layer in enumerate(m.layers):
            got = plain(layers.forward_layer(i, layer, h, toks, guarded))
            want = layer_forward(layer, cpu.layers[i], h, toks, meta, None)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{name}: layer {i}")
            assert_caches_match(cpu.layers[i], mine.layers[i])
            h = want


@torch.no_grad()
def check_bf16(device: torch.device | str, impl: Impl, tol: float) -> None:
    """A bf16 model over bf16 caches on `device`, one step of each of LAYER_STEPS: the real rows' logits
    finite and within `tol` of the fp32 CPU forward's, relative by norm."""
    m, base = model_on(device, torch.bfloat16), prefilled()
    for k, (lens, tier, num_slots) in enumerate(LAYER_STEPS.values()):
        meta = plan(base, lens, list(PROMPTS), tier=tier, num_slots=num_slots)
        toks = step_tokens(meta, seed=300 + k)
        want = cpu_forward(base.clone(), toks, meta)[: meta.total_rows]
        layers = cuda_layers(caches_on(base, device, torch.bfloat16), impl)
        dev_meta = plan(base, lens, list(PROMPTS), tier=tier, num_slots=num_slots, device=device)
        got = forward(layers, toks.to(device), dev_meta, m)[: meta.total_rows].float().cpu()
        assert torch.isfinite(got).all()
        err = float((got - want).norm() / want.norm())
        assert err < tol, (lens, err)


@functools.cache
def target(index_quant: bool = False) -> Dsv4ForCausalLM:
    t = Dsv4ForCausalLM(geometry(index_quant))
    t.model.load_state_dict(model().state_dict())
    return t


def check_multi_step(impl: Impl, script: list[tuple[int | None, list[tuple[int, int]]]] = SCRIPT,
                     index_quant: bool = False) -> None:
    """Prefill chunks, then verify steps with scripted acceptances (rejected rows closing blocks of both
    kinds), through `Dsv4ForCausalLM.forward_paged_states` with caches from `allocate` on request slots out
    of order, with the float or the int8 indexer: the logits of every real row within 1e-4 of the CPU
    backend's and the same argmax, and at the end every cache within 1e-4."""
    t = target(index_quant)
    layout = dsv4_cache_layout(t.cfg, N, page_size=STEP.swa_page_size, prefill_rows=N)
    config = step_config(layout, N, padding_request_rows=2)
    cpu = Dsv4PagedAttention.allocate(t, layout, config, MAX_REQ, MAX_LEN)
    mine = Dsv4CudaLayers.allocate(t, layout, config, MAX_REQ, MAX_LEN, device="cpu", impl=impl)
    slots = [2, 0, 3, 1]  # request r lives in slot slots[r]

    def run(meta: Dsv4VerifyMetadata, toks: torch.Tensor) -> torch.Tensor:
        want, _ = t.forward_paged_states(toks, meta.device.positions, cpu, meta)
        guarded = device_only(meta)
        got, _ = t.forward_paged_states(toks, guarded.device.positions, mine, guarded)
        want, got, real = t.compute_logits(want), t.compute_logits(plain(got)), meta.total_rows
        torch.testing.assert_close(got[:real], want[:real], rtol=1e-4, atol=1e-4)
        assert torch.equal(got[:real].argmax(-1), want[:real].argmax(-1))
        return want

    seqs = [tokens(n, seed=20 + i) for i, n in enumerate(PROMPTS)]
    chunk = extend_config(layout, config)
    done, pending = [0] * MAX_REQ, [0] * MAX_REQ  # pending: each request's next token (its last argmax)
    while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
        rows = [s[d : d + chunk.num_draft_tokens] for d, s in zip(done, seqs, strict=True)]
        live = [r for r in range(MAX_REQ) if rows[r]]
        meta = plan_dsv4_verify([len(rows[r]) for r in live], [done[r] for r in live], chunk,
                                slot_page_tables(config, MAX_LEN, [slots[r] for r in live]))
        want = run(meta, torch.tensor([tok for r in live for tok in rows[r]]))
        for i, r in enumerate(live):
            done[r] += len(rows[r])
            pending[r] = int(want[meta.host.cu_seqlens_q[i + 1] - 1].argmax())
    prefix = list(PROMPTS)
    rejected = dict.fromkeys(config.compress_ratios, 0)
    for k, (tier, steps) in enumerate(script):
        tables = slot_page_tables(config, MAX_LEN, slots)
        meta = plan_dsv4_verify([n for n, _ in steps], prefix, config, tables, tier=tier,
                                num_slots=None if tier is None else 8)
        toks = step_tokens(meta, seed=100 + k)
        cu = meta.host.cu_seqlens_q
        for r in range(MAX_REQ):
            toks[cu[r]] = pending[r]  # each request's first row is the token its last step predicted
        want = run(meta, toks)
        for r, (n, accepted) in enumerate(steps):  # the rest is rejected: forgotten, not undone
            for q in range(prefix[r] + accepted, prefix[r] + n):
                for ratio in rejected:
                    rejected[ratio] += (q + 1) % ratio == 0
            pending[r] = int(want[cu[r] + accepted - 1].argmax())
            prefix[r] += accepted
    assert min(rejected.values()) > 0, rejected  # rejected rows closed blocks of both kinds
    for want_layer, got_layer in zip(cpu.caches.layers, mine.caches.layers, strict=True):
        assert_caches_match(want_layer, got_layer, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# run as a script: the Triton kernel under the interpreter (the float indexer, as CUDA serves: the indexer is
# torch code either way, checked with int8 on the torch oracle)

INTERP_CHECKS = {
    **{f"layers_{name}": functools.partial(check_layers, "triton", name) for name in LAYER_STEPS},
    "multi_step_with_rollback": functools.partial(check_multi_step, "triton"),
}

if __name__ == "__main__":
    sys.exit(run_checks(INTERP_CHECKS))


def check_host_refusals(layers: Any, error: type[Exception]) -> None:
    """The checks a device backend makes on the host before a layer runs: the step's cache layout, the
    positions against max_context_len, the layer's compress ratio."""
    m = model()
    other = dataclasses.replace(STEP, cmp_page_sizes={4: 2, 8: 2})
    meta = plan(prefilled(), [1], [3], config=other)
    with pytest.raises(error, match="another cache layout"):
        layers.forward_layer(0, m.layers[0], torch.zeros(1, CFG.dim), torch.zeros(1, dtype=torch.long), meta)
    with pytest.raises(error, match="max_context_len"):
        layers.forward_layer(0, m.layers[0], torch.zeros(1, CFG.dim), torch.zeros(1, dtype=torch.long),
                             plan(prefilled(), [1], [MAX_LEN]))
    with pytest.raises(error, match="compress ratio"):
        layers.forward_layer(1, m.layers[0], torch.zeros(1, CFG.dim), torch.zeros(1, dtype=torch.long),
                             plan(prefilled(), [1], [3]))
