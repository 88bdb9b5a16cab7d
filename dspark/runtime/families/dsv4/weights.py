"""A DeepSeek-V4 checkpoint's tensors in `DSV4Model`'s names: transformers' module names
(`model.layers.N.self_attn.q_a_proj.weight`, packed `mlp.experts.gate_up_proj`), the release's
(`layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight`, `hc_head_fn`), or what transformers'
`save_pretrained` writes (the release's names under `model.`).

Every tensor the model needs must be found and every tensor found must be used: a missing, extra or
misshapen tensor is refused by name (`Dsv4WeightsError`). The release's draft stages (`mtp.*`) are not the
target's and are left to the draft's reader. Quantised tensors (FP8, FP4 experts, Ascend W8A8) are read by
their dequantisation rule (`quant`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from dspark.formats.dsv4_config import FP8_BLOCK, Dsv4Geometry
from dspark.runtime.families.dsv4.fp8_linear import Fp8BlockWeight
from dspark.runtime.families.dsv4.model import DSV4Model
from dspark.runtime.families.dsv4.quant import Dsv4QuantError, dequantize_state, split_fp8, split_w8a8
from dspark.runtime.families.dsv4.w8a8 import W8A8Weight


class Dsv4WeightsError(ValueError):
    """A checkpoint whose tensors do not make the configured model (the message names them)."""


# transformers' names inside a layer -> DSV4Layer's
_HF_LAYER = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_a_proj.weight": "wq_a",
    "self_attn.q_a_norm.weight": "q_norm",
    "self_attn.q_b_proj.weight": "wq_b",
    "self_attn.kv_proj.weight": "wkv",
    "self_attn.kv_norm.weight": "kv_norm",
    "self_attn.sinks": "attn_sink",
    "self_attn.o_proj.weight": "wo",
    "self_attn.o_a_proj.weight": "wo_a",
    "self_attn.o_b_proj.weight": "wo_b",
    "self_attn.compressor.kv_proj.weight": "compressor.wkv",
    "self_attn.compressor.gate_proj.weight": "compressor.wgate",
    "self_attn.compressor.position_bias": "compressor.ape",
    "self_attn.compressor.kv_norm.weight": "compressor.norm",
    "self_attn.compressor.indexer.kv_proj.weight": "indexer.compressor.wkv",
    "self_attn.compressor.indexer.gate_proj.weight": "indexer.compressor.wgate",
    "self_attn.compressor.indexer.position_bias": "indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "indexer.compressor.norm",
    "self_attn.compressor.indexer.q_b_proj.weight": "indexer.wq_b",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "indexer.weights_proj",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.experts.down_proj": "ffn.experts.w2",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2",
    "mlp.gate_proj.weight": "w1",
    "mlp.up_proj.weight": "w3",
    "mlp.down_proj.weight": "w2",
    "attn_hc.fn": "hc_attn.fn",
    "attn_hc.base": "hc_attn.base",
    "attn_hc.scale": "hc_attn.scale",
    "ffn_hc.fn": "hc_ffn.fn",
    "ffn_hc.base": "hc_ffn.base",
    "ffn_hc.scale": "hc_ffn.scale",
}
_HF_TOP = {
    "embed_tokens.weight": "embed",
    "norm.weight": "final_norm",
    "lm_head.weight": "head",
    "hc_head.hc_fn": "hc_head.fn",
    "hc_head.hc_base": "hc_head.base",
    "hc_head.hc_scale": "hc_head.scale",
}

# the release's names inside a layer -> DSV4Layer's (experts.E.* are stacked separately); the draft
# stages' layers (mtp.{i}.*) use them too
RELEASE_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm",
    "ffn_norm.weight": "ffn_norm",
    "attn.wq_a.weight": "wq_a",
    "attn.q_norm.weight": "q_norm",
    "attn.wq_b.weight": "wq_b",
    "attn.wkv.weight": "wkv",
    "attn.kv_norm.weight": "kv_norm",
    "attn.norm.weight": "kv_norm",  # as transformers' save_pretrained writes the release's attn.kv_norm
    "attn.attn_sink": "attn_sink",
    "attn.wo.weight": "wo",
    "attn.wo_a.weight": "wo_a",
    "attn.wo_b.weight": "wo_b",
    "attn.compressor.wkv.weight": "compressor.wkv",
    "attn.compressor.wgate.weight": "compressor.wgate",
    "attn.compressor.ape": "compressor.ape",
    "attn.compressor.norm.weight": "compressor.norm",
    "attn.indexer.wq_b.weight": "indexer.wq_b",
    "attn.indexer.weights_proj.weight": "indexer.weights_proj",
    "attn.indexer.compressor.wkv.weight": "indexer.compressor.wkv",
    "attn.indexer.compressor.wgate.weight": "indexer.compressor.wgate",
    "attn.indexer.compressor.ape": "indexer.compressor.ape",
    "attn.indexer.compressor.norm.weight": "indexer.compressor.norm",
    "ffn.gate.weight": "ffn.gate.weight",
    "ffn.gate.bias": "ffn.gate.bias",
    "ffn.gate.tid2eid": "ffn.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "ffn.shared_experts.w1",
    "ffn.shared_experts.w3.weight": "ffn.shared_experts.w3",
    "ffn.shared_experts.w2.weight": "ffn.shared_experts.w2",
    "ffn.w1.weight": "w1",
    "ffn.w3.weight": "w3",
    "ffn.w2.weight": "w2",
    "hc_attn_fn": "hc_attn.fn",
    "hc_attn_base": "hc_attn.base",
    "hc_attn_scale": "hc_attn.scale",
    "hc_ffn_fn": "hc_ffn.fn",
    "hc_ffn_base": "hc_ffn.base",
    "hc_ffn_scale": "hc_ffn.scale",
}
_RELEASE_TOP = {
    "embed.weight": "embed",
    "norm.weight": "final_norm",
    "head.weight": "head",
    "hc_head_fn": "hc_head.fn",
    "hc_head_base": "hc_head.base",
    "hc_head_scale": "hc_head.scale",
}
_TOP = {**_HF_TOP, **_RELEASE_TOP}
# the names the whole embedding and LM head have in each layout (the release's first)
DSV4_VOCAB_NAMES = {ours: tuple(prefix + name for name, to in (*_RELEASE_TOP.items(), *_HF_TOP.items())
                                for prefix in ("", "model.") if to == ours)
                    for ours in ("embed", "head")}
_LAYER = {**_HF_LAYER, **RELEASE_LAYER_NAMES}
_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
EXPERT_KEY = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")  # one expert's matrix, by the release


def is_draft_stage(name: str) -> bool:
    """A tensor of the DSpark stages a checkpoint carries beside its target (`mtp.{i}.*`):
    `dspark_stages`'s."""
    return name.removeprefix("model.").startswith("mtp.")


