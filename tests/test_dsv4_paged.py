"""The paged multi-request DSV4 verify forward (dspark.runtime.families.dsv4.cpu_paged) against the reference
model: the bring-up checklist -- row counts and compressed writes, static and compact steps against
DSV4Model.step, compact scattered back to the static stride, scripted drafts in both modes (rollback by
overwriting), and the Ascend operator models run on the same metadata and caches."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.runtime.families.dsv4.ascend_op_models import run_dsv4_layer_reference
from dspark.runtime.families.dsv4.cpu_paged import (
    NULL_PAGE,
    Dsv4LayerCache,
    Dsv4LayerTrace,
    Dsv4PagedCaches,
    Dsv4PagedError,
    max_rows_per_request,
    prefill,
    required_ring_size,
    run_step,
)
from dspark.runtime.families.dsv4.model import DSV4Model, DSV4State
from dspark.runtime.families.dsv4.verify_metadata import Dsv4StepConfig, Dsv4VerifyMetadata

N = 4  # rows a request verifies at most
# csa_ratio 4 and a C128-kind ratio of 8 so blocks of both kinds close every few positions; window 6 wraps.
SMALL = Dsv4Geometry(vocab_size=64, dim=32, compress_ratios=(0, 4, 8), csa_ratio=4, hca_ratio=8, n_heads=2,
                     head_dim=16, rope_dim=4, q_lora_rank=16, window=6, index_n_heads=2, index_head_dim=8,
                     index_topk=3, inter_dim=48)
PUBLISHED = Dsv4Geometry(vocab_size=64, dim=32, compress_ratios=(0, 4, 128), n_heads=2, head_dim=16,
                         rope_dim=4, q_lora_rank=16, window=16, index_n_heads=2, index_head_dim=8,
                         index_topk=4, inter_dim=48)
PROMPTS = {"small": (13, 22, 31), "published": (126, 133, 255)}  # published: steps cross 128 and 256


def step_config(cfg: Dsv4Geometry) -> Dsv4StepConfig:
    ratios = tuple(r for r in sorted(set(cfg.compress_ratios)) if r)
    page = 4 if cfg is SMALL else 8
    ring = -(-required_ring_size(cfg, N) // page) * page  # 12 (small), 136 (published)
    return Dsv4StepConfig(num_draft_tokens=N, window=cfg.window, compress_ratios=ratios, swa_page_size=page,
                          swa_ring_size=ring, cmp_page_sizes={r: 2 if r > 4 else 3 for r in ratios},
                          index_topk=cfg.index_topk, padding_request_rows=2)


@pytest.fixture(params=["small", "published"])
def geometry(request) -> str:
    # small: a C128-kind ratio of 8 runs the same code as 128 and makes its boundaries frequent
    return request.param


def config_of(name: str) -> Dsv4Geometry:
    return SMALL if name == "small" else PUBLISHED


@functools.cache
def model(cfg: Dsv4Geometry) -> DSV4Model:
    return DSV4Model(cfg, seed=0)


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass(frozen=True)
class Bench:
    """Three requests prefilled both ways: the paged caches (through `prefill`) and the reference states."""

    cfg: Dsv4Geometry
    step: Dsv4StepConfig
    prompts: tuple[tuple[int, ...], ...]
    caches: Dsv4PagedCaches  # never mutated: tests take clone()
    states: tuple[DSV4State, ...]
    prefill_logits: tuple[torch.Tensor, ...]  # paged
    reference_logits: tuple[torch.Tensor, ...]


@functools.cache
def bench(name: str) -> Bench:
    cfg = config_of(name)
    m, step = model(cfg), step_config(cfg)
    prompts = tuple(tuple(random_tokens(n, seed=10 + i)) for i, n in enumerate(PROMPTS[name]))
    caches = Dsv4PagedCaches.allocate(cfg, step, max_requests=3, max_len=max(PROMPTS[name]) + 48, seed=7)
    paged = prefill(m, caches, [0, 1, 2], [list(p) for p in prompts])
    results = [m.prefill(list(p)) for p in prompts]
    return Bench(cfg, step, prompts, caches, tuple(r.state for r in results), tuple(paged),
                 tuple(r.logits for r in results))


def ring_slot(caches: Dsv4PagedCaches, request: int, pos: int) -> int:
    ps, ring = caches.step_config.swa_page_size, caches.step_config.swa_ring_size
    return int(caches.swa_pages[request, (pos % ring) // ps]) * ps + pos % ps


def entry_slot(caches: Dsv4PagedCaches, request: int, ratio: int, entry: int) -> int:
    cps = caches.step_config.cmp_page_sizes[ratio]
    return int(caches.cmp_pages[ratio][request, entry // cps]) * cps + entry % cps


def flat(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return t.view(-1, t.shape[-1])


def assert_cache_holds_state(caches: Dsv4PagedCaches, request: int, state: DSV4State) -> None:
    """The paged caches hold, bitwise, the target-only state of the request's committed positions: window
    raw KV, closed entries and index keys, the open block's compressor rows and (C4) the overlap half."""
    cfg, p = caches.model_config, state.length
    for i, (lc, ls) in enumerate(zip(caches.layers, state.layers, strict=True)):
        for q in range(max(0, p - cfg.window), p):
            got = flat(lc.swa_kv)[ring_slot(caches, request, q)]
            assert torch.equal(got, ls.window_kv[q % cfg.window]), (i, q)
        parts = [(ls.attn, lc.state_kv, lc.state_score, lc.cmp_kv), (ls.index, lc.index_state_kv,
                                                                     lc.index_state_score, lc.index_kv)]
        for comp, kv, score, entries in parts:
            if comp is None:
                continue
            r = lc.ratio
            closed = p // r
            assert comp.entries.shape[0] == closed
            got = flat(entries)[[entry_slot(caches, request, r, e) for e in range(closed)]]
            assert torch.equal(got, comp.entries), (i, "entries")
            open_rows = [ring_slot(caches, request, q) for q in range(closed * r, p)]
            assert torch.equal(flat(kv)[open_rows], comp.open_kv), (i, "open rows")
            assert torch.equal(flat(score)[open_rows], comp.open_score), (i, "open gates")
            if comp.prev_kv.shape[0] and closed:
                prev = [ring_slot(caches, request, q) for q in range((closed - 1) * r, closed * r)]
                d = comp.prev_kv.shape[1]
                assert torch.equal(flat(kv)[prev][:, :d], comp.prev_kv), (i, "overlap half")
                assert torch.equal(flat(score)[prev][:, :d], comp.prev_score), (i, "overlap gates")


