"""The DSpark stages a DeepSeek-V4 checkpoint carries (`dspark.runtime.families.dsv4.dspark_stages`): the
config read from the release's dspark_* keys (and refused where dspark does not implement a value), the mtp.*
tensors in the release's names loaded and refused by name, and a block proposed against a naive reference of
the equations (main_x over the target layers' stream means, each stage's context K=V at the context positions,
window attention with the sinks before the block, the block not causal, hc_head, the shared head, the vanilla
Markov head drafting left to right, the confidence head over [h ; markov_w1[prev]]); a request's block is the
same, bit for bit, alone and in a batch.

The layers' own projections, MoE and hyper-connections are `DSV4Layer`'s, checked against transformers in
tests/test_dsv4_transformers.py; the reference here composes them with the attention and the heads written
out densely."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark.formats.dsv4_config import Dsv4Geometry
from dspark.formats.dsv4_dspark_config import dsv4_dspark_config
from dspark.formats.hf_config import ConfigFieldError
from dspark.runtime.families.dsv4.dspark_stages import Dsv4DSparkStages, load_dsv4_dspark
from dspark.runtime.families.dsv4.model import DSV4Model
from dspark.runtime.families.dsv4.ops import apply_rope
from dspark.runtime.families.dsv4.weights import Dsv4WeightsError

from .dsv4_dspark_common import release_state

TARGET = Dsv4Geometry(vocab_size=96, dim=32, compress_ratios=(0, 4, 8, 4), hca_ratio=8, n_heads=4,
                      head_dim=16, rope_dim=4, q_lora_rank=16, window=6, index_n_heads=2, index_head_dim=8,
                      index_topk=3,
                      inter_dim=24, ffn="moe", n_routed_experts=6, n_activated_experts=2, n_hash_layers=1,
                      route_scale=1.5, swiglu_limit=10.0, hc_mult=2, o_groups=2, o_lora_rank=8)
CONFIG = {"num_hidden_layers": 4, "num_nextn_predict_layers": 2, "compress_ratios": [0, 4, 8, 4, 0, 0],
          "dspark_block_size": 4, "dspark_noise_token_id": 95, "dspark_target_layer_ids": [1, 3],
          "dspark_markov_rank": 8, "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 1}


@pytest.fixture(scope="module")
def pair() -> tuple[DSV4Model, Dsv4DSparkStages, dict[str, torch.Tensor]]:
    target = DSV4Model(TARGET, seed=1)
    stages = Dsv4DSparkStages(dsv4_dspark_config(CONFIG, TARGET), target.embed.detach(), target.head.detach())
    state = release_state(stages, seed=3)
    # the target's tensors beside the stages' are left alone
    load_dsv4_dspark(stages, {**state, "layers.0.attn.wq_a.weight": torch.zeros(1)})
    return target, stages, state


def test_the_config_reads_the_stages_and_refuses_what_it_does_not_implement() -> None:
    cfg = dsv4_dspark_config(CONFIG, TARGET)
    assert (cfg.block_size, cfg.noise_token_id, cfg.target_layer_ids, cfg.markov_rank, cfg.stages) == \
        (4, 95, (1, 3), 8, 2)
    assert cfg.stage.compress_ratios == (0, 0) and cfg.stage.n_hash_layers == 0
    assert (cfg.stage.n_routed_experts, cfg.stage.n_activated_experts) == (4, 1)
    for change, key in (({"compress_ratios": [0, 4, 8, 4, 4, 0]}, "compress_ratios"),
                        ({"dspark_target_layer_ids": [4]}, "dspark_target_layer_ids"),
                        ({"dspark_block_size": 0}, "dspark_block_size"),
                        ({"enable_confidence_head": False}, "enable_confidence_head")):
        with pytest.raises(ConfigFieldError) as info:
            dsv4_dspark_config({**CONFIG, **change}, TARGET)
        assert info.value.key == key


def test_the_release_names_load_and_a_wrong_tensor_is_refused_by_name(pair) -> None:
    _, stages, state = pair
    assert torch.equal(stages.layers[1].ffn.experts.w3[2], state["mtp.1.ffn.experts.2.w3.weight"])
    assert torch.equal(stages.markov_w1, state["mtp.1.markov_head.markov_w1.weight"])
    fresh = Dsv4DSparkStages(stages.cfg, stages.embed, stages.head)
    for edit, message in ((lambda s: s.pop("mtp.0.attn.wkv.weight"), "missing.*layers.0.wkv"),
                          (lambda s: s.__setitem__("mtp.0.hc_head_fn", torch.zeros(2, 64)),
                           "no place.*mtp.0.hc_head"),
                          (lambda s: s.__setitem__("mtp.1.norm.weight", torch.zeros(3)), "norm has shape")):
        broken = dict(state)
        edit(broken)
        with pytest.raises(Dsv4WeightsError, match=message):
            load_dsv4_dspark(fresh, broken)


def naive_block(target: DSV4Model, stages: Dsv4DSparkStages, features: torch.Tensor, anchor: int
                ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    g, cfg = stages.cfg.stage, stages.cfg
    length = features.shape[0]  # the anchor's position: the context is 0 .. length - 1
    main_x = F.linear(features, stages.main_proj)
    main_x = main_x * torch.rsqrt(main_x.square().mean(-1, keepdim=True) + g.norm_eps) * stages.main_norm
    tokens = torch.tensor([anchor] + [cfg.noise_token_id] * (cfg.block_size - 1))
    pos = torch.arange(length, length + cfg.block_size)
    h = target.embed[tokens][:, None, :].repeat(1, g.hc_mult, 1)
    for layer in stages.layers:
        ctx = F.linear(main_x, layer.wkv)
        ctx = ctx * torch.rsqrt(ctx.square().mean(-1, keepdim=True) + g.norm_eps) * layer.kv_norm
        ctx = apply_rope(ctx, torch.arange(length), layer.rope)
        _, q, _, kv, mixes = layer.attn_inputs(h, pos)
        keys = torch.cat([ctx, kv])  # [length + block, D]
        key_pos = torch.cat([torch.arange(length), pos])
        # a block row sees the context within its window and every block row
        seen = (key_pos[None, :] > pos[:, None] - g.window) | (key_pos[None, :] >= length)
        scores = torch.einsum("thd,nd->thn", q, keys) * g.head_dim**-0.5
        scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
        sink = layer.attn_sink[None, :, None].expand(len(pos), -1, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        h = layer.finish_rows(h, torch.einsum("thn,nd->thd", probs, keys), pos, tokens, mixes)
    hidden = stages.hc_head(h)
    normed = hidden * torch.rsqrt(hidden.square().mean(-1, keepdim=True) + g.norm_eps) * stages.norm
    base = F.linear(normed, target.head)
    drafts, logits, prevs, prev = [], [], [], anchor
    for k in range(cfg.block_size):
        prevs.append(prev)
        step = base[k] + stages.markov_w2 @ stages.markov_w1[prev]
        logits.append(step)
        prev = int(step.argmax())
        drafts.append(prev)
    conf = F.linear(torch.cat([hidden, stages.markov_w1[torch.tensor(prevs)]], -1), stages.confidence)[:, 0]
    return drafts, torch.stack(logits), conf


def features_of(target: DSV4Model, stages: Dsv4DSparkStages, tokens: torch.Tensor) -> torch.Tensor:
    """The target's residual after each of the stages' target layers (stream means), concatenated."""
    with torch.no_grad():
        h = target.embed_tokens(tokens)
        kept = []
        state = target.init_state()
        for i, layer in enumerate(target.layers):
            h, _, _ = layer.step(h, state.layers[i], 0, tokens)
            if i in stages.cfg.target_layer_ids:
                kept.append(target.draft_features(h))
    return torch.cat(kept, dim=-1)


def window(context: list[tuple[torch.Tensor, torch.Tensor]], anchor_pos: int, width: int
           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each stage's cached context [T, 1, D] as the engine gathers it for one request: the `width` positions
    before the anchor, those below 0 reading position 0 (masked)."""
    rows = (torch.arange(width) + anchor_pos - width).clamp(min=0)
    return [(k[rows][None], v[rows][None]) for k, v in context]


