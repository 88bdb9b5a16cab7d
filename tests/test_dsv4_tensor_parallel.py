"""Tensor parallelism of the dsv4 family (`shard_dsv4_target`): a rank keeps whole query heads (their wq_b
rows, sinks and wo columns), a share of the MLP and its vocabulary rows; the K=V head, the compressors and
the indexer are replicated. Over 2 and 4 gloo processes every rank runs what the engine runs on its shard:
prefill chunks (extend layouts), then greedy speculative decoding with verify steps in static layouts (every
request N rows, tier-padded) and packed compact layouts (ragged rows), and target-only decoding (one row
per request per step), each over its own per-slot caches (`Dsv4PagedAttention`). The device layers run the
static steps too, on the CPU: `Dsv4CudaLayers` on its torch oracle, `Dsv4AscendLayers` on the operator
models behind the fake torch_npu. End to end, the tiny static and compact builds recompiled with tp 2 run
under torchrun, and the Ascend and CUDA builds (graphs per token tier) as two ranks on the fake devices.

What is bitwise and what is not
-------------------------------
Sharded against unsharded, the logits are close, not bitwise, and the greedy tokens are identical. The
row-parallel output projection and MLP down-projection sum each rank's input features, then the ranks'
partial products (in rank order), where the unsharded `row_linear` sums all the input features in one
reduction, so the last bits differ; a shard's SiLU also runs on a narrower row, which its vector lanes split
elsewhere, and the vocab-parallel head multiplies by `ops.linear`, not `row_linear`. Measured in fp32: up
to 1.7e-6 absolute, 8e-7 relative to a row's largest logit; checked at rtol 1e-5, atol 2e-6.

What the lossless property needs is bitwise, and checked so: within one model (sharded over 2 or 4 ranks,
or whole), a row whose tokens are all committed gives the same logits in every layout that ran it (prefill
chunk, static verify, compact verify, target-only step). A row's result depends on no other row of its
step: every local product is row-wise, and the ranks' partial products are all-gathered and added in rank
order, not all-reduced (gloo's ring adds them in an order that follows the buffer's size over more than two
ranks). The device layers pool a batch of blocks, which rounds an ulp away from one block's pooling, so
they are close to the paged forward and decode the same tokens. Every rank returns the same bits as every
other, and the sharded reference path (`DSV4Model.step` through `greedy_continue`) decodes the same tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import yaml
from torch import nn

from dspark.compiler import build
from dspark.formats.dsv4_config import Dsv4Geometry, dsv4_cache_layout
from dspark.runtime.distributed import launch
from dspark.runtime.distributed.tensor_parallel import (
    PartialSum,
    TPGroup,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from dspark.runtime.engine import forward
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.families.dsv4 import ascend_op_models
from dspark.runtime.families.dsv4.ascend_layers import Dsv4AscendLayers
from dspark.runtime.families.dsv4.cpu_attention import (
    Dsv4PagedAttention,
    extend_config,
    plan_step_metadata,
    step_config,
)
from dspark.runtime.families.dsv4.cuda_layers import Dsv4CudaLayers
from dspark.runtime.families.dsv4.sharding import shard_dsv4_target
from dspark.runtime.families.dsv4.target import Dsv4ForCausalLM, Dsv4LayerBackend
from dspark.runtime.layout import StepShape, plan_extend, plan_verify
from dspark.runtime.package import load_package

from .dsv4_fake_npu import FakeCuda, FakeGraph, index_quant_everywhere, install_fake_npu
from .gloo_ranks import as_rank, generate_as_rank, spawn_ranks
from .parallel_builds import REPO

CPU = torch.device("cpu")
N = 4  # rows a request verifies at most: the root and 3 drafts
PAGE = 8
MAX_LEN = 96
MAX_REQ = 6
# 4 query heads (2 and 1 per rank), a vocabulary that pads the last rank's rows (67 over 2 and 4 ranks), an
# MLP split 21/21 and 10/11/10/11; C4 (indexer) and C128-kind (ratio 8) blocks close every few positions.
GEOMETRY = Dsv4Geometry(vocab_size=67, dim=32, compress_ratios=(0, 4, 8), csa_ratio=4, hca_ratio=8, n_heads=4,
                        head_dim=16, rope_dim=4, q_lora_rank=16, window=6, index_n_heads=2, index_head_dim=8,
                        index_topk=3, inter_dim=42, norm_eps=1e-6, rope_theta=10000.0,
                        compress_rope_theta=160000.0)
LAYOUT = dsv4_cache_layout(GEOMETRY, N, PAGE, prefill_rows=10)
VERIFY = step_config(LAYOUT, N, padding_request_rows=N)
EXTEND = extend_config(LAYOUT, VERIFY)
SHAPE = StepShape(page_size=PAGE, num_draft_tokens=N, tiers=(8, 16), padding_request_rows=N)
SLOTS = (3, 0, 5)  # non-contiguous slots
PROMPT_LENS = (23, 9, 17)
CHUNK = 10  # prefill rows per request per step
STEPS = 5  # decode steps per mode
# compact: each request runs its planned rows, packed back to back
COMPACT_RUNS = ((4, 1, 3), (2, 4, 1), (1, 2, 4), (3, 3, 2), (4, 1, 1))
NEW_TOKENS = STEPS * N + 1  # the oracle's continuation: more than any mode commits
MODES = ("target_only", "static", "compact", "static_cuda_layers", "static_ascend_layers")
DEVICE_MODES = ("static_cuda_layers", "static_ascend_layers")
RTOL, ATOL = 1e-5, 2e-6
SPAWN_TIMEOUT_S = 180


def build_target() -> Dsv4ForCausalLM:
    target = Dsv4ForCausalLM(GEOMETRY)
    target.init_dummy_(0)  # sinks, norms and compressor gates drawn: a head's sink differs from another's
    return target.eval()


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, GEOMETRY.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def oracle(target: Dsv4ForCausalLM) -> list[list[int]]:
    """Each prompt and its greedy continuation through the reference's incremental state."""
    return [target.greedy_continue(torch.tensor([p]), NEW_TOKENS)[0].tolist() for p in prompts()]


