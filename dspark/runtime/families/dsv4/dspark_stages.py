"""The DSpark draft a DeepSeek-V4 checkpoint carries beside its target: the `mtp.{i}` stages, served by the
engine as a deployment's draft (`draft.checkpoint` naming the target's own checkpoint).

What the stages compute (facts from vLLM's `DSparkDeepseekV4ForCausalLM` and the release's tensor names;
DeepSpec's DSpark for the block and head conventions):

* **context**: for each committed position, the target's residual after each `dspark_target_layer_ids`
  layer as the mean of its hyper-connection streams (`DSV4Model.draft_features`), concatenated ->
  main_x = RMSNorm(main_proj(.), main_norm) [dim]; each stage layer's context K=V there is its own
  RMSNorm(wkv(main_x), kv_norm) rotated by the position, cached once per committed position like a target's
  KV (one latent head whose keys are its values: the engine's draft cache stores it once);
* **block**: the anchor (the last committed token, at position P) and `block_size - 1` noise tokens at
  P .. P + block_size - 1, embedded by the target's table and copied into the hyper-connection streams, run
  through the `num_nextn_predict_layers` stages, each a DeepSeek-V4 decoder layer (window attention with its
  sinks and grouped output projection, a learned top-k MoE, hyper-connections around both sub-layers) whose
  rows attend to the context within the window before their own position (`window - 1` context entries at
  most, so a step reads only those) and to every row of the block (not causal);
* **heads** (on the last stage): `hc_head` collapses the streams into the slot's hidden state h_k; the base
  logits are the target's head over RMSNorm(h_k, norm); a vanilla Markov head adds markov_w2(markov_w1[prev])
  for the token before the slot (the anchor for slot 0, then the drafted token), drafted left to right; the
  confidence logit is proj([h_k ; markov_w1[prev]]) (its sigmoid the acceptance estimate).

Slot k predicts position P + k + 1. The stages are built from `Dsv4Geometry`: the target's sizes with
window-only layers and the draft's own expert counts, no hash routing (`dsv4_dspark_config`, torch-free, which
the compiler reads too). Every product is row-invariant as the target's are, and a block's attention runs over
a fixed width (the window and the block, masked), so a request's drafts do not depend on the batch it is in.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor, nn

from dspark.formats.dsv4_config import FP8_BLOCK, Dsv4Geometry
from dspark.formats.dsv4_dspark_config import Dsv4DSparkConfig, dsv4_dspark_config
from dspark.runtime.config import DraftRef
from dspark.runtime.families.dsv4.hyper import HyperHead
from dspark.runtime.families.dsv4.model import DSV4Layer, draw_weights_
from dspark.runtime.families.dsv4.ops import rms_norm, row_linear, row_softmax
from dspark.runtime.families.dsv4.quant import Dsv4QuantError, dequantize_state
from dspark.runtime.families.dsv4.weights import (
    EXPERT_KEY,
    RELEASE_LAYER_NAMES,
    Dsv4WeightsError,
    is_draft_stage,
)
from dspark.runtime.models.dspark_block_draft import BlockProposal, TokenPicker

# Elements one chunk of the block attention's score product may hold (a chunk is a few requests): the
# product is elementwise then summed, for row invariance, so it is bounded rather than materialised whole.
_ATTENTION_CHUNK_ELEMENTS = 1 << 25


def stage_draft_config(target: Dsv4Geometry, draft: DraftRef) -> Dsv4DSparkConfig:
    """The stages a compiled draft section describes over its target (the target's expert counts): what a
    checkpoint's stages must match, and what a dummy draft builds."""
    return dsv4_dspark_config({"num_nextn_predict_layers": draft.num_layers,
                               "dspark_block_size": draft.block_size,
                               "dspark_noise_token_id": draft.mask_token_id,
                               "dspark_target_layer_ids": list(draft.target_layer_ids),
                               "dspark_markov_rank": draft.markov_rank}, target)


class Dsv4DSparkStages(nn.Module):
    """The stages and their heads over the target's embeddings and LM head (`embed` [V, dim], `head` [V, dim]:
    the target's whole tables, shared, not copies). The engine's draft: `context_kv` fills its cache,
    `propose` drafts a batch of blocks."""

    def __init__(self, cfg: Dsv4DSparkConfig, embed: Tensor, head: Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        g = cfg.stage
        if not g.hc_mult:
            raise ValueError("DeepSeek-V4's DSpark stages need hyper-connections (hc_mult > 0)")
        if tuple(embed.shape) != (g.vocab_size, g.dim) or tuple(head.shape) != (g.vocab_size, g.dim):
            raise ValueError(f"the target's embeddings {list(embed.shape)} and head {list(head.shape)} are "
                             f"not [{g.vocab_size}, {g.dim}] (the whole tables, not a tensor-parallel share)")
        self.embed, self.head = embed, head  # the target's, not this module's parameters
        self.main_proj = nn.Parameter(torch.empty(g.dim, len(cfg.target_layer_ids) * g.dim))
        self.main_norm = nn.Parameter(torch.empty(g.dim))
        self.layers = nn.ModuleList(DSV4Layer(g, 0, i) for i in range(cfg.stages))
        self.hc_head = HyperHead(g.hc_mult, g.dim, g.hc_eps, g.norm_eps)
        self.norm = nn.Parameter(torch.empty(g.dim))
        self.markov_w1 = nn.Parameter(torch.empty(g.vocab_size, cfg.markov_rank))
        self.markov_w2 = nn.Parameter(torch.empty(g.vocab_size, cfg.markov_rank))
        self.confidence = nn.Parameter(torch.empty(1, g.dim + cfg.markov_rank))

    @torch.no_grad()
    def init_random_(self, seed: int) -> None:
        """Dummy weights (`load_format: dummy`), drawn as the target's are."""
        draw_weights_(self, torch.Generator().manual_seed(seed))

    def resolve_gamma(self, gamma: int | None) -> int:
        g = self.cfg.block_size if gamma is None else gamma
        if not 1 <= g <= self.cfg.block_size:
            raise ValueError(f"gamma {g} outside 1..block_size {self.cfg.block_size} of this draft")
        return g

    @torch.no_grad()
    def context_kv(self, features: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """The target's features of committed positions [T, len(target_layer_ids) * dim] at positions [T] ->
        each stage's context (K, V) [T, 1, head_dim]: one latent head whose keys are its values."""
        g = self.cfg.stage
        main_x = rms_norm(row_linear(features.to(self.main_proj.dtype), self.main_proj), self.main_norm,
                          g.norm_eps)
        out = []
        for layer in self.layers:
            kv = layer.project_kv(main_x, positions).unsqueeze(1)
            out.append((kv, kv))
        return out

    @torch.no_grad()
    def propose(self, anchor_ids: Tensor, anchor_pos: Tensor, ctx_kv: list[tuple[Tensor, Tensor]],
                ctx_lens: Tensor, pick: TokenPicker | None = None, gamma: int | None = None,
                keep_conf_inputs: bool = False) -> BlockProposal:
        """One draft step for B requests: anchors [B] at positions anchor_pos [B]; `ctx_kv` per stage (K, V)
        [B, context_window, 1, head_dim], request b's entries at positions anchor_pos[b] - context_window ..
        anchor_pos[b] - 1 (`dspark.runtime.engine.forward.EngineModels.draft_context`; those below position 0,
        or at ctx_lens[b] and past, are not read). `pick` draws each slot's token from its [B, V] logits
        (greedy argmax without it)."""
        cfg, g = self.cfg, self.cfg.stage
        gamma = self.resolve_gamma(gamma)
        num_reqs, dev = anchor_ids.shape[0], anchor_ids.device
        tokens = torch.full((num_reqs, gamma), cfg.noise_token_id, dtype=torch.long, device=dev)
        tokens[:, 0] = anchor_ids
        pos = anchor_pos[:, None] + torch.arange(gamma, device=dev)  # [B, gamma]
        width = cfg.context_window
        ctx_pos = anchor_pos[:, None] - width + torch.arange(width, device=dev)  # [B, W]
        # a block row at p sees the context entries at p - window + 1 .. P - 1, and the whole block
        sees_ctx = ((ctx_pos[:, None, :] > pos[:, :, None] - g.window) & (ctx_pos[:, None, :] >= 0)
                    & (ctx_pos[:, None, :] < ctx_lens[:, None, None]))  # [B, gamma, W]
        visible = torch.cat([sees_ctx, sees_ctx.new_ones(num_reqs, gamma, gamma)], dim=-1)
        flat_tokens, flat_pos = tokens.reshape(-1), pos.reshape(-1)
        # the target's embeddings, copied into the streams
        h = self.embed[flat_tokens].unsqueeze(1).expand(-1, g.hc_mult, -1).contiguous()
        for layer, (ctx, _) in zip(self.layers, ctx_kv, strict=True):
            _, q, _, kv, mixes = layer.attn_inputs(h, flat_pos)
            keys = torch.cat([ctx[:, :, 0].to(kv.dtype), kv.view(num_reqs, gamma, -1)], dim=1)  # [B, W+g, D]
            o = self._attend(layer, q.view(num_reqs, gamma, g.n_heads, g.head_dim), keys, visible)
            h = layer.finish_rows(h, o.flatten(0, 1), flat_pos, flat_tokens, mixes)
        hidden = self.hc_head(h)  # [B * gamma, dim], before the final norm
        base = row_linear(rms_norm(hidden, self.norm, g.norm_eps), self.head).view(num_reqs, gamma, -1)
        hidden = hidden.view(num_reqs, gamma, -1)
        prev, prevs, logits, drafts = anchor_ids, [], [], []
        for k in range(gamma):
            prevs.append(prev)
            step = base[:, k] + row_linear(self.markov_w1[prev], self.markov_w2)  # [B, V]
            logits.append(step)
            prev = step.argmax(-1) if pick is None else pick(step)
            drafts.append(prev)
        conf_in = torch.cat([hidden, self.markov_w1[torch.stack(prevs, dim=1)]], dim=-1)
        confidence = row_linear(conf_in, self.confidence).squeeze(-1).float()  # [B, gamma]
        return BlockProposal(drafts=torch.stack(drafts, dim=1), conf_logits=confidence,
                             logits=torch.stack(logits, dim=1), hidden=hidden,
                             conf_inputs=conf_in if keep_conf_inputs else None)

    @staticmethod
    def _attend(layer: DSV4Layer, q: Tensor, keys: Tensor, visible: Tensor) -> Tensor:
        """q [B, gamma, H, D] over each request's keys [B, n, D] (also the values) where `visible`
        [B, gamma, n], with the layer's sinks -> [B, gamma, H, D]; a few requests at a time."""
        num_reqs, gamma, heads, dim = q.shape
        per_request = gamma * heads * keys.shape[1] * dim
        step = max(1, _ATTENTION_CHUNK_ELEMENTS // per_request)
        scale, sink = dim ** -0.5, layer.attn_sink
        out = []
        for b in range(0, num_reqs, step):
            qs, ks, seen = q[b:b + step], keys[b:b + step], visible[b:b + step]
            scores = (qs.unsqueeze(3) * ks[:, None, None]).sum(-1) * scale  # [b, gamma, H, n]
            scores = scores.masked_fill(~seen[:, :, None, :], float("-inf"))
            sinks = sink.view(1, 1, heads, 1).expand(*scores.shape[:3], 1)
            probs = row_softmax(torch.cat([scores, sinks], dim=-1))[..., :-1]
            out.append((probs.unsqueeze(-1) * ks[:, None, None]).sum(-2))
        return torch.cat(out)


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
