"""DP attention of the dense families: a target sharded over 2 gloo processes (tp 2, dp 2: each DP rank's
attention whole) and 4 (tp 4, dp 2: attention-TP 2 inside each DP rank) serves each DP rank's requests as
the unsharded model in this process serves them alone.

Every rank builds the same seeded dummy model and shards it (`shard_dp_attention_target`); each DP rank has
its own requests (other prompts, another count), its own paged KV cache for its local KV heads and a
`TorchPagedAttention` for its local query heads. A step runs the same row count on every rank: a prefill
of ragged prompts padded by a padding request to `PREFILL_ROWS`, a ragged compact verify step padded to
`VERIFY_TIER`, then each request's first verify row alone padded to `ALONE_TIER` — where DP rank 1, with
fewer requests, runs a step of padding only beside DP rank 0's last request. The reference runs each DP
rank's requests alone and unpadded.

As under tensor parallelism the results are close, not bitwise (the row-parallel sums add per-rank
partial products; checked at rtol 1e-5, atol 1e-6): the embeddings are bitwise, greedy argmax is
identical, every rank of a DP rank returns the same bits, and a row run alone beside padding (and beside
the other DP rank's rows, or its padding) equals its verify row bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dspark.runtime.attention.torch_paged import TorchPagedAttention
from dspark.runtime.distributed.dp_attention import DPAttentionGroups, shard_dp_attention_target
from dspark.runtime.distributed.tensor_parallel import TPGroup
from dspark.runtime.kv_cache import PagedKVCache
from dspark.runtime.layout import StepShape, plan_extend, plan_verify
from dspark.runtime.models.dummy import dummy_target

from .gloo_ranks import spawn_ranks
from .runtime_helpers import import_package_module
from .test_tensor_parallel import ATOL, CAPTURE, CASES, PACKAGE, RTOL, build_model


@dataclass(frozen=True)
class Requests:
    """One DP rank's requests: their prompts, the rows each runs in the verify step, a seed for tokens."""

    prompt_lens: tuple[int, ...]
    run_lens: tuple[int, ...]
    seed: int


DP = 2
DP_REQUESTS = (Requests((7, 19, 3), (8, 1, 3), seed=3), Requests((11, 5), (2, 6), seed=4))
PREFILL_ROWS = 32  # every rank's prefill: 29 and 16 real rows, the rest a padding request's
VERIFY_TIER = 16  # 12 and 8 real rows
ALONE_TIER = 2  # one real row and a padding row; two padding rows on an idle DP rank
NUM_DRAFT_TOKENS = 8
PAGES_PER_REQUEST = 4
DENSE_LEN = 5  # the dense path's prompt length, the same on every DP rank
SPAWN_TIMEOUT_S = 120


