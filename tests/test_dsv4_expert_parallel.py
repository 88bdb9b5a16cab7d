"""Expert parallelism for DeepSeek-V4's MoE (`dspark.runtime.families.dsv4.expert_parallel`), the seed's
bring-up step 5 on gloo: the routed experts sharded over 2 and 4 ranks, tokens dispatched to their experts'
ranks with ragged per-rank token counts (each rank a different number of rows, one rank none) and combined
back, equal to one process bit for bit; pairs of ranks holding the same rows (a DP rank's attention ranks)
dispatching half each; the graph-safe path (rows all-gathered, no shape set by the routing) and rows
replicated on every rank (plain tensor parallelism) the same. End to end: the tiny dsv4 builds
recompiled with `ep` under torchrun, with plain tensor parallelism and with DP attention, decode as one
process's target-only decoding (compact verify, every rank's rows and tier its own)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dspark.runtime.distributed.tensor_parallel import TPGroup
from dspark.runtime.families.dsv4.expert_parallel import (
    DeepEPExperts,
    DispatchedExperts,
    ReplicatedRowsExperts,
    deepep_buffer,
    shard_dsv4_experts,
)
from dspark.runtime.families.dsv4.moe import MoE
from dspark.runtime.families.dsv4.target import Dsv4ForCausalLM

from .gloo_ranks import free_port, spawn_ranks
from .parallel_builds import compile_parallel, reference, torchrun
from .test_dsv4_runtime import FULL

EXPERTS, TOPK, DIM, INTER, VOCAB = 8, 3, 16, 24, 50
ROWS = (5, 0, 9, 2)  # rank r's rows: ragged, one rank with none


def moe(hashed: bool) -> MoE:
    layer = MoE(dim=DIM, inter_dim=INTER, n_experts=EXPERTS, topk=TOPK, vocab_size=VOCAB, hashed=hashed,
                score_func="sqrtsoftplus", route_scale=1.5, swiglu_limit=1.0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
        if hashed:
            layer.gate.tid2eid.copy_(torch.rand(VOCAB, EXPERTS, generator=gen).argsort(-1)[:, :TOPK])
    return layer


def rank_moe(hashed: bool, rank: int, size: int) -> MoE:
    """`moe(hashed)` keeping rank `rank`'s share of the experts, as expert parallelism shards them."""
    layer = moe(hashed)
    held = EXPERTS // size
    for name in ("w1", "w3", "w2"):
        setattr(layer.experts, name,
                torch.nn.Parameter(getattr(layer.experts, name)[rank * held:(rank + 1) * held]))
    layer.experts.expert_offset = rank * held
    return layer