def backend(target: Dsv4ForCausalLM, mode: str) -> Dsv4LayerBackend:
    if mode == "static_cuda_layers":
        return Dsv4CudaLayers.allocate(target, LAYOUT, VERIFY, MAX_REQ, MAX_LEN, device="cpu", impl="torch")
    if mode == "static_ascend_layers":
        return Dsv4AscendLayers.allocate(target, LAYOUT, VERIFY, MAX_REQ, MAX_LEN, device="cpu")
    return Dsv4PagedAttention.allocate(target, LAYOUT, VERIFY, MAX_REQ, MAX_LEN)


@contextmanager
def fake_npu() -> Iterator[None]:
    """The fake torch_npu, its operator models taking the C128-kind ratio 8 too, while the block runs."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ascend_op_models, "CMP_RATIOS", (*ascend_op_models.CMP_RATIOS, GEOMETRY.hca_ratio))
        install_fake_npu(patch)
        yield


def decode(target: Dsv4ForCausalLM, mode: str, want: list[list[int]]) -> dict[str, Any]:
    """Prefill chunks, then `STEPS` greedy decode steps of `mode` over fresh caches. A verify step's drafts
    are the oracle's next tokens (`want`) with one spoiled where (step + request) % N < N - 1, so a step
    accepts 0 .. all of them. -> each request's sequence, and the logits of every committed row (its own and
    every earlier token committed) by (request, position)."""
    attn = backend(target, mode)
    vocab = GEOMETRY.vocab_size
    seqs = [list(p) for p in prompts()]
    cached = [0] * len(seqs)
    committed: dict[tuple[int, int], torch.Tensor] = {}
    table = torch.zeros(len(seqs), MAX_LEN // PAGE, dtype=torch.int32)  # the pool's (dsv4 reads its own)

    def forward(layout: Any, meta: Any, rows: list[list[int]]) -> torch.Tensor:
        ids = torch.zeros(layout.positions.shape[0], dtype=torch.long)
        ids[:sum(map(len, rows))] = torch.tensor(sum(rows, []))
        hidden, _ = target.forward_paged_states(ids, layout.positions, attn, meta)
        return target.compute_logits(hidden)

    while any(c < n for c, n in zip(cached, PROMPT_LENS, strict=True)):
        live = [i for i, n in enumerate(PROMPT_LENS) if cached[i] < n]
        rows = [seqs[i][cached[i]:min(cached[i] + CHUNK, PROMPT_LENS[i])] for i in live]
        layout = plan_extend([cached[i] for i in live], [len(r) for r in rows], table[live], PAGE, CPU,
                             [SLOTS[i] for i in live])
        logits = forward(layout, plan_step_metadata(layout, EXTEND, MAX_LEN, CPU), rows)
        for k, (i, r) in enumerate(zip(live, rows, strict=True)):
            part = logits[layout.host_qo_indptr[k]:layout.host_qo_indptr[k + 1]]
            for j in range(len(r)):
                committed[(i, cached[i] + j)] = part[j]
            cached[i] += len(r)
            if cached[i] == PROMPT_LENS[i]:
                seqs[i].append(int(part[-1].argmax()))

    for step in range(STEPS):
        everyone = range(len(seqs))
        if mode == "target_only":
            rows = [[seqs[i][-1]] for i in everyone]
            layout = plan_extend(cached, [1] * len(seqs), table, PAGE, CPU, SLOTS)
            meta = plan_step_metadata(layout, EXTEND, MAX_LEN, CPU)
        else:
            run_lens = COMPACT_RUNS[step] if mode == "compact" else (N,) * len(seqs)
            rows = []
            for i in everyone:
                drafts = want[i][len(seqs[i]):len(seqs[i]) + run_lens[i] - 1]
                spoil = (step + i) % N
                if spoil < len(drafts):
                    drafts[spoil] = (drafts[spoil] + 1) % vocab
                rows.append([seqs[i][-1], *drafts])
            layout = plan_verify(run_lens, run_lens, cached, table, SHAPE, CPU, slots=list(SLOTS))
            meta = plan_step_metadata(layout, VERIFY, MAX_LEN, CPU)
        logits = forward(layout, meta, rows)
        for i in everyone:
            part = logits[layout.host_qo_indptr[i]:layout.host_qo_indptr[i + 1]]
            greedy = part.argmax(-1).tolist()
            drafts = rows[i][1:]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
                accepted += 1
            for j in range(accepted + 1):  # the root and the accepted drafts are committed rows
                committed[(i, cached[i] + j)] = part[j]
            seqs[i] += [*drafts[:accepted], greedy[accepted]]
            cached[i] += accepted + 1
    return {"seqs": seqs, "committed": committed}


def serve(target: Dsv4ForCausalLM, want: list[list[int]]) -> dict[str, Any]:
    with fake_npu():
        out: dict[str, Any] = {mode: decode(target, mode, want) for mode in MODES}
    out["greedy"] = [target.greedy_continue(torch.tensor([p]), 6)[0].tolist() for p in prompts()]
    return out


# -- processes -------------------------------------------------------------------------------------------

def _rank_main(rank: int, size: int, port: int, want: list[list[int]], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))
    try:
        target = build_target()  # the same seeded model on every rank, whole, then sliced
        shard_dsv4_target(target, TPGroup.of(dist.group.WORLD))
        assert target.local_num_heads == GEOMETRY.n_heads // size
        torch.save(serve(target, want), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn(size: int, want: list[list[int]], out_dir: Path) -> list[dict[str, Any]]:
    return spawn_ranks(_rank_main, size, (want,), out_dir, SPAWN_TIMEOUT_S, "dsv4 tensor-parallel ranks")


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    return oracle(build_target())


@pytest.fixture(scope="module")
def unsharded(want: list[list[int]]) -> dict[str, Any]:
    return serve(build_target(), want)


@pytest.fixture(scope="module")
def two_ranks(want: list[list[int]], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(2, want, tmp_path_factory.mktemp("dsv4_tp2"))


@pytest.fixture(scope="module")
def four_ranks(want: list[list[int]], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(4, want, tmp_path_factory.mktemp("dsv4_tp4"))


# -- checks ----------------------------------------------------------------------------------------------

def check_lossless(result: dict[str, Any], want: list[list[int]]) -> None:
    """Every mode decodes the oracle's greedy tokens; a committed row's logits are the same bits in every
    layout that ran it, and close to them through the device layers."""
    for mode in MODES:
        for seq, whole in zip(result[mode]["seqs"], want, strict=True):
            assert seq == whole[:len(seq)], mode
    base = result["target_only"]["committed"]
    for mode in ("static", "compact"):
        rows = result[mode]["committed"]
        assert base.keys() <= rows.keys(), mode  # verify steps commit more tokens than target-only steps
        for key in base:
            assert torch.equal(rows[key], base[key]), (mode, key)
    static = result["static"]["committed"]
    for mode in DEVICE_MODES:
        rows = result[mode]["committed"]
        assert rows.keys() == static.keys(), mode
        for key in static:
            torch.testing.assert_close(rows[key], static[key], rtol=RTOL, atol=ATOL)
    for g, whole in zip(result["greedy"], want, strict=True):
        assert g == whole[:len(g)]


def check_sharded(ranks: list[dict[str, Any]], unsharded: dict[str, Any], want: list[list[int]]) -> None:
    for r, result in enumerate(ranks):
        for mode in MODES:
            got, base = result[mode], unsharded[mode]
            assert got["seqs"] == ranks[0][mode]["seqs"] == base["seqs"], (r, mode)  # the same tokens
            assert got["committed"].keys() == base["committed"].keys()
            for key, logits in got["committed"].items():
                assert torch.equal(logits, ranks[0][mode]["committed"][key]), (r, mode, key)  # every rank
                torch.testing.assert_close(logits, base["committed"][key], rtol=RTOL, atol=ATOL,
                                           msg=lambda m, k=key, mo=mode: f"{mo} {k}: {m}")
                assert int(logits.argmax()) == int(base["committed"][key].argmax()), (mode, key)
        check_lossless(result, want)


def test_unsharded_decoding_is_lossless(unsharded: dict[str, Any], want: list[list[int]]) -> None:
    check_lossless(unsharded, want)


@pytest.mark.slow
def test_two_ranks_decode_as_unsharded(two_ranks: list[dict[str, Any]], unsharded: dict[str, Any],
                                       want: list[list[int]]) -> None:
    check_sharded(two_ranks, unsharded, want)


@pytest.mark.slow
def test_four_ranks_decode_as_unsharded(four_ranks: list[dict[str, Any]], unsharded: dict[str, Any],
                                        want: list[list[int]]) -> None:
    check_sharded(four_ranks, unsharded, want)


# -- the split, in this process (slicing runs no collective) ----------------------------------------------

def place(rank: int, size: int) -> TPGroup:
    """Rank `rank` of a group of `size` without a process group: enough to slice a model, not to run it."""
    return TPGroup(rank, size, object())  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [2, 4])
def test_a_rank_keeps_whole_query_heads_and_replicates_the_rest(size: int) -> None:
    whole = build_target()
    h, d = GEOMETRY.n_heads // size, GEOMETRY.head_dim
    for rank in range(size):
        target = copy.deepcopy(whole)
        shard_dsv4_target(target, place(rank, size))
        assert target.local_num_heads == h
        heads, q = slice(rank * h, (rank + 1) * h), slice(rank * h * d, (rank + 1) * h * d)
        i0, i1 = rank * GEOMETRY.inter_dim // size, (rank + 1) * GEOMETRY.inter_dim // size
        for mine, full in zip(target.model.layers, whole.model.layers, strict=True):
            assert mine.local_heads == h and isinstance(mine.partial_sum, PartialSum)
            assert torch.equal(mine.wq_b, full.wq_b[q]) and torch.equal(mine.wo, full.wo[:, q])
            assert torch.equal(mine.attn_sink, full.attn_sink[heads])
            assert torch.equal(mine.w1, full.w1[i0:i1]) and torch.equal(mine.w3, full.w3[i0:i1])
            assert torch.equal(mine.w2, full.w2[:, i0:i1])
            sharded = {"wq_b", "attn_sink", "wo", "w1", "w3", "w2"}
            replicated = {name: p for name, p in full.named_parameters() if name not in sharded}
            # wq_a, q_norm, wkv, kv_norm, the norms, the compressor and the indexer: whole on every rank
            assert replicated
            assert all(torch.equal(p, mine.get_parameter(name)) for name, p in replicated.items())
        model = target.model
        assert isinstance(model.vocab_embed, VocabParallelEmbedding) and target.lm_head is model.vocab_head
        assert isinstance(model.vocab_head, VocabParallelLMHead)
        rows = -(-GEOMETRY.vocab_size // size)
        assert model.vocab_embed.weight.shape == model.vocab_head.weight.shape == (rows, GEOMETRY.dim)
        assert not hasattr(model, "embed") and not hasattr(model, "head")  # the whole tables are dropped


def test_the_ascend_attention_is_sized_by_the_local_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU paged and CUDA layers take the heads from the layer (its queries and sinks); the Ascend
    operators' tiling plan is sized by the target's local heads."""
    install_fake_npu(monkeypatch)
    target = build_target()

    def heads() -> int:
        return Dsv4AscendLayers.allocate(target, LAYOUT, VERIFY, 1, MAX_LEN, device="cpu").attention.num_heads

    assert heads() == 4
    shard_dsv4_target(target, place(1, 2))
    assert heads() == 2