def dsv4_state_dict(state: dict[str, Tensor], cfg: Dsv4Geometry) -> dict[str, Tensor]:
    """The checkpoint's tensors -> `DSV4Model(cfg).state_dict()`'s names. Read: the release's names,
    transformers' module names (`model.layers.N.self_attn...`, packed experts), and what transformers'
    `save_pretrained` writes (the release's names under `model.`, `head.weight`), dequantised
    (`dequantize_state`); refuses tensors with no place, by name."""
    out: dict[str, Tensor] = {}
    experts: dict[tuple[int, str], dict[int, Tensor]] = {}
    extra = []
    for name in sorted(state):
        if is_draft_stage(name):
            continue  # the draft stages are the draft reader's
        tensor = state[name]
        key = name.removeprefix("model.")
        if key in _TOP:
            out[_TOP[key]] = tensor
            continue
        match = _LAYER_KEY.fullmatch(key)
        if match is None:
            extra.append(name)
            continue
        layer, rest = int(match.group(1)), match.group(2)
        if rest in _LAYER:
            out[f"layers.{layer}.{_LAYER[rest]}"] = tensor
        elif rest == "mlp.experts.gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)  # [E, 2 * inter, dim]: the gate's rows, then up's
            out[f"layers.{layer}.ffn.experts.w1"], out[f"layers.{layer}.ffn.experts.w3"] = gate, up
        elif (expert := EXPERT_KEY.fullmatch(rest)) is not None:
            experts.setdefault((layer, expert.group(2)), {})[int(expert.group(1))] = tensor
        else:
            extra.append(name)
    for (layer, which), by_id in sorted(experts.items()):
        if sorted(by_id) != list(range(cfg.n_routed_experts)):
            have = sorted(by_id)
            raise Dsv4WeightsError(f"layer {layer}: experts {have[:3]}...{have[-3:]} of "
                                   f"ffn.experts.E.{which}, expected 0..{cfg.n_routed_experts - 1}")
        out[f"layers.{layer}.ffn.experts.{which}"] = torch.stack([by_id[e] for e in range(len(by_id))])
    if extra:
        raise Dsv4WeightsError(f"tensors this DeepSeek-V4 configuration has no place for: "
                               f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''} (check the "
                               "config.json beside them)")
    return out


