"""Sharded loading: on 2 gloo ranks, `load_sharded_target` (reading only the rank's slices of the
safetensors checkpoint) gives every parameter and buffer bit for bit as `load_target` followed by
`shard_dense_target` does, with the same ties, dtypes, devices, `requires_grad` and local heads; a
checkpoint split in two files by an index json loads the same; a checkpoint missing a tensor is refused
with its name. Under DP attention (2 ranks of tp 2, dp 2: attention whole on each DP rank; 4 ranks of
tp 4, dp 2: attention split over 2 ranks per DP rank) it equals `load_target` followed by
`shard_dp_attention_target` the same way, wrappers and all.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from dspark.runtime.config import ModelGeometry
from dspark.runtime.distributed.dp_attention import DPAttentionGroups, shard_dp_attention_target
from dspark.runtime.distributed.sharded_load import load_sharded_target, read_embeddings
from dspark.runtime.distributed.tensor_parallel import TPGroup, shard_dense_target
from dspark.runtime.models.checkpoint import CheckpointError, load_target, save_target, target_embeddings
from dspark.runtime.models.families import build_target

from .gloo_ranks import spawn_ranks

# Vocabularies that 2 ranks do not split evenly (the last rank's shard is padded) and ones they do.
GEOMETRIES = {
    "llama": ModelGeometry(  # untied LM head, projection and MLP biases, GQA, MLP columns 21/21
        vocab_size=67, hidden_size=32, intermediate_size=42, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, max_position_embeddings=128, attention_bias=True, mlp_bias=True),
    "qwen3": ModelGeometry(  # tied embeddings, per-head q/k norms, MLP columns 21/22
        vocab_size=66, hidden_size=32, intermediate_size=43, num_layers=2, num_heads=8, num_kv_heads=4,
        head_dim=16, max_position_embeddings=128, tie_word_embeddings=True),
}
# (checkpoint directory, family, serving dtype)
CASES = (("llama", "llama", "float32"), ("qwen3", "qwen3", "float32"), ("llama_split", "llama", "bfloat16"),
         ("qwen3", "qwen3", "bfloat16"))
DROPPED = "model.layers.1.mlp.down_proj.weight"
SPAWN_TIMEOUT_S = 60


def random_target(family: str) -> nn.Module:
    """A target with every parameter drawn (biases and norm scales too, so a misplaced slice shows)."""
    model = build_target(family, GEOMETRIES[family])
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return model


def write_checkpoints(root: Path) -> None:
    for family in GEOMETRIES:
        save_target(root / family, random_target(family), family)  # type: ignore[arg-type]
    # The llama checkpoint split over two files named by an index, as large HF checkpoints are.
    split = root / "llama_split"
    save_target(split, random_target("llama"), "llama")  # type: ignore[arg-type]
    state = load_file(str(split / "model.safetensors"))
    (split / "model.safetensors").unlink()
    names = sorted(state)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in parts.items():
        save_file({k: state[k] for k in keys}, str(split / file), metadata={"format": "pt"})
    weight_map = {k: file for file, keys in parts.items() for k in keys}
    index = {"metadata": {}, "weight_map": weight_map}
    (split / "model.safetensors.index.json").write_text(json.dumps(index))
    # The qwen3 checkpoint without one tensor.
    broken = root / "broken"
    save_target(broken, random_target("qwen3"), "qwen3")  # type: ignore[arg-type]
    state = load_file(str(broken / "model.safetensors"))
    del state[DROPPED]
    save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes: equal bytes, unlike `torch.equal` on floats, tell -0.0 from 0.0 and match NaNs."""
    return t.detach().contiguous().view(torch.uint8)


def differences(expected: nn.Module, got: nn.Module) -> list[str]:
    """Every way `got` differs from `expected`: names, bits, dtypes, devices, shapes, ties, grads, heads."""
    found: list[str] = []
    want = dict(expected.named_parameters(remove_duplicate=False)) | dict(expected.named_buffers())
    have = dict(got.named_parameters(remove_duplicate=False)) | dict(got.named_buffers())
    if list(want) != list(have):
        found.append(f"names {list(want)} != {list(have)}")
    for name in want.keys() & have.keys():
        a, b = want[name], have[name]
        if (a.dtype, a.shape, a.device, a.requires_grad) != (b.dtype, b.shape, b.device, b.requires_grad):
            found.append(f"{name}: {a.dtype} {a.shape} {a.device} {a.requires_grad} != "
                         f"{b.dtype} {b.shape} {b.device} {b.requires_grad}")
        elif not torch.equal(bits(a), bits(b)):
            found.append(f"{name}: bits differ")

    def facts(m: Any) -> dict[str, Any]:
        return {"tied": m.lm_head.weight is m.model.embed_tokens.weight, "local_num_heads": m.local_num_heads,
                "local_num_kv_heads": m.local_num_kv_heads, "training": m.training}

    if facts(expected) != facts(got):
        found.append(f"{facts(expected)} != {facts(got)}")
    types = [type(m).__name__ for m in expected.modules()], [type(m).__name__ for m in got.modules()]
    if types[0] != types[1]:
        found.append(f"modules {types[0]} != {types[1]}")
    return found


