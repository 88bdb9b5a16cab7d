"""Tensor parallelism of the dense families: a target sharded over 2 (and 4) gloo processes serves the
same hidden states, target states and logits as the unsharded model in this process.

Every rank builds the same seeded dummy model, shards it (`shard_dense_target`), allocates its own paged
KV cache for its KV heads and a `TorchPagedAttention` for its query heads, and runs what the engine runs:
a prefill (`plan_extend` + the generated CPU package's metadata builder) and a ragged compact verify step
(`plan_verify`), then each request's first verify row alone, as target-only decoding would run it.

The results are close, not bitwise: a row-parallel layer (o_proj, down_proj) sums its input features'
partial products per rank and then across ranks, where the unsharded product sums them in one GEMM
reduction, so the rounding differs in the last bits (fp32: measured up to about 2e-7 absolute, 4e-7
relative to the largest value; checked at rtol 1e-5, atol 1e-6). The embeddings are bitwise (one
nonzero row per id in the all-reduce), greedy argmax is identical, and every rank returns the same
bits as every other. A row's result stays independent of the step's other rows (the row run alone
equals its verify row bitwise, as unsharded), on 4 ranks too, where an all-reduce would not keep it.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dspark.runtime.attention.torch_paged import TorchPagedAttention
from dspark.runtime.config import ModelGeometry
from dspark.runtime.distributed.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    VocabShard,
    shard_dense_target,
)
from dspark.runtime.kv_cache import PagedKVCache
from dspark.runtime.layout import StepShape, plan_extend, plan_verify
from dspark.runtime.models.dummy import dummy_target
from dspark.runtime.models.llama import LlamaForCausalLM

from .gloo_ranks import spawn_ranks
from .runtime_helpers import REPO, import_package_module

PACKAGE = REPO / "generated" / "qwen3_tiny_cpu_compact"  # its CPU metadata builders (family-independent)
# Each case is (family, geometry). A vocabulary that does not split evenly pads the last rank's slice.
CASES = {
    # 2 ranks: untied LM head, projection and MLP biases, GQA
    "llama": ("llama", ModelGeometry(
        vocab_size=67, hidden_size=32, intermediate_size=42, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, max_position_embeddings=128, attention_bias=True, mlp_bias=True)),
    # 2 and 4 ranks: tied embeddings, per-head q/k norms, GQA
    "qwen3": ("qwen3", ModelGeometry(
        vocab_size=66, hidden_size=32, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=4,
        head_dim=16, max_position_embeddings=128, tie_word_embeddings=True)),
    # 4 ranks: one KV head per query head, tied embeddings with biases, MLP columns split 10/11/10/11
    "llama_mha": ("llama", ModelGeometry(
        vocab_size=67, hidden_size=32, intermediate_size=42, num_layers=2, num_heads=4, num_kv_heads=4,
        head_dim=16, max_position_embeddings=128, tie_word_embeddings=True, attention_bias=True,
        mlp_bias=True)),
}
PROMPT_LENS = (7, 19, 3)
RUN_LENS = (8, 1, 3)  # a ragged compact verify step: each request runs its planned rows
NUM_DRAFT_TOKENS = 8
PAGES_PER_REQUEST = 4
CAPTURE = (0, 1, 2)
RTOL, ATOL = 1e-5, 1e-6
SPAWN_TIMEOUT_S = 120


def build_model(case: str) -> LlamaForCausalLM:
    """The case's seeded dummy target, with its biases and norm scales drawn too (dummy weights leave
    them at 0 and 1, which would not show a bias added twice or a norm applied to the wrong heads)."""
    family, geometry = CASES[case]
    model = dummy_target(geometry, torch.float32, torch.device("cpu"), family)
    assert isinstance(model, LlamaForCausalLM)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                centre = 1.0 if "norm" in name else 0.0
                param.copy_(centre + 0.1 * torch.randn(param.shape, generator=generator))
    return model


def serve(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """A prefill, a ragged verify step and each request's first verify row alone, over this process's
    own KV cache and attention (sized by the model's local heads); hidden states, states and logits."""
    meta = import_package_module(PACKAGE, "attn_metadata")
    page_size = meta.PAGE_SIZE
    cfg = model.cfg
    num_reqs = len(PROMPT_LENS)
    cache = PagedKVCache(cfg.num_layers, num_reqs * PAGES_PER_REQUEST + 1, page_size,
                         model.local_num_kv_heads, cfg.head_dim, torch.float32)
    attn = TorchPagedAttention(cache, page_size, model.local_num_heads, cfg.head_dim ** -0.5)
    table = torch.arange(1, num_reqs * PAGES_PER_REQUEST + 1, dtype=torch.int32).view(num_reqs, -1)
    generator = torch.Generator().manual_seed(3)
    prompts = torch.randint(cfg.vocab_size, (sum(PROMPT_LENS),), generator=generator)
    drafts = torch.randint(cfg.vocab_size, (sum(RUN_LENS),), generator=generator)
    cpu = torch.device("cpu")
    out: dict[str, torch.Tensor] = {}

    def run(name: str, ids: torch.Tensor, layout: Any, metadata: Any) -> None:
        hidden, states = model.forward_paged_states(ids, layout.positions, attn, metadata, CAPTURE)
        assert states is not None
        out[f"{name}.hidden"], out[f"{name}.states"] = hidden, states
        out[f"{name}.logits"] = model.compute_logits(hidden)

    prefill = plan_extend([0] * num_reqs, PROMPT_LENS, table, page_size, cpu)
    run("prefill", prompts, prefill, meta.build_extend_metadata(prefill))
    shape = StepShape(page_size=page_size, num_draft_tokens=NUM_DRAFT_TOKENS)
    verify = plan_verify(RUN_LENS, RUN_LENS, PROMPT_LENS, table, shape, cpu)
    run("verify", drafts, verify, meta.build_verify_metadata(verify))
    # Each request's first verify row again, alone (it rewrites its K/V slot with the same values).
    firsts = [sum(RUN_LENS[:r]) for r in range(num_reqs)]
    alone = []
    for r, first in enumerate(firsts):
        layout = plan_extend([PROMPT_LENS[r]], [1], table[r:r + 1], page_size, cpu)
        hidden = model.forward_paged(drafts[first:first + 1], layout.positions, attn,
                                     meta.build_extend_metadata(layout))
        alone.append(model.compute_logits(hidden))
    out["alone.logits"] = torch.cat(alone)
    out["alone.verify_rows"] = torch.tensor(firsts)
    # The dense path (training and references) runs on the local heads too.
    with torch.no_grad():
        out["dense.logits"] = model.dense_logits(model.forward_dense(prompts[None, :PROMPT_LENS[0]]))
    out["greedy"] = model.greedy_continue(prompts[None, :PROMPT_LENS[1]], 4)
    return out


# -- the parallel layers against their dense counterparts -----------------------------------------------

def dense_layers() -> dict[str, nn.Module]:
    generator = torch.Generator().manual_seed(11)

    def linear(d_in: int, d_out: int, bias: bool) -> nn.Linear:
        layer = nn.Linear(d_in, d_out, bias=bias)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator))
            if layer.bias is not None:
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator))
        return layer

    embed = nn.Embedding(23, 12)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(embed.weight.shape, generator=generator))
    return {"column": linear(12, 10, True), "row": linear(10, 12, True), "embed": embed,
            "head": linear(12, 23, False)}