def load_dsv4_weights(model: DSV4Model, state: dict[str, Tensor], fp8_block: Sequence[int] = FP8_BLOCK,
                      keep_w8a8: bool = False, keep_fp8: bool = False) -> None:
    """Copy a checkpoint's tensors (any layout; quantised ones dequantised, FP8 in `fp8_block` blocks) into
    `model`, refusing a missing, extra or misshapen one by name; hash-routing tables must name
    n_activated_experts distinct experts per token. On a backend with the kernels a format stays quantised,
    in place of the parameters it quantises: `keep_w8a8` (Ascend) W8A8_DYNAMIC weights as `W8A8Weight`s,
    `keep_fp8` (CUDA) FP8 block-scaled ones as `Fp8BlockWeight`s."""
    block = (int(fp8_block[0]), int(fp8_block[1]))
    try:
        state = {n: t for n, t in state.items() if not is_draft_stage(n)}
        codes, scales, state = split_w8a8(state) if keep_w8a8 else ({}, {}, state)
        fp8_codes, fp8_scales, state = split_fp8(state, block) if keep_fp8 else ({}, {}, state)
        codes.update(fp8_codes)
        state = dequantize_state(state, fp8_block)
    except Dsv4QuantError as exc:
        raise Dsv4WeightsError(str(exc)) from None
    mapped = dsv4_state_dict({**state, **codes}, model.cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(mapped))
    if missing:
        raise Dsv4WeightsError(f"missing tensors (in DSV4Model's names): {', '.join(missing[:5])}"
                               f"{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(set(mapped) - set(expected))
    if unexpected:
        raise Dsv4WeightsError(f"tensors this configuration has no place for (in DSV4Model's names): "
                               f"{', '.join(unexpected[:5])}")
    for name, tensor in mapped.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise Dsv4WeightsError(f"{name}: shape {list(tensor.shape)}, the configuration needs "
                                   f"{list(expected[name].shape)}")
        if name.endswith("tid2eid"):
            ids = tensor.long()
            if ids.min() < 0 or ids.max() >= model.cfg.n_routed_experts or (
                    ids.sort(-1).values.diff(dim=-1) == 0).any():
                raise Dsv4WeightsError(f"{name}: every token must name distinct experts in "
                                       f"0..{model.cfg.n_routed_experts - 1}")
    kept: dict[str, nn.Module] = {name: W8A8Weight(mapped.pop(name), scale)
                                  for name, scale in dsv4_state_dict(scales, model.cfg).items()}
    kept.update({name: Fp8BlockWeight(mapped.pop(name), scale, block)
                 for name, scale in dsv4_state_dict(fp8_scales, model.cfg).items()})
    for name, weight in kept.items():  # by the model's names
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        delattr(module, leaf)  # the parameter it replaces
        setattr(module, leaf, weight)
    model.load_state_dict(mapped, strict=not kept)  # copy_ casts to each parameter's dtype
