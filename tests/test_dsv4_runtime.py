"""The dsv4 family in the engine: the serving target over the runtime's per-slot caches, driven by the step
layouts the engine plans (`plan_extend`, `plan_verify` with tiers and padding) through `plan_step_metadata`,
against the reference model's incremental steps; the scheduler's ring-bounded prefill chunks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark.formats.dsv4_config import Dsv4Geometry, dsv4_cache_layout
from dspark.runtime.engine.requests import Request
from dspark.runtime.engine.scheduler import Scheduler
from dspark.runtime.families.dsv4.cpu_attention import (
    Dsv4PagedAttention,
    extend_config,
    plan_step_metadata,
    step_config,
)
from dspark.runtime.families.dsv4.cpu_paged import slot_page_tables
from dspark.runtime.families.dsv4.target import Dsv4ForCausalLM
from dspark.runtime.kv_cache import RequestSlots
from dspark.runtime.layout import LayoutError, StepShape, plan_extend, plan_verify
from dspark.runtime.sampling import SamplingParams

CPU = torch.device("cpu")
N = 4
PAGE = 8
MAX_LEN = 96
GEOMETRY = Dsv4Geometry(vocab_size=64, dim=32, compress_ratios=(0, 4, 8), csa_ratio=4, hca_ratio=8, n_heads=2,
                        head_dim=16, rope_dim=4, q_lora_rank=16, window=6, index_n_heads=2, index_head_dim=8,
                        index_topk=3, inter_dim=48, norm_eps=1e-6, rope_theta=10000.0,
                        compress_rope_theta=160000.0)
# The released architecture at the same attention geometry: hash-routed and top-k experts, hyper-connections,
# the grouped output projection, YaRN on the compressed layers.
FULL = dataclasses.replace(GEOMETRY, ffn="moe", n_routed_experts=6, n_activated_experts=2, n_hash_layers=1,
                           route_scale=1.5, swiglu_limit=0.5, hc_mult=3, hc_sinkhorn_iters=5, o_groups=2,
                           o_lora_rank=8, rope_factor=4.0, rope_original_max_position=16)
LAYOUT = dsv4_cache_layout(GEOMETRY, N, PAGE, prefill_rows=10)
VERIFY = step_config(LAYOUT, N, padding_request_rows=N)
EXTEND = extend_config(LAYOUT, VERIFY)
SLOTS = (3, 0, 5)  # non-contiguous slots: the page tables must follow the slot, not the batch position


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=[GEOMETRY, FULL], ids=["dense_stand_in", "released_architecture"])
def target(request: pytest.FixtureRequest) -> Dsv4ForCausalLM:
    model = Dsv4ForCausalLM(request.param)
    model.init_dummy_(0)
    return model.eval()


def table(rows: int) -> torch.Tensor:
    # the pool's page table (the draft's cache reads it); the dsv4 attention reads its own per-slot pages
    return torch.zeros(rows, MAX_LEN // PAGE, dtype=torch.int32)


def test_the_cache_layout_holds_a_step_and_a_prefill_chunk() -> None:
    # reach = max(window 6, 2 * 4 for the overlapping C4, 8) = 8; rows = max(N, 10) = 10 -> 17 -> 24
    assert (LAYOUT.swa_ring_size, LAYOUT.max_rows_per_request) == (24, 17)
    assert LAYOUT.swa_ring_size % PAGE == 0 and LAYOUT.compress_ratios == (4, 8)
    attn = Dsv4PagedAttention.allocate(Dsv4ForCausalLM(GEOMETRY), LAYOUT, VERIFY, 6, MAX_LEN)
    planned = slot_page_tables(VERIFY, MAX_LEN, SLOTS)
    allocated = attn.caches.page_tables(SLOTS)
    assert (planned.swa == allocated.swa).all()
    assert all((planned.compressed[r] == allocated.compressed[r]).all() for r in (4, 8))


def test_layouts_drive_the_target_as_the_reference_steps(target: Dsv4ForCausalLM) -> None:
    """Prefill chunks (extend layouts), then static, compact and tier-padded verify steps with rejected
    suffixes: every real row's logits equal the reference's incremental step, bit for bit."""
    attn = Dsv4PagedAttention.allocate(target, LAYOUT, VERIFY, 6, MAX_LEN)
    ref = target.model
    prompts = [tokens(n, seed) for n, seed in ((23, 1), (9, 2), (17, 3))]
    states = [ref.init_state() for _ in prompts]
    done = [0, 0, 0]
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):  # chunks of up to 10 rows
        live = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        rows = [prompts[i][done[i]:done[i] + 10] for i in live]
        layout = plan_extend([done[i] for i in live], [len(r) for r in rows], table(len(live)), PAGE, CPU,
                             [SLOTS[i] for i in live])
        meta = plan_step_metadata(layout, EXTEND, MAX_LEN, CPU)
        hidden, _ = target.forward_paged_states(torch.tensor(sum(rows, [])), layout.positions, attn, meta)
        logits = target.compute_logits(hidden)
        for k, (i, r) in enumerate(zip(live, rows, strict=True)):
            result = ref.step(states[i], r)
            assert torch.equal(logits[layout.host_qo_indptr[k]:layout.host_qo_indptr[k + 1]], result.logits)
            states[i], done[i] = result.state, done[i] + len(r)

    shape = StepShape(page_size=PAGE, num_draft_tokens=N, tiers=(8, 16), padding_request_rows=N)
    gen = torch.Generator().manual_seed(7)
    for step in range(12):
        run = [N] * 3 if step % 3 == 0 else torch.randint(1, N + 1, (3,), generator=gen).tolist()
        rows = [tokens(n, 100 + 3 * step + i) for i, n in enumerate(run)]
        prefix = [s.length for s in states]
        layout = plan_verify(tuple(run), tuple(run), prefix, table(3), shape, CPU, slots=list(SLOTS))
        meta = plan_step_metadata(layout, VERIFY, MAX_LEN, CPU)
        assert (meta.tier, meta.num_slots) == (layout.tier, layout.num_slots)
        ids = torch.zeros(layout.tier, dtype=torch.long)
        ids[:layout.total_rows] = torch.tensor(sum(rows, []))
        hidden, states_out = target.forward_paged_states(ids, layout.positions, attn, meta, capture=(0, 2))
        assert states_out is not None and states_out.shape == (layout.tier, 2 * GEOMETRY.dim)
        logits = target.compute_logits(hidden)
        for i in range(3):
            result = ref.step(states[i], rows[i])
            assert torch.equal(logits[layout.host_qo_indptr[i]:layout.host_qo_indptr[i + 1]], result.logits)
            accepted = int(torch.randint(1, run[i] + 1, (1,), generator=gen))  # reject the rest
            states[i] = ref.commit(states[i], result, accepted)


def test_a_step_needs_one_slot_per_request() -> None:
    with pytest.raises(LayoutError, match="one slot per request"):
        plan_extend([0, 0], [2, 3], table(2), PAGE, CPU, [1])


def test_prefill_chunks_respect_the_ring_bound() -> None:
    slots = RequestSlots(4, 8, 64, PAGE)
    sched = Scheduler(slots, N, chunked_prefill_tokens=64, max_chunk_rows=LAYOUT.max_rows_per_request)
    params = SamplingParams(0.0, 1.0, 0)
    for rid, n in enumerate((40, 5, 30)):
        sched.enqueue(Request(rid, tokens(n, rid), 4, params, False, None))
    sched.admit()
    assert [c.take for c in sched.prefill_chunks()] == [17, 5, 17]
    unbounded = dataclasses.replace(LAYOUT, max_rows_per_request=64).max_rows_per_request
    sched.max_chunk_rows = unbounded
    assert [c.take for c in sched.prefill_chunks()] == [40, 5, 19]