def join_gloo(rank: int, size: int, port: int) -> TPGroup:
    """This spawned process as rank `rank` of a gloo world of `size`: the world as the expert group."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))
    return TPGroup.of(dist.group.WORLD)


def rows_of(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(ROWS[rank], DIM, generator=gen) * 2
    return x, torch.randint(0, VOCAB, (ROWS[rank],), generator=gen)


def _moe_rank(rank: int, size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    ep = join_gloo(rank, size, port)
    try:
        # pairs of ranks holding the same rows, as a DP rank's two attention ranks do (size 4)
        pairs = [dist.new_group([2 * p, 2 * p + 1]) for p in range(size // 2)] if size == 4 else []
        out: dict[str, Any] = {}
        for hashed in (False, True):
            layer = rank_moe(hashed, rank, size)
            x, tokens = rows_of(rank)
            layer.parallel = DispatchedExperts(ep)
            with torch.no_grad():
                out[f"dispatched_{hashed}"] = layer(x, tokens)
                # the graph-safe path: every rank the same row count (a step's global tier)
                tier_x, tier_tokens = rows_of(rank)[0][:2], rows_of(rank)[1][:2]
                if ROWS[rank] < 2:
                    tier_x, tier_tokens = torch.zeros(2, DIM), torch.zeros(2, dtype=torch.long)  # padding
                got = layer(tier_x, tier_tokens, static_shapes=True)
                out[f"static_{hashed}"] = (tier_x, tier_tokens, got)
                if pairs:
                    leader = rank - rank % 2
                    layer.parallel = DispatchedExperts(ep, TPGroup.of(pairs[rank // 2]))
                    out[f"shared_{hashed}"] = (leader, layer(*rows_of(leader)))
                shared_x, shared_tokens = rows_of(2)  # the same rows on every rank
                layer.parallel = ReplicatedRowsExperts(ep)
                out[f"replicated_{hashed}"] = layer(shared_x, shared_tokens)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 4])
def test_dispatched_and_replicated_experts_equal_one_process(size: int, tmp_path: Path) -> None:
    ranks = spawn_ranks(_moe_rank, size, (), tmp_path, 120, "expert-parallel ranks")
    for hashed in (False, True):
        whole = moe(hashed)
        with torch.no_grad():
            for rank in range(size):
                x, tokens = rows_of(rank)
                got = ranks[rank][f"dispatched_{hashed}"]
                assert torch.equal(got, whole(x, tokens)), (size, hashed, rank)
            for rank in range(size):
                tier_x, tier_tokens, got = ranks[rank][f"static_{hashed}"]
                assert torch.equal(got, whole(tier_x, tier_tokens)), (size, hashed, rank)
                if size == 4:  # each pair dispatched its leader's rows once, half each, and gathered them
                    leader, got = ranks[rank][f"shared_{hashed}"]
                    assert torch.equal(got, whole(*rows_of(leader))), (hashed, rank)
            x, tokens = rows_of(2)
            want = whole(x, tokens)
        assert all(torch.equal(r[f"replicated_{hashed}"], want) for r in ranks), (size, hashed)


def _deepep_rank(rank: int, size: int, port: int, out_dir: str) -> None:
    from .deepep_fake import Buffer, install_fake_deepep

    torch.set_num_threads(1)
    install_fake_deepep()
    ep = join_gloo(rank, size, port)
    try:
        buffer = deepep_buffer(ep, DIM)  # sized by DeepEP's hints
        pairs = [dist.new_group([2 * p, 2 * p + 1]) for p in range(size // 2)] if size == 4 else []
        out: dict[str, Any] = {}
        for hashed in (False, True):
            layer = rank_moe(hashed, rank, size)
            layer.parallel = DeepEPExperts(ep, buffer)
            with torch.no_grad():
                out[f"deepep_{hashed}"] = layer(*rows_of(rank))
                if pairs:
                    leader = rank - rank % 2
                    layer.parallel = DeepEPExperts(ep, buffer, TPGroup.of(pairs[rank // 2]))
                    out[f"shared_{hashed}"] = (leader, layer(*rows_of(leader)))
        out["calls"] = list(Buffer.created[0].calls)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def deepep_reference(whole: MoE, x: torch.Tensor, tokens: torch.Tensor, size: int) -> torch.Tensor:
    """What DeepEP's dispatch and combine compute, written out: rows carried in bfloat16, each rank's part
    (its experts' weighted outputs, ascending expert id) rounded to bfloat16, the parts added in rank order
    in float32 and the sum rounded to bfloat16; then the shared expert on the row itself."""
    ids, weights = whole.route(x, tokens)
    slots = whole.slot_outputs(x.to(torch.bfloat16).float(), ids, weights)  # [L, k, dim]
    owner = ids // (EXPERTS // size)
    total = torch.zeros_like(x)
    for r in range(size):
        part = MoE.combine(torch.where((owner == r)[..., None], slots, 0.0))
        total = total + part.to(torch.bfloat16).float()
    return total.to(torch.bfloat16).float() + whole.shared(x)


@pytest.mark.parametrize("size", [2, 4])
def test_deepep_dispatch_and_combine_are_its_documented_sums(size: int, tmp_path: Path) -> None:
    # DeepEP (CUDA only, not installed here) by a stand-in of its documented semantics (tests/deepep_fake.py)
    ranks = spawn_ranks(_deepep_rank, size, (), tmp_path, 120, "DeepEP expert-parallel ranks")
    for hashed in (False, True):
        whole = moe(hashed)
        with torch.no_grad():
            for rank in range(size):
                x, tokens = rows_of(rank)
                got = ranks[rank][f"deepep_{hashed}"]
                assert torch.equal(got, deepep_reference(whole, x, tokens, size)), (size, hashed, rank)
                torch.testing.assert_close(got, whole(x, tokens), rtol=2e-2, atol=2e-2)  # one process's
                if size == 4:
                    leader, got = ranks[rank][f"shared_{hashed}"]
                    assert torch.equal(got, deepep_reference(whole, *rows_of(leader), size)), (hashed, rank)
    assert all(r["calls"][:3] == ["get_dispatch_layout", "dispatch", "combine"] for r in ranks)


def test_deepep_is_chosen_only_where_it_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from .deepep_fake import install_fake_deepep

    monkeypatch.setitem(sys.modules, "deep_ep", None)  # not installed: the pairs' all-to-all
    assert deepep_buffer(TPGroup.single(), DIM) is None
    install_fake_deepep(monkeypatch)
    target = Dsv4ForCausalLM(FULL)

    class Rank0Of2:
        rank, size, group = 0, 2, None

    shard_dsv4_experts(target, Rank0Of2(), rows_replicated=False, deepep="buffer")  # type: ignore[arg-type]
    layer = next(layer for layer in target.model.layers if layer.ffn is not None)
    assert isinstance(layer.ffn.parallel, DeepEPExperts) and layer.ffn.parallel.buffer == "buffer"


def test_sharding_keeps_each_ranks_experts_and_refuses_what_does_not_split() -> None:
    target = Dsv4ForCausalLM(FULL)
    target.init_dummy_(0)
    whole = [layer.ffn.experts.w2.detach().clone() for layer in target.model.layers]

    class Rank1Of2:  # a group's place without a process group: sharding itself runs no collective
        rank, size, group = 1, 2, None

    shard_dsv4_experts(target, Rank1Of2(), rows_replicated=True)  # type: ignore[arg-type]
    for layer, w2 in zip(target.model.layers, whole, strict=True):
        assert layer.ffn.experts.expert_offset == 3 and torch.equal(layer.ffn.experts.w2, w2[3:])
        assert isinstance(layer.ffn.parallel, ReplicatedRowsExperts)
    with pytest.raises(ValueError, match="already sharded"):
        shard_dsv4_experts(target, Rank1Of2(), rows_replicated=True)  # type: ignore[arg-type]

    class Rank0Of4:
        rank, size, group = 0, 4, None

    with pytest.raises(ValueError, match=r"n_routed_experts \(6\) to be a multiple of 4"):
        shard_dsv4_experts(Dsv4ForCausalLM(FULL), Rank0Of4(), rows_replicated=False)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "parallelism", "processes"), [
    ("compact", {"tp": 2, "ep": 2}, 2),
    ("compact", {"tp": 2, "dp": 2, "dp_attention": True, "ep": 2}, 2),
    ("static", {"tp": 4, "dp": 2, "dp_attention": True, "ep": 4}, 4),
], ids=["tp2_ep2", "dp_attention_tp2_dp2_ep2", "dp_attention_tp4_dp2_ep4"])
def test_expert_parallel_builds_decode_as_one_process(mode: str, parallelism: dict[str, Any], processes: int,
                                                      tmp_path: Path) -> None:
    name = compile_parallel(f"dsv4_tiny_cpu_{mode}", tmp_path, **parallelism)
    assert torchrun(name, processes, tmp_path, free_port()) == reference(f"dsv4_tiny_cpu_{mode}")