def layer_inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(12)
    return {"x": torch.randn(2, 5, 12, generator=generator), "h": torch.randn(2, 5, 10, generator=generator),
            "ids": torch.randint(23, (2, 5), generator=generator)}


def run_layers(tp: TPGroup) -> dict[str, torch.Tensor]:
    """Each parallel layer on this rank's share: column outputs are this rank's columns, the others whole."""
    dense, inputs = dense_layers(), layer_inputs()
    start, end = tp.rank * 10 // tp.size, (tp.rank + 1) * 10 // tp.size
    column = ColumnParallelLinear.from_dense(dense["column"], start, end, tp)
    row = RowParallelLinear.from_dense(dense["row"], start, end, tp)
    shard = VocabShard.of(23, tp)
    embed = VocabParallelEmbedding(nn.Parameter(shard.slice(dense["embed"].weight.detach())), shard, tp)
    head = VocabParallelLMHead(nn.Parameter(shard.slice(dense["head"].weight.detach())), shard, tp)
    with torch.no_grad():
        return {"column": column(inputs["x"]), "row": row(inputs["h"][..., start:end]),
                "embed": embed(inputs["ids"]), "head": head(inputs["x"])}


# -- processes -------------------------------------------------------------------------------------------

def _rank_main(rank: int, size: int, port: int, cases: tuple[str, ...], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))
    try:
        tp = TPGroup.of(dist.group.WORLD)
        results: dict[str, Any] = {"layers": run_layers(tp)}
        one_kv_head = dummy_target(replace(CASES["llama"][1], num_kv_heads=1), torch.float32,
                                   torch.device("cpu"), "llama")
        try:
            shard_dense_target(one_kv_head, tp)
        except ValueError as exc:
            results["refusal"] = str(exc)
        for case in cases:
            model = build_model(case)
            shard_dense_target(model, tp)
            assert (model.local_num_heads, model.local_num_kv_heads) == (
                model.cfg.num_heads // size, model.cfg.num_kv_heads // size)
            results[case] = serve(model)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn(size: int, cases: tuple[str, ...], out_dir: Path) -> list[dict[str, Any]]:
    return spawn_ranks(_rank_main, size, (cases,), out_dir, SPAWN_TIMEOUT_S, "tensor-parallel ranks")


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, torch.Tensor]]:
    return {case: serve(build_model(case)) for case in CASES}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(2, ("llama", "qwen3"), tmp_path_factory.mktemp("tp2"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(4, ("qwen3", "llama_mha"), tmp_path_factory.mktemp("tp4"))


# -- checks ----------------------------------------------------------------------------------------------

def check_layers(ranks: list[dict[str, Any]]) -> None:
    dense, inputs = dense_layers(), layer_inputs()
    with torch.no_grad():
        want = {"column": dense["column"](inputs["x"]), "row": dense["row"](inputs["h"]),
                "embed": dense["embed"](inputs["ids"]), "head": dense["head"](inputs["x"])}
    columns = torch.cat([result["layers"]["column"] for result in ranks], dim=-1)  # rank order
    torch.testing.assert_close(columns, want["column"], rtol=RTOL, atol=ATOL)
    for r, result in enumerate(ranks):
        got = result["layers"]
        torch.testing.assert_close(got["row"], want["row"], rtol=RTOL, atol=ATOL)
        assert torch.equal(got["embed"], want["embed"])
        torch.testing.assert_close(got["head"], want["head"], rtol=RTOL, atol=ATOL)
        for name in ("row", "embed", "head"):  # whole outputs: the same bits on every rank
            assert torch.equal(got[name], ranks[0]["layers"][name]), (r, name)


def check_served(ranks: list[dict[str, Any]], case: str, want: dict[str, torch.Tensor]) -> None:
    hidden_size = CASES[case][1].hidden_size
    for r, result in enumerate(ranks):
        got = result[case]
        assert got.keys() == want.keys()
        for key, value in got.items():
            assert torch.equal(value, ranks[0][case][key]), (r, key)  # every rank: the same bits
            if value.is_floating_point():
                torch.testing.assert_close(value, want[key], rtol=RTOL, atol=ATOL,
                                           msg=lambda m, k=key: f"{case} {k}: {m}")
            else:  # the greedy continuation and the row indices
                assert torch.equal(value, want[key]), key
        for step in ("prefill", "verify"):
            embeddings = got[f"{step}.states"][:, :hidden_size]  # CAPTURE[0] = 0
            assert torch.equal(embeddings, want[f"{step}.states"][:, :hidden_size])
            assert torch.equal(got[f"{step}.logits"].argmax(-1), want[f"{step}.logits"].argmax(-1))


def check_rows_alone(result: dict[str, torch.Tensor]) -> None:
    """Each request's first verify row equals the same row run alone, bit for bit (what keeps greedy
    speculative decoding identical to target-only decoding on the CPU), whatever the MLP width a shard
    gets: the MLP's SiLU runs on whole vector lanes (`ops.lanewise`)."""
    assert torch.equal(result["alone.logits"], result["verify.logits"][result["alone.verify_rows"]])


def test_a_group_of_one_runs_the_layers_as_dense_and_leaves_the_model_whole() -> None:
    check_layers([{"layers": run_layers(TPGroup.single())}])
    model = build_model("qwen3")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shard_dense_target(model, TPGroup.single())
    assert (model.local_num_heads, model.local_num_kv_heads) == (8, 4)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_tp_group_checks_its_place() -> None:
    with pytest.raises(ValueError, match="outside a group of 2"):
        TPGroup(2, 2, None)
    with pytest.raises(ValueError, match="needs a process group"):
        TPGroup(0, 2, None)


def test_only_a_dense_target_shards() -> None:
    with pytest.raises(ValueError, match="dense families"):
        shard_dense_target(nn.Linear(2, 2), TPGroup.single())


@pytest.mark.slow
def test_two_ranks_layers_equal_dense(two_ranks: list[dict[str, Any]]) -> None:
    check_layers(two_ranks)


@pytest.mark.slow
def test_heads_that_do_not_split_are_refused(two_ranks: list[dict[str, Any]]) -> None:
    for result in two_ranks:
        assert result["refusal"] == ("tensor parallelism over 2 ranks needs num_heads (4) and "
                                     "num_kv_heads (1) to be multiples of 2")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_two_ranks_serve_as_unsharded(two_ranks: list[dict[str, Any]], references: dict[str, Any],
                                      case: str) -> None:
    check_served(two_ranks, case, references[case])


@pytest.mark.slow
def test_a_row_does_not_depend_on_its_step(two_ranks: list[dict[str, Any]], four_ranks: list[dict[str, Any]],
                                           references: dict[str, Any]) -> None:
    for case in references:
        check_rows_alone(references[case])
    for result in two_ranks + four_ranks:
        for case in result:
            if case in CASES:
                check_rows_alone(result[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen3", "llama_mha"])
def test_four_ranks_serve_as_unsharded(four_ranks: list[dict[str, Any]], references: dict[str, Any],
                                       case: str) -> None:
    check_served(four_ranks, case, references[case])


@pytest.mark.slow
def test_four_ranks_layers_equal_dense(four_ranks: list[dict[str, Any]]) -> None:
    check_layers(four_ranks)