@pytest.mark.parametrize("length", [3, 11])  # a context shorter than the window, and one past it
def test_a_block_is_the_naive_equations(pair, length: int) -> None:
    target, stages, _ = pair
    gen = torch.Generator().manual_seed(length)
    tokens = torch.randint(0, TARGET.vocab_size, (length + 1,), generator=gen)
    # the target's residual after layers 1 and 3 (0-based ids: 2 and 4 layers run), stream means
    features = features_of(target, stages, tokens[:length])
    context = stages.context_kv(features, torch.arange(length))
    assert all(k is v and k.shape == (length, 1, TARGET.head_dim) for k, v in context)  # K=V, one head
    anchor = tokens[length:]
    got = stages.propose(anchor, torch.tensor([length]), window(context, length, stages.cfg.context_window),
                         torch.tensor([length]))
    drafts, logits, conf = naive_block(target, stages, features, int(anchor))
    assert got.drafts is not None and got.conf_logits is not None
    assert got.drafts[0].tolist() == drafts
    torch.testing.assert_close(got.logits[0], logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.conf_logits[0], conf, rtol=1e-5, atol=1e-5)


def test_a_requests_block_is_the_same_alone_and_in_a_batch(pair) -> None:
    target, stages, _ = pair
    width = stages.cfg.context_window
    lengths = (2, 9, 14)
    alone, windows, anchors = [], [], []
    for n in lengths:
        tokens = torch.randint(0, TARGET.vocab_size, (n + 1,), generator=torch.Generator().manual_seed(n))
        context = stages.context_kv(features_of(target, stages, tokens[:n]), torch.arange(n))
        windows.append(window(context, n, width))
        anchors.append(tokens[n:])
        alone.append(stages.propose(tokens[n:], torch.tensor([n]), windows[-1], torch.tensor([n]), gamma=3))
    batched = [(torch.cat([w[i][0] for w in windows]), torch.cat([w[i][1] for w in windows]))
               for i in range(stages.cfg.stages)]
    pos = torch.tensor(lengths)
    together = stages.propose(torch.cat(anchors), pos, batched, pos, gamma=3)
    for b, one in enumerate(alone):
        assert torch.equal(together.drafts[b], one.drafts[0])
        assert torch.equal(together.logits[b], one.logits[0])
        assert torch.equal(together.conf_logits[b], one.conf_logits[0])
