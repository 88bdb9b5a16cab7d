"""Loading a tensor-parallel rank's share of a dense target straight from its safetensors checkpoint.

`shard_dense_target` slices a model whose weights are whole, so every rank first needs the whole model
in memory. `load_sharded_target` instead builds the model's structure on the `meta` device (shapes, no
storage), shards that with the same `shard_dense_target` (which records on each parallel layer the dense
features it holds), and then fills every parameter with only this rank's rows or columns, read with
`safe_open(...).get_slice(name)[...]`: a rank never holds more than its share plus one tensor's slice.

Under DP attention (`dp_attention`) the meta model is sharded with `shard_dp_attention_target` instead:
attention split over the rank's DP rank, the MLP, the embedding and the LM head over the world, the
world-parallel modules wrapped in `DPGatheredMLP` / `DPGatheredVocab`. The slices are read the same way,
under the checkpoint's names (the wrappers add an `inner` segment that the checkpoint's names lack).

The result is the one `load_target` followed by `shard_dense_target` (or `shard_dp_attention_target`)
gives on the same rank, bit for bit: each slice goes through the same conversions (the checkpoint's
dtype to the dtype the model is built in, which `load_state_dict` does, then to the serving dtype, which
`load_target` does) before it moves to the device, and the vocabulary padding is the same zeros.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.runtime.distributed.dp_attention import (
    DPAttentionGroups,
    DPGatheredMLP,
    DPGatheredVocab,
    shard_dp_attention_target,
)
from dspark.runtime.distributed.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    dense_target,
    shard_dense_target,
)
from dspark.runtime.families.dsv4.weights import DSV4_VOCAB_NAMES
from dspark.runtime.models.checkpoint import DTYPES, CheckpointError, resolve_checkpoint, target_config
from dspark.runtime.models.families import build_target
from dspark.runtime.models.llama import LlamaForCausalLM
from dspark.runtime.models.skeleton import skeleton

# HF checkpoints may carry buffers such as rotary inv_freq that the model recomputes (as `_load_into`).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _shard_files(path: Path) -> list[str]:
    """The safetensors files of the checkpoint at `path`, as `checkpoint._load_state` reads them."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    absent = [f for f in files if not (path / f).is_file()]
    if absent:
        raise CheckpointError(f"{index}: lists safetensors files that are not in {path}: {absent[:5]}")
    return files


def _open_tensors(path: Path, stack: ExitStack) -> dict[str, Any]:
    """Each tensor name of the checkpoint to the open file holding it (a later file wins a name both
    hold, as the dict update in `_load_state` does); nothing is read yet."""
    handles: dict[str, Any] = {}
    for name in _shard_files(path):
        handle = stack.enter_context(safe_open(str(path / name), framework="pt", device="cpu"))
        handles.update((key, handle) for key in handle.keys())
    return handles


def _checkpoint_prefix(model: nn.Module, prefix: str) -> str:
    """The checkpoint's name of `model`'s submodule at `prefix`. DP attention wraps the world-parallel
    modules in `DPGatheredVocab` / `DPGatheredMLP`, which hold the module the checkpoint names as
    `inner`: the checkpoint has no such segment (`model.layers.0.mlp.inner.gate_proj` is its
    `model.layers.0.mlp.gate_proj`), so each wrapper's `inner` is dropped."""
    kept: list[str] = []
    module = model
    for part in prefix.split(".") if prefix else ():
        if not (part == "inner" and isinstance(module, (DPGatheredVocab, DPGatheredMLP))):
            kept.append(part)
        module = module.get_submodule(part)
    return ".".join(kept)


