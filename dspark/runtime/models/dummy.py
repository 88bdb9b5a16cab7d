"""Dummy weights (`load_format: dummy`, SGLang's and vLLM's `--load-format dummy`): seeded random
weights of a deployment's geometry, built directly on the device in its dtype.

They make a model size runnable where its weights are not: to profile and benchmark, say, a Llama-3.1-8B
geometry on a GPU with no checkpoint. What such a model generates is meaningless, and a draft with
random weights is almost never accepted, so the commands that decode with them say so loudly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dspark.checkpoints.dspark_block_config import BlockDraftConfig
from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.runtime.config import DraftRef, ModelGeometry
from dspark.runtime.families.dsv4.target import Dsv4ForCausalLM
from dspark.runtime.models.dspark_block_draft import DSparkBlockDraft
from dspark.runtime.models.families import ServingTarget, build_target

TARGET_SEED = 0
DRAFT_SEED = 1
INIT_STD = 0.02  # the usual initialiser scale of a Llama or Qwen3 model


@contextmanager
def _built_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Create parameters on `device` in `dtype` from the start: an 8B model in float32 on the host
    first would need 32 GB of host memory and a copy it does not need."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def _initialise(module: torch.nn.Module, seed: int, device: torch.device) -> None:
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in module.named_parameters():
        if param.dim() >= 2:
            param.normal_(0.0, INIT_STD, generator=generator)
        elif "norm" in name:
            param.fill_(1.0)  # RMSNorm scales: 1 keeps activations in range layer after layer
        else:
            param.zero_()  # biases


def dummy_target(geometry: ModelGeometry | Dsv4Geometry, dtype: torch.dtype, device: torch.device,
                 family: str = "llama") -> ServingTarget:
    with _built_on(device, dtype):
        model = build_target(family, geometry)  # the deployment's geometry is the model's config
    if isinstance(model, Dsv4ForCausalLM):
        # Its sinks and compressor gates need O(1) values for the window, entries and top-k to matter.
        model.init_dummy_(TARGET_SEED)
    else:
        _initialise(model, TARGET_SEED, device)
    return model.eval()


def draft_config(geometry: ModelGeometry | Dsv4Geometry, draft: DraftRef) -> BlockDraftConfig:
    """The architecture a deployment's draft has: the settings compiled into `draft` over the target's
    sizes (hidden size, heads, MLP width, vocabulary, RMSNorm epsilon, RoPE theta), as the released
    DSpark drafts copy their target's config."""
    return BlockDraftConfig.for_target(
        geometry, num_layers=draft.num_layers, block_size=draft.block_size, mask_token_id=draft.mask_token_id,
        target_layer_ids=tuple(draft.target_layer_ids), markov_rank=draft.markov_rank,
        markov_head_type=draft.markov_head_type, confidence_head=draft.confidence_head,
        confidence_with_markov=draft.confidence_with_markov)


def dummy_draft(geometry: ModelGeometry | Dsv4Geometry, draft: DraftRef, dtype: torch.dtype,
                device: torch.device) -> DSparkBlockDraft:
    with _built_on(device, dtype):
        model = DSparkBlockDraft(draft_config(geometry, draft))
    _initialise(model, DRAFT_SEED, device)
    return model.eval()