def test_a_group_of_one_leaves_the_model_whole() -> None:
    target = build_target()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    shard_dsv4_target(target, TPGroup.single())
    assert target.local_num_heads == GEOMETRY.n_heads and target.model.vocab_embed is None
    assert target.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


def test_what_does_not_split_is_refused() -> None:
    with pytest.raises(ValueError, match=r"needs n_heads \(4\) to be a multiple of 3"):
        shard_dsv4_target(build_target(), place(0, 3))
    with pytest.raises(ValueError, match="shards a dsv4 target, not Linear"):
        shard_dsv4_target(nn.Linear(2, 2), TPGroup.single())
    target = build_target()
    shard_dsv4_target(target, place(0, 2))
    with pytest.raises(ValueError, match="already sharded"):
        shard_dsv4_target(target, place(0, 2))


# -- launches ----------------------------------------------------------------------------------------------

# -- device packages with graphs, on the CPU -----------------------------------------------------------------

DEVICES = {"ascend": "910c", "cuda": "h200"}
DEVICE_PROMPT_LENS = (125, 3, 19)  # the first crosses position 127, where the first C128 block closes
DEVICE_NEW_TOKENS = 8


def device_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in DEVICE_PROMPT_LENS]


def device_package(backend: str, root: Path, tp: int = 1) -> Path:
    """specs/dsv4_tiny_cpu_compact.yaml with the C128 layer at ratio 128 (as the Ascend operators take it),
    compiled for `backend` (a 910C with NPU graphs, an H200 with CUDA graphs, per token tier) and `tp`."""
    spec = yaml.safe_load((REPO / "specs" / "dsv4_tiny_cpu_compact.yaml").read_text())
    spec["model"]["geometry"].update(hca_ratio=128, compress_ratios=[0, 4, 128, 4])
    spec["name"] = f"dsv4_tiny_{backend}_tp{tp}"
    spec["parallelism"] = {"tp": tp}
    if backend != "cpu":
        spec.update(backend={"kind": backend, "device": DEVICES[backend]},
                    graph={"enabled": True, "token_tiers": [8, 16, 24, 32]})
    path = root / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    # the cost table was written for the one-process build, whose fingerprint it carries
    return build(path, root / "generated" / spec["name"], allow_stale_tables=True).package_dir