def serve(model: torch.nn.Module, dp_rank: int, padded: bool) -> dict[str, torch.Tensor]:
    """DP rank `dp_rank`'s steps over this process's own KV cache and attention (the model's local heads):
    the real rows' hidden states, states and logits. `padded` runs every step at the common row count
    (as the ranks must); the reference runs the same requests unpadded."""
    meta = import_package_module(PACKAGE, "attn_metadata")
    page_size, cfg, reqs = meta.PAGE_SIZE, model.cfg, DP_REQUESTS[dp_rank]
    num_reqs = len(reqs.prompt_lens)
    cache = PagedKVCache(cfg.num_layers, num_reqs * PAGES_PER_REQUEST + 1, page_size,
                         model.local_num_kv_heads, cfg.head_dim, torch.float32)
    attn = TorchPagedAttention(cache, page_size, model.local_num_heads, cfg.head_dim ** -0.5)
    table = torch.arange(1, num_reqs * PAGES_PER_REQUEST + 1, dtype=torch.int32).view(num_reqs, -1)
    generator = torch.Generator().manual_seed(reqs.seed)
    prompts = torch.randint(cfg.vocab_size, (sum(reqs.prompt_lens),), generator=generator)
    drafts = torch.randint(cfg.vocab_size, (sum(reqs.run_lens),), generator=generator)
    shape = StepShape(page_size=page_size, num_draft_tokens=NUM_DRAFT_TOKENS,
                      padding_request_rows=NUM_DRAFT_TOKENS)
    cpu = torch.device("cpu")
    out: dict[str, torch.Tensor] = {}

    def run(ids: torch.Tensor, layout: Any, metadata: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = layout.positions.shape[0]
        ids = torch.cat((ids, ids.new_zeros(rows - ids.shape[0])))  # padding rows read token 0
        hidden, states = model.forward_paged_states(ids, layout.positions, attn, metadata, CAPTURE)
        assert states is not None
        return hidden, states, model.compute_logits(hidden)

    def keep(step: str, real: int, results: tuple[torch.Tensor, ...]) -> None:
        for name, value in zip(("hidden", "states", "logits"), results, strict=True):
            out[f"{step}.{name}"] = value[:real]  # the real rows

    # Prefill: the prompts, then (padded) a padding request of the remaining rows on the null page.
    prefix, lens, prefill_table = [0] * num_reqs, list(reqs.prompt_lens), table
    if padded:
        prefix, lens = [*prefix, 0], [*lens, PREFILL_ROWS - sum(lens)]
        prefill_table = torch.cat((table, table.new_zeros(1, PAGES_PER_REQUEST)))
    layout = plan_extend(prefix, lens, prefill_table, page_size, cpu)
    keep("prefill", sum(reqs.prompt_lens), run(prompts, layout, meta.build_extend_metadata(layout)))

    verify = plan_verify(reqs.run_lens, reqs.run_lens, reqs.prompt_lens, table, shape, cpu,
                         tier=VERIFY_TIER if padded else None)
    keep("verify", verify.total_rows, run(drafts, verify, meta.build_verify_metadata(verify)))

    # Each request's first verify row again, alone (it rewrites its K/V slot with the same values); padded,
    # a DP rank out of requests runs a step of padding only while the other DP rank still has one.
    firsts = [sum(reqs.run_lens[:r]) for r in range(num_reqs)]
    steps = max(len(other.prompt_lens) for other in DP_REQUESTS) if padded else num_reqs
    alone = []
    for r in range(steps):
        tier = ALONE_TIER if padded else None
        if r < num_reqs:
            layout = plan_verify([1], [1], [reqs.prompt_lens[r]], table[r:r + 1], shape, cpu, tier=tier)
            ids = drafts[firsts[r]:firsts[r] + 1]
        else:
            layout = plan_verify((), (), [], table[:0], shape, cpu, tier=tier)
            ids = drafts[:0]
        logits = run(ids, layout, meta.build_verify_metadata(layout))[2]
        if r < num_reqs:
            alone.append(logits[:1])
    out["alone.logits"] = torch.cat(alone)
    out["alone.verify_rows"] = torch.tensor(firsts)
    # The dense path (training and references): every DP rank passes the same shape.
    with torch.no_grad():
        out["dense.logits"] = model.dense_logits(model.forward_dense(prompts[None, :DENSE_LEN]))
    out["greedy"] = model.greedy_continue(prompts[None, :DENSE_LEN], 3)
    return out


# -- processes -------------------------------------------------------------------------------------------

def _rank_main(rank: int, size: int, port: int, cases: tuple[str, ...], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))
    try:
        groups = DPAttentionGroups.build(size, DP)
        places = [(g.rank, g.size) for g in (groups.world, groups.attention, groups.dp)]
        results: dict[str, Any] = {"places": (*places, groups.dp_rank)}
        one_kv_head = dummy_target(replace(CASES["llama"][1], num_kv_heads=1), torch.float32,
                                   torch.device("cpu"), "llama")
        try:
            shard_dp_attention_target(one_kv_head, groups)
        except ValueError as exc:
            results["refusal"] = str(exc)
        results["widths"] = {}
        for case in cases:
            model = build_model(case)
            shard_dp_attention_target(model, groups)
            layer = model.model.layers[0]
            results["widths"][case] = (  # the local q rows, MLP columns and vocabulary rows
                layer.self_attn.q_proj.weight.shape[0], layer.mlp.inner.gate_proj.weight.shape[0],
                model.lm_head.weight.shape[0], (model.local_num_heads, model.local_num_kv_heads))
            results[case] = serve(model, groups.dp_rank, padded=True)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn(size: int, cases: tuple[str, ...], out_dir: Path) -> list[dict[str, Any]]:
    return spawn_ranks(_rank_main, size, (cases,), out_dir, SPAWN_TIMEOUT_S, "DP-attention ranks")


