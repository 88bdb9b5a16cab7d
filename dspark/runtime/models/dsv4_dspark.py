"""The DSpark draft a DeepSeek-V4 checkpoint carries beside its target: the `mtp.{i}` stages.

What the stages compute (facts from vLLM's `DSparkDeepseekV4ForCausalLM` and the release's tensor names;
DeepSpec's DSpark for the block and head conventions):

* **context**: for each committed position, the target's residual after each `dspark_target_layer_ids`
  layer as the mean of its hyper-connection streams (`DSV4Model.draft_features`), concatenated ->
  main_x = RMSNorm(main_proj(.), main_norm) [dim]; each stage layer's context K=V there is its own
  RMSNorm(wkv(main_x), kv_norm) rotated by the position (window-only layers: the context is attended within
  the layer's window);
* **block**: the anchor (the last committed token, at position P) and `block_size - 1` noise tokens at
  P .. P + block_size - 1, embedded by the target's table and copied into the hyper-connection streams, run
  through the `num_nextn_predict_layers` stages, each a DeepSeek-V4 decoder layer (window attention with its
  sinks and grouped output projection, a learned top-k MoE, hyper-connections around both sub-layers) whose
  rows attend to the context within the window before P and to every row of the block (not causal);
* **heads** (on the last stage): `hc_head` collapses the streams into the slot's hidden state h_k; the base
  logits are the target's head over RMSNorm(h_k, norm); a vanilla Markov head adds markov_w2(markov_w1[prev])
  for the token before the slot (the anchor for slot 0, then the drafted token), drafted left to right; the
  confidence logit is proj([h_k ; markov_w1[prev]]) (its sigmoid the acceptance estimate).

Slot k predicts position P + k + 1. The stages are built from `Dsv4Geometry`: the target's sizes with
window-only layers and the draft's own expert counts (`dspark_n_routed_experts`, `dspark_num_experts_per_tok`
where the config has them), no hash routing. Everything is row-invariant as the target is. Read, refused by
key where dspark does not implement a value: `dsv4_dspark_config`. The engine does not draft with these
stages yet: a V4 deployment drafts with a DSpark block draft (docs/dsv4.md "What is missing").
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dspark.formats.dsv4_config import FP8_BLOCK, Dsv4Geometry
from dspark.formats.hf_config import ConfigFieldError
from dspark.runtime.models.dsv4 import DSV4Layer, DSV4Model
from dspark.runtime.models.dsv4_hyper import HyperHead
from dspark.runtime.models.dsv4_ops import rms_norm, row_linear
from dspark.runtime.models.dsv4_quant import Dsv4QuantError, dequantize_state
from dspark.runtime.models.dsv4_weights import (
    EXPERT_KEY,
    RELEASE_LAYER_NAMES,
    Dsv4WeightsError,
    is_draft_stage,
)


@dataclass(frozen=True)
class Dsv4DSparkConfig:
    block_size: int  # slots per block: the anchor and block_size - 1 noise tokens
    noise_token_id: int
    target_layer_ids: tuple[int, ...]  # target layers whose residual (stream mean) the context reads
    markov_rank: int
    stages: int  # num_nextn_predict_layers
    stage: Dsv4Geometry  # the stages' layers: the target's sizes, window-only, the draft's experts


def dsv4_dspark_config(cfg: dict[str, Any], target: Dsv4Geometry) -> Dsv4DSparkConfig:
    """The stages a DeepSeek-V4 config.json describes (`dspark_*` keys, num_nextn_predict_layers), refusing
    what dspark does not implement by key."""
    def int_key(key: str, minimum: int) -> int:
        value = cfg.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigFieldError(key, f"is {value!r}, not an integer >= {minimum}",
                                   "use a DSpark-bearing DeepSeek-V4 config.json")
        return value

    stages = int_key("num_nextn_predict_layers", 1)
    ids = cfg.get("dspark_target_layer_ids")
    if not isinstance(ids, list) or not ids or any(
            not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < target.n_layers for i in ids):
        raise ConfigFieldError("dspark_target_layer_ids", f"is {ids!r}, not target layer ids "
                               f"in 0..{target.n_layers - 1}", "use a DSpark-bearing DeepSeek-V4 config.json")
    ratios = cfg.get("compress_ratios", [])
    stage_ratios = ratios[target.n_layers:] if isinstance(ratios, list) else []
    if len(stage_ratios) not in (0, stages) or any(r != 0 for r in stage_ratios):
        raise ConfigFieldError("compress_ratios", f"gives the draft stages {stage_ratios}; dspark's stages "
                               "are window-only layers (ratio 0)",
                               "use a checkpoint whose stages have ratio 0")
    if cfg.get("enable_confidence_head", True) is not True:
        raise ConfigFieldError("enable_confidence_head", "is not true; the stages' confidence head is read "
                               "with them", "use a checkpoint with the confidence head")
    experts = cfg.get("dspark_n_routed_experts", target.n_routed_experts)
    topk = cfg.get("dspark_num_experts_per_tok", target.n_activated_experts)
    stage = dataclasses.replace(target, compress_ratios=(0,) * stages, n_hash_layers=0,
                                n_routed_experts=experts, n_activated_experts=topk, index_quant=False)
    return Dsv4DSparkConfig(block_size=int_key("dspark_block_size", 1),
                            noise_token_id=int_key("dspark_noise_token_id", 0), target_layer_ids=tuple(ids),
                            markov_rank=int_key("dspark_markov_rank", 1), stages=stages, stage=stage)


class Dsv4DSparkStages(nn.Module):
    """The stages and their heads; the embeddings and the LM head are the target's (`target` below)."""

    def __init__(self, cfg: Dsv4DSparkConfig) -> None:
        super().__init__()
        self.cfg = cfg
        g = cfg.stage
        if not g.hc_mult:
            raise ValueError("DeepSeek-V4's DSpark stages need hyper-connections (hc_mult > 0)")
        self.main_proj = nn.Parameter(torch.empty(g.dim, len(cfg.target_layer_ids) * g.dim))
        self.main_norm = nn.Parameter(torch.empty(g.dim))
        self.layers = nn.ModuleList(DSV4Layer(g, 0, i) for i in range(cfg.stages))
        self.hc_head = HyperHead(g.hc_mult, g.dim, g.hc_eps, g.norm_eps)
        self.norm = nn.Parameter(torch.empty(g.dim))
        self.markov_w1 = nn.Parameter(torch.empty(g.vocab_size, cfg.markov_rank))
        self.markov_w2 = nn.Parameter(torch.empty(g.vocab_size, cfg.markov_rank))
        self.confidence = nn.Parameter(torch.empty(1, g.dim + cfg.markov_rank))

    def main_x(self, features: Tensor) -> Tensor:
        """[T, len(target_layer_ids) * dim] target features -> main_x [T, dim]."""
        return rms_norm(row_linear(features, self.main_proj), self.main_norm, self.cfg.stage.norm_eps)

    def context_kv(self, main_x: Tensor, positions: Tensor) -> list[Tensor]:
        """Each stage's context K=V [T, head_dim] of committed positions [T]."""
        return [layer.project_kv(main_x, positions) for layer in self.layers]

    @torch.no_grad()
    def propose(self, target: DSV4Model, context: list[Tensor], anchor: int, anchor_pos: int,
                gamma: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """One request's block: context K=V per stage [anchor_pos, head_dim] (positions 0 .. anchor_pos - 1),
        the anchor token at anchor_pos -> greedy drafts [gamma], their Markov-corrected logits [gamma, V] and
        confidence logits [gamma]."""
        cfg, g = self.cfg, self.cfg.stage
        gamma = cfg.block_size if gamma is None else gamma
        if not 1 <= gamma <= cfg.block_size:
            raise ValueError(f"gamma {gamma} outside 1..block_size {cfg.block_size}")
        tokens = torch.full((gamma,), cfg.noise_token_id, dtype=torch.long)
        tokens[0] = anchor
        pos = anchor_pos + torch.arange(gamma)
        h = target.embed_tokens(tokens)  # [gamma, hc_mult, dim]: the stages' streams are the target's
        for layer, ctx in zip(self.layers, context, strict=True):
            _, q, _, kv, mixes = layer.attn_inputs(h, pos)
            outs = []
            for i in range(gamma):
                seen = ctx[max(0, anchor_pos + i - g.window + 1):anchor_pos]  # the window before the block
                outs.append(layer.attend_row(q[i], torch.cat([seen, kv])))
            h = layer.finish_rows(h, torch.stack(outs), pos, tokens, mixes)
        hidden = self.hc_head(h)  # [gamma, dim], pre-norm
        base = row_linear(rms_norm(hidden, self.norm, g.norm_eps), target.head)  # [gamma, V]
        drafts, logits = [], []
        prev = anchor
        for k in range(gamma):
            step = base[k] + row_linear(self.markov_w1[prev], self.markov_w2)
            logits.append(step)
            prev = int(step.argmax())
            drafts.append(prev)
        prevs = torch.tensor([anchor, *drafts[:-1]])  # the token before each draft
        conf_in = torch.cat([hidden, self.markov_w1[prevs]], dim=-1)
        confidence = row_linear(conf_in, self.confidence).squeeze(-1)
        return torch.tensor(drafts), torch.stack(logits), confidence


_STAGE = re.compile(r"mtp\.(\d+)\.(.+)")
_HEADS = {"norm.weight": "norm", "hc_head_fn": "hc_head.fn", "hc_head_base": "hc_head.base",
          "hc_head_scale": "hc_head.scale", "markov_head.markov_w1.weight": "markov_w1",
          "markov_head.markov_w2.weight": "markov_w2", "confidence_head.proj.weight": "confidence"}


def load_dsv4_dspark(stages: Dsv4DSparkStages, state: dict[str, Tensor],
                     fp8_block: tuple[int, int] = FP8_BLOCK) -> None:
    """The `mtp.{i}.*` tensors of a checkpoint (dequantised as the target's are) into `stages`; missing,
    extra and misshapen ones refused by name. Tensors outside `mtp.` are the target's and left alone."""
    try:
        mtp = {n: t for n, t in state.items() if is_draft_stage(n)}
        state = dequantize_state(mtp, fp8_block)
    except Dsv4QuantError as exc:
        raise Dsv4WeightsError(str(exc)) from None
    last = stages.cfg.stages - 1
    out: dict[str, Tensor] = {}
    experts: dict[tuple[int, str], dict[int, Tensor]] = {}
    extra = []
    for name, tensor in sorted(state.items()):
        match = _STAGE.fullmatch(name.removeprefix("model."))
        i, rest = (int(match.group(1)), match.group(2)) if match else (-1, "")
        if i == 0 and rest in ("main_proj.weight", "main_norm.weight"):
            out[rest.removesuffix(".weight")] = tensor
        elif i == last and rest in _HEADS:
            out[_HEADS[rest]] = tensor
        elif 0 <= i <= last and rest in RELEASE_LAYER_NAMES:
            out[f"layers.{i}.{RELEASE_LAYER_NAMES[rest]}"] = tensor
        elif 0 <= i <= last and (expert := EXPERT_KEY.fullmatch(rest)) is not None:
            experts.setdefault((i, expert.group(2)), {})[int(expert.group(1))] = tensor
        else:
            extra.append(name)
    for (i, which), by_id in sorted(experts.items()):
        out[f"layers.{i}.ffn.experts.{which}"] = torch.stack([by_id[e] for e in sorted(by_id)])
    expected = stages.state_dict()
    missing = sorted(set(expected) - set(out))
    if extra or missing:
        raise Dsv4WeightsError(f"draft stages: tensors with no place {extra[:5]}, missing (in the stages' "
                               f"names) {missing[:5]}")
    for name, tensor in out.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise Dsv4WeightsError(f"draft stages: {name} has shape {list(tensor.shape)}, the config needs "
                                   f"{list(expected[name].shape)}")
    stages.load_state_dict(out, strict=True)