def _device_rank(rank: int, size: int, port: int, backend: str, package_dir: str, prompts: list[list[int]],
                 out_dir: str) -> None:
    """One rank of a torchrun-like launch of the device package on the fake device, the check mode on."""
    as_rank(rank, size, port, check=True)
    replays: list[int] = []
    replay = FakeGraph.replay

    def counted(graph: FakeGraph) -> None:
        replays.append(id(graph))
        replay(graph)

    with pytest.MonkeyPatch.context() as patch:
        fake = install_fake_npu(patch)
        if backend == "cuda":
            patch.setattr(torch, "cuda", FakeCuda())
        patch.setitem(forward.DEVICES, backend, "cpu")  # the fake device's tensors live on the host
        patch.setitem(launch.PROCESS_GROUP_BACKENDS, backend, "gloo")
        patch.setattr(FakeGraph, "replay", counted)
        result = {"replays": replays, **generate_as_rank(package_dir, prompts, DEVICE_NEW_TOKENS)}
        result["heads"] = sorted({kw["num_heads_q"] for name, kw in fake.calls if "num_heads_q" in kw})
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def device_package_cpu(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return device_package("cpu", tmp_path_factory.mktemp("dsv4_cpu"))


@pytest.fixture
def device_reference(backend: str, device_package_cpu: Path,
                     monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """One process's target-only decoding of the CPU package of the same geometry (for Ascend, with the
    indexer computed as its int8 operator does)."""
    if backend == "ascend":
        index_quant_everywhere(monkeypatch)
    runtime = Runtime(load_package(device_package_cpu))
    return runtime.generate(device_prompts(), DEVICE_NEW_TOKENS, target_only=True)[0]


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(DEVICES))
def test_device_packages_replay_their_graphs_on_every_rank(backend: str, device_reference: list[list[int]],
                                                          tmp_path: Path) -> None:
    """The Ascend and CUDA packages (graphs per token tier) compiled with tp 2, run as two gloo ranks on the
    fake device: every rank captures its own graphs, every verify step replays them on both ranks, the ranks
    agree on every step (the check mode), the Ascend operators run 2 query heads, and the greedy output
    equals one process's target-only decoding of the CPU package."""
    package = device_package(backend, tmp_path, tp=2)
    ranks = spawn_ranks(_device_rank, 2, (backend, str(package), device_prompts()), tmp_path, SPAWN_TIMEOUT_S,
                        f"dsv4 {backend} ranks")
    assert ranks[0]["graphs"] == [8, 16, 24, 32]
    assert ranks[0]["outputs"] == device_reference
    assert len(ranks[0]["replays"]) == len(ranks[1]["replays"]) >= ranks[0]["steps"] > 0
    for result in ranks:
        assert result["heads"] == ([GEOMETRY.n_heads // 2] if backend == "ascend" else [])
