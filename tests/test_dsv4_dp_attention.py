"""DP attention of the dsv4 family: query heads tensor-parallel over a DP rank's `tp / dp` attention ranks,
the MLP and the vocabulary over the world on the rows gathered across the DP ranks
(`sharding.shard_dsv4_dp_attention`), and padding that never touches a real request's caches.

Every DP rank runs the same rows each step, so a DP rank with fewer pads them: an extend step (prefill chunk,
target-only decode) with a padding request that has no slot (`ExtendLayout.host_slots` lists the real
requests only), a verify step forced up to the DP-global tier with padding requests, and an idle DP rank with
padding requests alone. The dsv4 backends plan those as padding slots over the null page
(`dsv4.attention.plan_step_metadata`): checked here on the CPU paged backend and the device layers (the CUDA
layers' torch oracle, the Ascend layers on the fake torch_npu), every cache page but the null page is the
same bits with padding as without, and the real rows' logits too. End to end, the tiny static and compact
builds recompiled with tp 2, dp 2 and DP attention decode under torchrun what one process decodes
target-only, with 3 prompts (both DP ranks busy, unevenly) and with 1 (an idle DP rank).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dspark.runtime.config import ParallelPlan
from dspark.runtime.distributed.dp_attention import DPAttentionGroups, DPGatheredVocab
from dspark.runtime.distributed.launch import Launch, LaunchError, check_launch
from dspark.runtime.distributed.tensor_parallel import PartialSum, TPGroup, VocabParallelEmbedding
from dspark.runtime.families.dsv4.cpu_attention import plan_step_metadata
from dspark.runtime.families.dsv4.sharding import DPAttentionDsv4Layer, shard_dsv4_dp_attention
from dspark.runtime.families.dsv4.target import Dsv4ForCausalLM, Dsv4LayerBackend
from dspark.runtime.layout import plan_extend, plan_verify

from .gloo_ranks import free_port
from .parallel_builds import compile_parallel, reference, torchrun
from .test_dsv4_tensor_parallel import (
    CPU,
    EXTEND,
    GEOMETRY,
    MAX_LEN,
    PAGE,
    SHAPE,
    SLOTS,
    VERIFY,
    N,
    backend,
    build_target,
    fake_npu,
    prompts,
)

BACKENDS = ("paged", "static_cuda_layers", "static_ascend_layers")
CHUNK = 6  # prefill rows per request per step


# -- padding never touches a real request's caches -------------------------------------------------------

def cache_tensors(attn: Any) -> dict[str, torch.Tensor]:
    return attn.caches.tensors()


def real_pages(attn: Any) -> dict[str, torch.Tensor]:
    """Every cache tensor without its null page (page 0 of every pool), cloned."""
    return {name: t[1:].clone() for name, t in cache_tensors(attn).items()}


def null_pages(attn: Any) -> dict[str, torch.Tensor]:
    return {name: t[0].clone() for name, t in cache_tensors(attn).items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str,
                exact: bool = True) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if exact:
            assert torch.equal(a[name], b[name]), f"{what}: {name}"
        else:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")


def run(target: Dsv4ForCausalLM, attn: Dsv4LayerBackend, layout: Any, meta: Any, ids: list[int]
        ) -> torch.Tensor:
    """Logits of every row the step ran (padding rows' tokens 0)."""
    tokens = torch.zeros(layout.positions.shape[0], dtype=torch.long)
    tokens[:len(ids)] = torch.tensor(ids, dtype=torch.long)
    hidden, _ = target.forward_paged_states(tokens, layout.positions, attn, meta)
    return target.compute_logits(hidden)


def prefilled(target: Dsv4ForCausalLM, mode: str) -> tuple[Dsv4LayerBackend, list[list[int]], torch.Tensor]:
    """A backend whose slots `SLOTS` hold all but the last 3 tokens of each prompt; the prompts; the pool's
    page table (the requests' rows, which dsv4 does not read)."""
    attn = backend(target, mode)
    seqs = prompts()
    table = torch.zeros(len(seqs), MAX_LEN // PAGE, dtype=torch.int32)
    cached = [0] * len(seqs)
    stop = [len(s) - 3 for s in seqs]
    while any(c < s for c, s in zip(cached, stop, strict=True)):
        live = [i for i in range(len(seqs)) if cached[i] < stop[i]]
        rows = [seqs[i][cached[i]:min(cached[i] + CHUNK, stop[i])] for i in live]
        layout = plan_extend([cached[i] for i in live], [len(r) for r in rows], table[live], PAGE, CPU,
                             [SLOTS[i] for i in live])
        run(target, attn, layout, plan_step_metadata(layout, EXTEND, MAX_LEN, CPU), sum(rows, []))
        for i, r in zip(live, rows, strict=True):
            cached[i] += len(r)
    return attn, seqs, table


def padded_and_not(target: Dsv4ForCausalLM, attn: Dsv4LayerBackend, plan: Any, ids: list[int], real_rows: int,
                   exact: bool) -> None:
    """Run `plan(padded)` from the same caches without and with padding: the padded step's caches outside the
    null page and its real rows' logits are the unpadded step's (bit for bit where `exact`), and its padding
    did write (the null page changed). The caches are left as the padded step left them.

    `exact` holds for the CPU paged backend, whose products are row-invariant. The device layers are the
    GPU's and NPU's tensor code run on the CPU: their products over a step's rows are plain GEMMs, which
    split the rows over threads by the row count, so padding may move a real row's last bits there (as on a
    device); a padding row written into a real slot would still be far outside the tolerance."""
    start = {name: t.clone() for name, t in cache_tensors(attn).items()}
    want = run(target, attn, *plan(False), ids)
    plain = real_pages(attn)
    for name, t in cache_tensors(attn).items():
        t.copy_(start[name])
    got = run(target, attn, *plan(True), ids)
    assert got.shape[0] > want.shape[0] == real_rows
    assert_same({"logits": got[:real_rows]}, {"logits": want}, "the real rows", exact)
    assert_same(real_pages(attn), plain, "a real slot's caches", exact)
    assert any(not torch.equal(start[k][0], t[0]) for k, t in cache_tensors(attn).items()), \
        "the padding wrote nothing"


@pytest.mark.parametrize("mode", BACKENDS)
def test_padding_rows_leave_every_real_slots_caches_untouched(mode: str) -> None:
    target = build_target()
    with fake_npu():
        attn, seqs, table = prefilled(target, mode)
        prefix = [len(s) - 3 for s in seqs]
        two = [0, 2]  # two of the three requests: a real slot (SLOTS[1]) that runs nothing must stay as it is

        def extend(padding: bool) -> tuple[Any, Any]:
            # an extend step of 3 rows for two requests, then (DP attention) a padding request of 2N + 1 rows
            layout = plan_extend([prefix[i] for i in two], [3, 3], table[two], PAGE, CPU,
                                 [SLOTS[i] for i in two], padding_rows=2 * N + 1 if padding else 0)
            return layout, plan_step_metadata(layout, EXTEND, MAX_LEN, CPU)

        exact = mode == "paged"
        ids = [t for i in two for t in seqs[i][prefix[i]:prefix[i] + 3]]
        padded_and_not(target, attn, extend, ids, 6, exact)

        runs = (N, 2)

        def verify(padding: bool) -> tuple[Any, Any]:
            # a verify step of N + 2 rows, forced (DP attention) to the tier 16 another DP rank needs
            shape = SHAPE if padding else dataclasses.replace(SHAPE, tiers=())
            layout = plan_verify(runs, runs, [prefix[i] for i in two], table[two], shape, CPU,
                                 tier=16 if padding else None, slots=[SLOTS[i] for i in two])
            return layout, plan_step_metadata(layout, VERIFY, MAX_LEN, CPU)

        ids = [t for i, n in zip(two, runs, strict=True)
               for t in (seqs[i] + [1] * N)[prefix[i]:prefix[i] + n]]  # the shortest prompt runs out
        padded_and_not(target, attn, verify, ids, sum(runs), exact)

        # an idle DP rank: padding alone, in an extend step and in a verify step of a tier
        before = real_pages(attn)
        none = table[:0]
        layout = plan_extend([], [], none, PAGE, CPU, [], padding_rows=2 * N + 3)
        logits = run(target, attn, layout, plan_step_metadata(layout, EXTEND, MAX_LEN, CPU), [])
        assert logits.shape[0] == 2 * N + 3 and torch.isfinite(logits).all()
        layout = plan_verify([], [], [], none, SHAPE, CPU, tier=8, slots=[])
        meta = plan_step_metadata(layout, VERIFY, MAX_LEN, CPU)
        assert meta.num_requests == 0 and meta.tier == 8
        logits = run(target, attn, layout, meta, [])
        assert logits.shape[0] == 8 and torch.isfinite(logits).all()
        assert_same(real_pages(attn), before, "a padding-only step")


def test_an_extend_steps_padding_request_is_planned_as_padding_slots() -> None:
    """Its rows split into padding requests of at most the extend rows per request, on null page tables:
    every raw K=V write in page 0, no compressed entry, no window."""
    table = torch.zeros(1, MAX_LEN // PAGE, dtype=torch.int32)
    rows = 2 * EXTEND.num_draft_tokens + 1
    layout = plan_extend([5], [2], table, PAGE, CPU, [4], padding_rows=rows)
    meta = plan_step_metadata(layout, EXTEND, MAX_LEN, CPU)
    assert meta.num_requests == 1 and meta.tier == 2 + rows and meta.num_slots == 4
    assert meta.host.seqused_q.tolist() == [2, EXTEND.num_draft_tokens, EXTEND.num_draft_tokens, 1]
    pad = slice(2, None)
    assert (meta.host.swa_slot_mapping[pad] < VERIFY.swa_page_size).all()  # the null page's slots
    assert (meta.host.swa_window_lens[pad] == 0).all()
    assert (meta.host.swa_slot_mapping[:2] >= VERIFY.swa_page_size).all()
    for plan in meta.compressed.values():
        written = plan.host.boundary_rows[plan.host.boundary_rows >= 0]
        assert (written < 2).all()  # only the real rows close blocks


# -- the split, in this process (slicing runs no collective) ---------------------------------------------

def place(rank: int, size: int) -> TPGroup:
    return TPGroup(rank, size, object())  # type: ignore[arg-type]


@pytest.mark.parametrize(("tp", "dp"), [(2, 2), (4, 2)])
def test_heads_split_over_the_attention_ranks_and_the_mlp_and_vocabulary_over_the_world(tp: int, dp: int
                                                                                        ) -> None:
    whole = build_target()
    size = tp // dp  # attention ranks per DP rank
    h, d = GEOMETRY.n_heads // size, GEOMETRY.head_dim
    for rank in range(tp):
        dp_rank, a = divmod(rank, size)
        groups = DPAttentionGroups(place(rank, tp), place(a, size), place(dp_rank, dp), dp_rank)
        target = copy.deepcopy(whole)
        shard_dsv4_dp_attention(target, groups)
        assert target.local_num_heads == h
        q = slice(a * h * d, (a + 1) * h * d)
        i0, i1 = rank * GEOMETRY.inter_dim // tp, (rank + 1) * GEOMETRY.inter_dim // tp
        for mine, full in zip(target.model.layers, whole.model.layers, strict=True):
            assert isinstance(mine, DPAttentionDsv4Layer) and mine.dp is groups.dp
            assert (mine.partial_sum is None) == (size == 1) and mine.mlp_sum == PartialSum(groups.world)
            assert torch.equal(mine.wq_b, full.wq_b[q]) and torch.equal(mine.wo, full.wo[:, q])
            assert torch.equal(mine.attn_sink, full.attn_sink[a * h:(a + 1) * h])
            assert torch.equal(mine.w1, full.w1[i0:i1]) and torch.equal(mine.w2, full.w2[:, i0:i1])
            assert torch.equal(mine.wkv, full.wkv) and torch.equal(mine.wq_a, full.wq_a)  # replicated
        model = target.model
        assert isinstance(model.vocab_embed, DPGatheredVocab) and target.lm_head is model.vocab_head
        assert isinstance(model.vocab_embed.inner, VocabParallelEmbedding)
        assert model.vocab_embed.inner.tp.size == tp and model.vocab_embed.dp is groups.dp
        assert model.vocab_head.weight.shape == (-(-GEOMETRY.vocab_size // tp), GEOMETRY.dim)
        with pytest.raises(ValueError, match="already sharded"):
            shard_dsv4_dp_attention(target, groups)


def test_a_dsv4_dp_attention_build_launches_as_its_tp_processes() -> None:
    deployment = SimpleNamespace(name="flash", backend="cpu", token_tiers=(),
                                 model=SimpleNamespace(family="dsv4"),
                                 parallel=ParallelPlan(tp=2, dp=2, dp_attention=True, ep=1))
    for rank in (0, 1):
        check_launch(Launch(rank, 2, rank), deployment)  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match=re.escape("flash is compiled for 2 processes (tp 2, dp 2 with DP "
                                                    "attention), launched as 4")):
        check_launch(Launch(0, 4, 0), deployment)  # type: ignore[arg-type]


# -- end to end ------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize(("mode", "prompts_run"), [("compact", 3), ("static", 1)],
                         ids=["compact-busy_dp_ranks", "static-an_idle_dp_rank"])
def test_dsv4_dp_attention_under_torchrun_decodes_as_one_process(mode: str, prompts_run: int,
                                                                 tmp_path: Path) -> None:
    """tp 2, dp 2: one attention rank per DP rank (its query heads whole), the MLP and vocabulary over both.
    With 3 prompts DP rank 0 takes 2 and DP rank 1 one (extend steps and verify steps padded), with 1 DP
    rank 1 is idle and runs padding alone; the check mode compares every step across the ranks. (Compact
    with an idle rank, and static on 4 processes, are the same paths; the suite's time keeps two.)"""
    chosen = ("The quick brown fox", "Once upon a time", "def main():")[:prompts_run]
    name = compile_parallel(f"dsv4_tiny_cpu_{mode}", tmp_path, tp=2, dp=2, dp_attention=True)
    assert torchrun(name, 2, tmp_path, free_port(), chosen) == reference(f"dsv4_tiny_cpu_{mode}", chosen)


@pytest.mark.slow
def test_dsv4_dp_attention_with_two_attention_ranks_per_dp_rank(tmp_path: Path) -> None:
    """tp 4, dp 2: each DP rank's query heads split over its 2 attention ranks (wo summed over them), the MLP
    and vocabulary over all 4 on the gathered rows."""
    name = compile_parallel("dsv4_tiny_cpu_compact", tmp_path, tp=4, dp=2, dp_attention=True)
    assert torchrun(name, 4, tmp_path, free_port()) == reference("dsv4_tiny_cpu_compact")