def compare(root: Path, tp: TPGroup | DPAttentionGroups) -> dict[str, Any]:
    results: dict[str, Any] = {}
    cpu = torch.device("cpu")
    for ckpt, family, dtype in CASES:
        expected = load_target(ckpt, dtype, root, family).to(cpu)
        if isinstance(tp, DPAttentionGroups):
            shard_dp_attention_target(expected, tp)
        else:
            shard_dense_target(expected, tp)
        got = load_sharded_target(ckpt, dtype, root, None, tp, cpu)
        results[f"{ckpt}.{dtype}"] = differences(expected, got)  # type: ignore[arg-type]
    try:
        load_sharded_target("broken", "float32", root, "qwen3", tp, cpu)
        results["refusal"] = None
    except CheckpointError as exc:
        results["refusal"] = str(exc)
    return results


def _rank_main(rank: int, size: int, port: int, root: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=30))
    try:
        torch.save(compare(Path(root), TPGroup.of(dist.group.WORLD)), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _dp_rank_main(rank: int, size: int, port: int, root: str, dp: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=30))
    try:
        groups = DPAttentionGroups.build(size, dp)
        results = compare(Path(root), groups)
        # (attention ranks, DP ranks, wrapped modules): that the case is the DP-attention layout
        wrapped = sum(type(m).__name__.startswith("DPGathered")
                      for m in load_sharded_target("qwen3", "float32", Path(root), None, groups,
                                                   torch.device("cpu")).modules())
        results["layout"] = (groups.attention.size, groups.dp.size, wrapped)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sharded_load")
    write_checkpoints(root)
    return root


def check(results: dict[str, Any]) -> None:
    for case, found in results.items():
        if case not in ("refusal", "layout"):
            assert found == [], case
    refusal = results["refusal"]
    assert refusal is not None and DROPPED in refusal and "missing tensors" in refusal


def test_two_ranks_load_their_shards_bitwise(checkpoints: Path, tmp_path: Path) -> None:
    ranks = spawn_ranks(_rank_main, 2, (str(checkpoints),), tmp_path, SPAWN_TIMEOUT_S, "sharded loads")
    for results in ranks:
        check(results)
    assert len(ranks[0]) == len(CASES) + 1


@pytest.mark.slow
@pytest.mark.parametrize(("size", "dp"), [(2, 2), (4, 2)])
def test_dp_attention_ranks_load_their_shards_bitwise(checkpoints: Path, tmp_path: Path, size: int,
                                                      dp: int) -> None:
    ranks = spawn_ranks(_dp_rank_main, size, (str(checkpoints), dp), tmp_path, SPAWN_TIMEOUT_S,
                        "DP-attention sharded loads")
    for results in ranks:
        check(results)
        # qwen3's 2 layers: an MLP wrapper each, and the embedding's and the LM head's
        assert results["layout"] == (size // dp, dp, 4)
    assert len(ranks[0]) == len(CASES) + 2


def test_group_of_one_loads_the_whole_model(checkpoints: Path) -> None:
    check(compare(checkpoints, TPGroup.single()))


def test_one_dp_rank_of_one_process_loads_the_whole_model(checkpoints: Path) -> None:
    one = TPGroup.single()
    check(compare(checkpoints, DPAttentionGroups(one, one, one, 0)))


@pytest.mark.parametrize(("directory", "family", "dtype"), CASES)
def test_a_draft_shares_the_checkpoints_whole_embeddings(checkpoints: Path, directory: str, family: str,
                                                          dtype: str) -> None:
    """What rank 0 reads for a draft without its own embeddings and LM head under tensor parallelism equals,
    bit for bit, what a whole loaded target shares (`target_embeddings`)."""
    want = target_embeddings(load_target(str(checkpoints / directory), dtype, None, family))
    got = read_embeddings(str(checkpoints / directory), dtype, None, family)
    assert all(torch.equal(bits(g), bits(w)) and g.dtype == w.dtype for g, w in zip(got, want, strict=True))