def pages_changed(before: Dsv4PagedCaches, after: Dsv4PagedCaches) -> dict[str, set[int]]:
    out = {}
    for name, a in before.tensors().items():
        b = after.tensors()[name]
        out[name] = set(torch.nonzero((a != b).flatten(1).any(1)).flatten().tolist())
    return out


# ---------------------------------------------------------------------------------------------------------
# (0) the caches' geometry


def test_ring_must_hold_the_compressor_rows():
    assert required_ring_size(SMALL, N) == 8 + N - 1  # C4's two overlapping blocks outreach the window (6)
    assert required_ring_size(PUBLISHED, N) == 128 + N - 1
    assert max_rows_per_request(PUBLISHED, 136) == 9
    bad = Dsv4StepConfig(num_draft_tokens=N, window=6, compress_ratios=(4, 8), swa_page_size=3,
                         swa_ring_size=9, cmp_page_sizes={4: 2, 8: 2}, index_topk=3)
    with pytest.raises(Dsv4PagedError, match="swa_ring_size"):
        Dsv4PagedCaches.allocate(SMALL, bad, 1, 10)
    with pytest.raises(Dsv4PagedError, match="window"):
        Dsv4PagedCaches.allocate(PUBLISHED, step_config(SMALL), 1, 10)


def test_paged_prefill_equals_reference_and_holds_its_state(geometry):
    b = bench(geometry)
    for i in range(3):
        torch.testing.assert_close(b.prefill_logits[i], b.reference_logits[i], rtol=1e-5, atol=1e-5)
        assert torch.equal(b.prefill_logits[i].argmax(-1), b.reference_logits[i].argmax(-1))
        assert_cache_holds_state(b.caches, i, b.states[i])


def test_prefill_chunking_does_not_change_the_caches():
    b = bench("small")
    m = model(SMALL)
    one_by_one = Dsv4PagedCaches.allocate(SMALL, b.step, max_requests=3, max_len=79, seed=7)
    logits = prefill(m, one_by_one, [0, 1, 2], [list(p) for p in b.prompts], chunk=1)
    assert all(torch.equal(x, y) for x, y in zip(logits, b.prefill_logits, strict=True))
    for name, t in b.caches.tensors().items():
        assert torch.equal(t, one_by_one.tensors()[name]), name
    with pytest.raises(Dsv4PagedError, match="chunk"):
        prefill(m, one_by_one, [0], [[1, 2]], chunk=max_rows_per_request(SMALL, b.step.swa_ring_size) + 1)