@pytest.fixture(scope="module")
def references() -> dict[str, list[dict[str, torch.Tensor]]]:
    return {case: [serve(build_model(case), d, padded=False) for d in range(DP)] for case in CASES}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(2, ("llama", "qwen3"), tmp_path_factory.mktemp("dpa2"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(4, ("qwen3", "llama_mha"), tmp_path_factory.mktemp("dpa4"))


# -- checks ----------------------------------------------------------------------------------------------

def check_served(ranks: list[dict[str, Any]], case: str, want: list[dict[str, torch.Tensor]]) -> None:
    """Each rank's results against its DP rank's reference; the ranks of a DP rank return the same bits."""
    hidden_size, per_dp = CASES[case][1].hidden_size, len(ranks) // DP
    for r, result in enumerate(ranks):
        got, first, reference = result[case], ranks[r - r % per_dp][case], want[r // per_dp]
        assert got.keys() == reference.keys()
        for key, value in got.items():
            assert torch.equal(value, first[key]), (r, key)
            if value.is_floating_point():
                torch.testing.assert_close(value, reference[key], rtol=RTOL, atol=ATOL,
                                           msg=lambda m, k=key, r=r: f"{case} rank {r} {k}: {m}")
            else:  # the greedy continuation and the row indices
                assert torch.equal(value, reference[key]), (r, key)
        for step in ("prefill", "verify"):
            embeddings = got[f"{step}.states"][:, :hidden_size]  # CAPTURE[0] = 0
            assert torch.equal(embeddings, reference[f"{step}.states"][:, :hidden_size])
        for step in ("prefill", "verify", "alone", "dense"):
            assert torch.equal(got[f"{step}.logits"].argmax(-1), reference[f"{step}.logits"].argmax(-1))


def check_rows_alone(result: dict[str, torch.Tensor]) -> None:
    """Each request's first verify row equals the same row run in another step, bit for bit."""
    assert torch.equal(result["alone.logits"], result["verify.logits"][result["alone.verify_rows"]])


def test_dp_must_divide_tp() -> None:
    with pytest.raises(ValueError, match=r"dp \(2\) to divide tp \(3\)"):
        DPAttentionGroups.build(3, 2)


def test_one_dp_rank_of_one_process_leaves_the_model_whole() -> None:
    one = TPGroup.single()
    model = build_model("qwen3")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shard_dp_attention_target(model, DPAttentionGroups(one, one, one, 0))
    assert (model.local_num_heads, model.local_num_kv_heads) == (8, 4)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_groups_place_each_rank(two_ranks: list[dict[str, Any]], four_ranks: list[dict[str, Any]]) -> None:
    # (world, attention, dp) as (rank, size), then the DP rank: a DP rank's ranks are consecutive
    assert [result["places"] for result in two_ranks] == [
        ((0, 2), (0, 1), (0, 2), 0), ((1, 2), (0, 1), (1, 2), 1)]
    assert [result["places"] for result in four_ranks] == [
        ((0, 4), (0, 2), (0, 2), 0), ((1, 4), (1, 2), (0, 2), 0),
        ((2, 4), (0, 2), (1, 2), 1), ((3, 4), (1, 2), (1, 2), 1)]


@pytest.mark.slow
def test_attention_splits_over_its_dp_rank_and_the_rest_over_the_world(
        two_ranks: list[dict[str, Any]], four_ranks: list[dict[str, Any]]) -> None:
    # (q_proj rows, gate_proj rows, LM head rows, local heads): qwen3 has 8 query heads of 16 features,
    # 4 KV heads, 128 MLP columns and 66 tokens; llama_mha 4 and 4 heads, 42 columns and 67 tokens
    assert [result["widths"]["qwen3"] for result in two_ranks] == [(128, 64, 33, (8, 4))] * 2
    assert [result["widths"]["qwen3"] for result in four_ranks] == [(64, 32, 17, (4, 2))] * 4
    assert [result["widths"]["llama_mha"][1] for result in four_ranks] == [10, 11, 10, 11]


@pytest.mark.slow
def test_heads_that_do_not_split_over_the_attention_ranks_are_refused(
        two_ranks: list[dict[str, Any]], four_ranks: list[dict[str, Any]]) -> None:
    assert all("refusal" not in result for result in two_ranks)  # one attention rank holds every head
    for result in four_ranks:
        assert result["refusal"] == ("attention tensor parallelism over 2 ranks needs num_heads (4) and "
                                     "num_kv_heads (1) to be multiples of 2")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_two_ranks_serve_each_dp_rank_as_unsharded(two_ranks: list[dict[str, Any]],
                                                   references: dict[str, Any], case: str) -> None:
    check_served(two_ranks, case, references[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen3", "llama_mha"])
def test_four_ranks_serve_each_dp_rank_as_unsharded(four_ranks: list[dict[str, Any]],
                                                    references: dict[str, Any], case: str) -> None:
    check_served(four_ranks, case, references[case])


@pytest.mark.slow
def test_a_row_does_not_depend_on_its_step(two_ranks: list[dict[str, Any]], four_ranks: list[dict[str, Any]],
                                           references: dict[str, Any]) -> None:
    for per_dp in references.values():
        for result in per_dp:
            check_rows_alone(result)
    for result in two_ranks + four_ranks:
        for case in result:
            if case in CASES:
                check_rows_alone(result[case])


@pytest.mark.slow
def test_an_idle_dp_rank_leaves_the_busy_one_as_the_reference(
        two_ranks: list[dict[str, Any]], four_ranks: list[dict[str, Any]],
        references: dict[str, Any]) -> None:
    """DP rank 0's last request ran alone while DP rank 1 (two requests) ran only padding rows."""
    last = len(DP_REQUESTS[0].prompt_lens) - 1
    assert last >= len(DP_REQUESTS[1].prompt_lens)
    for ranks in (two_ranks, four_ranks):
        for result in ranks[:len(ranks) // DP]:  # DP rank 0's ranks
            for case in result:
                if case in CASES:
                    served = result[case]
                    got, want = served["alone.logits"][last], references[case][0]["alone.logits"][last]
                    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
                    assert torch.equal(got, served["verify.logits"][served["alone.verify_rows"][last]])