def _read(handle: Any, name: str, module: nn.Module, attr: str) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name`, for parameter `attr` of the sharded `module`."""
    if isinstance(module, ColumnParallelLinear) and module.span is not None:
        start, end = module.span  # output features: rows of the weight and of the bias
        return handle.get_slice(name)[start:end]
    if isinstance(module, RowParallelLinear) and module.span is not None and attr == "weight":
        start, end = module.span  # input features: columns of the weight; the bias is whole
        return handle.get_slice(name)[:, start:end]
    if isinstance(module, (VocabParallelEmbedding, VocabParallelLMHead)):
        shard = module.shard
        lo, hi = min(shard.start, shard.vocab_size), min(shard.start + shard.rows, shard.vocab_size)
        return handle.get_slice(name)[lo:hi]  # padded to `rows` by the caller, after the casts
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.span is None:
        raise ValueError(f"{type(module).__name__} for {name} was not built with `from_dense`: which "
                         "features it holds is unknown")
    return handle.get_tensor(name)


def _check(path: Path, handles: dict[str, Any], shapes: dict[str, torch.Size], tied: tuple[str, ...]) -> None:
    """Refuse a checkpoint that lacks a tensor the model has, holds one it has not, or holds one of
    another shape, naming them (the message `_load_into` gives for the first two)."""
    missing = [k for k in shapes if k not in tied and k not in handles]
    unexpected = [k for k in handles if k not in shapes and not k.endswith(_IGNORED_SUFFIXES)]
    if missing or unexpected:
        raise CheckpointError(f"{path}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}")
    for name, shape in shapes.items():
        if name in tied:
            continue  # a tied tensor in the checkpoint is ignored, as `_load_into` ignores it
        got = tuple(handles[name].get_slice(name).get_shape())
        if got != tuple(shape):
            raise CheckpointError(f"{path}: tensor {name} has shape {list(got)}, its config.json gives "
                                  f"{list(shape)}")


@torch.no_grad()
def load_sharded_target(ref: str, dtype: str, base_dir: Path | None, family: str | None,
                        tp: TPGroup | DPAttentionGroups, device: torch.device) -> LlamaForCausalLM:
    """This rank's share of the dense target checkpoint `ref` (family `family`, None: the one its
    config.json names) in `dtype` on `device`, reading only that share from the checkpoint's files.

    Equal, tensor for tensor, to `load_target(ref, dtype, base_dir, family).to(device)` followed by
    `shard_dense_target(model, tp)`, or under DP attention (`tp` a `DPAttentionGroups`: attention split
    over this rank's DP rank, the rest over the world, world-parallel modules wrapped to gather rows)
    by `shard_dp_attention_target(model, tp)`. A tensor missing from the checkpoint, one the model does
    not have, or one of another shape is a `CheckpointError` naming it; a family that is not dense (or
    heads that do not split over the ranks) a ValueError, as the sharding functions give.
    """
    path = resolve_checkpoint(ref, "target", base_dir)
    family, cfg = target_config(path, family)
    with skeleton():  # the structure and shapes only: no rank allocates the whole model
        model = dense_target(build_target(family, cfg))
    dense_shapes = {name: t.shape for name, t in model.state_dict(keep_vars=True).items()}
    tied = model.tied_weights
    if isinstance(tp, DPAttentionGroups):
        shard_dp_attention_target(model, tp)
    else:
        shard_dense_target(model, tp)

    # Every place each meta tensor is installed (a tied weight is one tensor under two names), so that
    # each is read once, under a name the checkpoint holds, and installed everywhere it was.
    metas: dict[int, torch.Tensor] = {}
    places: dict[int, list[tuple[nn.Module, str, str, bool]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = _checkpoint_prefix(model, module_name)
        owned = [(n, t, True) for n, t in module._parameters.items() if t is not None]
        owned += [(n, t, False) for n, t in module._buffers.items()
                  if t is not None and n not in module._non_persistent_buffers_set]
        for attr, tensor, is_param in owned:
            name = f"{prefix}.{attr}" if prefix else attr
            metas[id(tensor)] = tensor
            places.setdefault(id(tensor), []).append((module, attr, name, is_param))

    with ExitStack() as stack:
        handles = _open_tensors(path, stack)
        _check(path, handles, dense_shapes, tied)
        target_dtype = DTYPES[dtype]
        for key, where in places.items():
            meta = metas[key]
            module, attr, name, is_param = next((w for w in where if w[2] not in tied), where[0])
            part = _read(handles[name], name, module, attr)
            # The casts `load_target` makes (into the built model's dtype, then to the serving dtype),
            # on the CPU as there, so that the values round the same way.
            part = part.to(meta.dtype).to(target_dtype)
            if part.shape != meta.shape:  # only a vocabulary shard's zero rows past the vocabulary
                if not isinstance(module, (VocabParallelEmbedding, VocabParallelLMHead)):
                    raise RuntimeError(f"{name}: read {list(part.shape)} for a shard of {list(meta.shape)}")
                padded = torch.zeros(meta.shape, dtype=target_dtype)
                padded[:part.shape[0]] = part
                part = padded
            part = part.to(device).contiguous()
            filled: torch.Tensor = nn.Parameter(part, requires_grad=meta.requires_grad) if is_param else part
            for owner, owner_attr, _, _ in where:
                (owner._parameters if is_param else owner._buffers)[owner_attr] = filled

    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # a non-persistent buffer: nothing in a checkpoint gives its values
        raise RuntimeError(f"{family} model state not loaded from a checkpoint: {left[:5]}")
    return model.eval()


@torch.no_grad()
def read_embeddings(ref: str, dtype: str, base_dir: Path | None,
                    family: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The target checkpoint's whole input embeddings and LM head (one tensor when tied), in `dtype` on the
    CPU, cast as `load_target` casts them: what a DSpark draft without its own copies shares with its
    target, read on the one rank that runs the draft."""
    path = resolve_checkpoint(ref, "target", base_dir)
    _, cfg = target_config(path, family)
    with ExitStack() as stack:
        handles = _open_tensors(path, stack)
        if isinstance(cfg, Dsv4Geometry):  # whichever of its layouts' names the checkpoint uses
            names = [next((n for n in DSV4_VOCAB_NAMES[which] if n in handles), DSV4_VOCAB_NAMES[which][0])
                     for which in ("embed", "head")]
        else:
            names = ["model.embed_tokens.weight", "model.embed_tokens.weight" if cfg.tie_word_embeddings
                     else "lm_head.weight"]
        missing = [n for n in names if n not in handles]
        if missing:
            raise CheckpointError(f"{path}: missing tensors {missing[:5]}")
        # into the float32 the model is built in, then the serving dtype, as load_target rounds them
        embed, head = (handles[n].get_tensor(n).float().to(DTYPES[dtype]) for n in names)
    return embed, head