# ---------------------------------------------------------------------------------------------------------
# (1) rows, cu_seqlens and compressed writes


def step_rows(b: Bench, lens: list[int], seed: int) -> list[list[int]]:
    return [random_tokens(n, seed=seed * 10 + i) for i, n in enumerate(lens)]


@pytest.mark.parametrize("lens", [[3, 1, 4], [4, 4, 4], [1, 2, 1]])
def test_rows_cu_seqlens_and_compressed_writes(geometry, lens):
    b = bench(geometry)
    m, caches = model(b.cfg), b.caches.clone()
    prefix = [len(p) for p in b.prompts]
    rows = step_rows(b, lens, seed=sum(lens))
    total = sum(lens)
    meta, logits = run_step(m, caches, [0, 1, 2], prefix, rows, tier=-(-total // 4) * 4 + 2, num_slots=6)
    host = meta.host
    assert meta.total_rows == total and sum(x.shape[0] for x in logits) == total
    assert host.cu_seqlens_q[:4].tolist() == np.cumsum([0, *lens]).tolist()
    assert host.cu_seqlens_q[-1] == meta.tier
    ragged = [(r, i, prefix[r] + k) for r in range(3) for k in range(lens[r])
              for i in [int(host.cu_seqlens_q[r]) + k]]
    results = [m.step(b.states[r], rows[r]) for r in range(3)]
    for layer, lc in enumerate(caches.layers):
        ratio = lc.ratio
        if not ratio:
            continue
        plan = meta.compressed[ratio].host
        expected = [(r, i, p) for r, i, p in ragged if (p + 1) % ratio == 0]
        writes = int((plan.boundary_rows >= 0).sum())
        assert plan.boundary_rows[:writes].tolist() == [i for _, i, _ in expected]
        assert plan.cmp_positions[:writes].tolist() == [p - ratio + 1 for _, _, p in expected]
        for r in range(3):
            # the reference's own writes: the entries its step closed, in order
            before = b.states[r].layers[layer]
            after = results[r].state.layers[layer]
            mine = [k for k, (rr, _, _) in enumerate(expected) if rr == r]
            for kind, cache in (("attn", lc.cmp_kv), ("index", lc.index_kv)):
                old, new = getattr(before, kind), getattr(after, kind)
                if old is None:
                    continue
                written = new.entries[old.entries.shape[0] :]
                assert written.shape[0] == len(mine) == int(plan.cmp_writes[r])
                got = flat(cache)[plan.cmp_slot_mapping[mine].tolist()]
                assert torch.equal(got, written), (layer, kind, r)
    if geometry == "small" and lens == [4, 4, 4]:
        assert all(any((p + 1) % r == 0 for _, _, p in ragged) for r in (4, 8))


# ---------------------------------------------------------------------------------------------------------
# (2) static and compact steps against the reference; padding writes only the null page
# (3) compact logits scattered to the B x N stride equal the static step's


def check_against_reference(b: Bench, rows: list[list[int]], logits: list[torch.Tensor]) -> None:
    m = model(b.cfg)
    for r in range(3):
        want = m.step(b.states[r], rows[r]).logits
        torch.testing.assert_close(logits[r], want, rtol=1e-5, atol=1e-5)
        assert torch.equal(logits[r].argmax(-1), want.argmax(-1))


def test_static_and_compact_steps_match_reference(geometry):
    b = bench(geometry)
    m = model(b.cfg)
    prefix = [len(p) for p in b.prompts]
    static_rows = step_rows(b, [N, N, N], seed=5)
    static_caches = b.caches.clone()
    _, static = run_step(m, static_caches, [0, 1, 2], prefix, static_rows)
    check_against_reference(b, static_rows, static)

    lens = [2, 4, 1]
    rows = [r[:n] for r, n in zip(static_rows, lens, strict=True)]
    padded, bare = b.caches.clone(), b.caches.clone()
    meta, compact = run_step(m, padded, [0, 1, 2], prefix, rows, tier=12, num_slots=8)
    assert meta.num_slots == 8 and meta.tier == 12 and meta.total_rows == 7
    assert meta.host.seqused_q.tolist() == [2, 4, 1, 2, 2, 1, 0, 0]  # padding requests, then empty slots
    check_against_reference(b, rows, compact)

    # the same step without padding: every cache equal outside the null page, which it leaves untouched
    run_step(m, bare, [0, 1, 2], prefix, rows)
    for name, changed in pages_changed(bare, padded).items():
        assert changed <= {NULL_PAGE}, name
    for name, changed in pages_changed(b.caches, bare).items():
        assert NULL_PAGE not in changed, name
    assert any(pages_changed(bare, padded).values())  # the padding rows did write (into the null page)

    # (3) scatter compact rows to [R, N] by (slot, position - prefix): equal to the static rows
    full = torch.stack(static)  # [R, N, V]
    scattered = torch.full_like(full, float("nan"))
    cu = meta.host.cu_seqlens_q
    logits_all = torch.cat([*compact])
    for t in range(meta.total_rows):
        slot = int(meta.host.row_slot[t])
        scattered[slot, int(meta.host.positions[t]) - prefix[slot]] = logits_all[t]
    ran = ~scattered.isnan().any(-1)
    assert ran.sum() == sum(lens) and int(cu[3]) == sum(lens)
    torch.testing.assert_close(scattered[ran], full[ran], rtol=1e-5, atol=1e-5)
    assert torch.equal(scattered[ran].argmax(-1), full[ran].argmax(-1))


# ---------------------------------------------------------------------------------------------------------
# (4) scripted drafts, static and compact


Truth = tuple[tuple[tuple[int, ...], ...], tuple[tuple[DSV4State, ...], ...]]


@functools.cache
def greedy_truth(name: str, n_new: int) -> Truth:
    """Each prompt's target-only greedy continuation, and the target-only state after every position
    from the prompt on (states[k - len(prompt)] holds k positions)."""
    b = bench(name)
    m = model(b.cfg)
    seqs, all_states = [], []
    for prompt, state, logits in zip(b.prompts, b.states, b.reference_logits, strict=True):
        seq, states = list(prompt) + [int(logits[-1].argmax())], [state]
        for _ in range(n_new):
            result = m.step(states[-1], [seq[-1]])
            seq.append(int(result.logits[0].argmax()))
            states.append(result.state)
        seqs.append(tuple(seq))
        all_states.append(tuple(states))
    return tuple(seqs), tuple(all_states)


def schedule(steps: int, seed: int) -> list[list[tuple[int, int]]]:
    """Per step, per request: (L, accepted drafts). Every pattern (L, 0..L-1) for L = 1..N occurs."""
    pairs = [(n, a) for n in range(1, N + 1) for a in range(n)]
    rng = random.Random(seed)
    flat_plan = pairs * (-(-steps * 3 // len(pairs)))
    rng.shuffle(flat_plan)
    return [flat_plan[3 * s : 3 * s + 3] for s in range(steps)]


def drive(name: str, mode: str, plan: list[list[tuple[int, int]]]) -> dict:
    """Verify scripted drafts for three requests and accept greedily; mode 'static' runs N rows per
    request (acceptance capped at its planned L), 'compact' runs L rows packed and padded to a tier."""
    b = bench(name)
    m, caches = model(b.cfg), b.caches.clone()
    truth, states = greedy_truth(name, len(plan) * N + 2)
    seqs = [list(t[: len(p) + 1]) for t, p in zip(truth, b.prompts, strict=True)]
    prefix = [len(p) for p in b.prompts]
    commits: list[list[int]] = []
    rejected_boundaries = {r: 0 for r in b.step.compress_ratios}
    for step in plan:
        rows = []
        for r, (n, a) in enumerate(step):
            p = prefix[r]
            drafts = list(truth[r][p + 1 : p + N])
            if a < N - 1:  # the error: accepted drafts stop at a (static mode reaches it too if a < L-1)
                drafts[a] = (drafts[a] + 1) % b.cfg.vocab_size
            rows.append([seqs[r][p], *drafts[: (N if mode == "static" else n) - 1]])
        total = sum(len(x) for x in rows)
        tier = -(-total // 4) * 4 if mode == "compact" else None
        num_slots = 6 if mode == "compact" else None
        _, logits = run_step(m, caches, [0, 1, 2], prefix, rows, tier=tier, num_slots=num_slots)
        done = []
        for r, (n, a_planned) in enumerate(step):
            a = 0
            while a < n - 1 and rows[r][a + 1] == int(logits[r][a].argmax()):
                a += 1
            assert a == a_planned, (mode, r, prefix[r])
            p = prefix[r]
            for q in range(p + a + 1, p + len(rows[r])):  # rejected rows that closed a block
                for ratio in rejected_boundaries:
                    rejected_boundaries[ratio] += (q + 1) % ratio == 0
            seqs[r] += rows[r][1 : a + 1] + [int(logits[r][a].argmax())]
            prefix[r] += a + 1
            done.append(a + 1)
            assert seqs[r] == list(truth[r][: len(seqs[r])]), (mode, r)
            assert len(seqs[r]) == prefix[r] + 1
            assert_cache_holds_state(caches, r, states[r][prefix[r] - len(b.prompts[r])])
        commits.append(done)
    return {"commits": commits, "prefix": prefix, "seqs": seqs, "rejected_boundaries": rejected_boundaries}


def test_scripted_drafts_static_and_compact_agree_with_target_greedy():
    plan = schedule(steps=8, seed=3)
    seen = {pair for step in plan for pair in step}
    assert seen == {(n, a) for n in range(1, N + 1) for a in range(n)}
    static = drive("small", "static", plan)
    compact = drive("small", "compact", plan)
    assert static["commits"] == compact["commits"] == [[a + 1 for _, a in step] for step in plan]
    assert static["prefix"] == compact["prefix"]
    assert static["seqs"] == compact["seqs"]
    # rejected rows closed C4 and C128-kind blocks, whose entries the next steps rewrote before reading
    assert min(compact["rejected_boundaries"].values()) > 0
    assert min(static["rejected_boundaries"].values()) > 0


def test_scripted_drafts_across_a_published_c128_boundary():
    # request 0 (prefix 126) rejects the row at 127 that closes C128 block 0, then really closes it
    plan = [[(4, 0), (3, 0), (4, 3)], [(4, 1), (2, 1), (4, 2)], [(3, 2), (4, 3), (1, 0)]]
    compact = drive("published", "compact", plan)
    static = drive("published", "static", plan)
    assert static["commits"] == compact["commits"] and static["seqs"] == compact["seqs"]
    assert min(compact["rejected_boundaries"].values()) > 0


# ---------------------------------------------------------------------------------------------------------
# (5) the Ascend operator models on the same metadata and caches


def test_ascend_operators_give_the_cpu_attention():
    b = bench("published")
    m, caches = model(b.cfg), b.caches.clone()
    prefix = [len(p) for p in b.prompts]
    rows = step_rows(b, [3, 4, 2], seed=9)
    trace: list[Dsv4LayerTrace] = []
    meta, _ = run_step(m, caches, [0, 1, 2], prefix, rows, tier=12, num_slots=5, trace=trace)
    real = meta.total_rows
    assert meta.topk_indices_shape == (12, b.cfg.index_topk)
    checked = set()
    for layer, lc, tr in zip(m.layers, caches.layers, trace, strict=True):
        variants = [False, True] if not lc.ratio else [False]  # swa_indices only on window-only layers
        for use_swa_indices in variants:
            out = ascend_layer(meta, layer.attn_sink.detach(), lc, tr, use_swa_indices)
            torch.testing.assert_close(out.attention_out[:real], tr.attn_out[:real], rtol=1e-5, atol=1e-5)
        if lc.ratio == 4:
            assert out.topk_indices is not None and tr.topk is not None
            assert tr.topk.shape == meta.topk_indices_shape
            for t in range(real):
                theirs = sorted(i for i in out.topk_indices[t, 0].tolist() if i >= 0)
                assert theirs == [i for i in tr.topk[t].tolist() if i >= 0], t
            assert (tr.topk[:real] >= 0).sum() > 0
        if lc.ratio == 128:
            assert meta.compressed[128].host.cmp_visible[:real].max() >= 1  # C128 entries were read
        checked.add(lc.ratio)
    assert checked == {0, 4, 128}


def ascend_layer(meta: Dsv4VerifyMetadata, sinks: torch.Tensor, lc: Dsv4LayerCache, tr: Dsv4LayerTrace,
                 use_swa_indices: bool):
    kwargs: dict = {}
    if lc.ratio:
        kwargs["cmp_kv"] = lc.cmp_kv.unsqueeze(2)  # [pages, page_size, 1, D]
    if lc.ratio == 4:
        kwargs.update(index_query=tr.index_query, index_key=lc.index_kv.unsqueeze(2),
                      index_weights=tr.index_weights)
    return run_dsv4_layer_reference(meta, compress_ratio=lc.ratio, q=tr.q, ori_kv=lc.swa_kv.unsqueeze(2),
                                    softmax_scale=tr.q.shape[-1] ** -0.5, sinks=sinks,
                                    use_swa_indices=use_swa_indices, **kwargs)
