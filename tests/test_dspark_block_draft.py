"""The published DSpark draft (`dspark/runtime/models/dspark_block_*.py`) against a reference.

A small random checkpoint is written here in the released layout (the tensor names and the
`config.json` fields DeepSpec writes), loaded through the module's loader, and its proposals,
draft logits and confidences are compared with `reference_step`: the published equations written
out with plain loops over positions and heads, in float64, sharing no code with the module.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dspark.runtime.models.dspark_block_loader import load_block_draft

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 32, 48, 2, 4, 2, 8
BLOCK, MASK_ID, RANK, THETA, EPS = 4, 60, 6, 10000.0, 1e-6
LAYER_IDS, TARGET_LAYERS = [-1, 1, 2], 4
WIDTH = len(LAYER_IDS) * HIDDEN


def released_config(kind: str | None = "vanilla", confidence: bool = True, with_markov: bool = True,
                    rank: int = RANK) -> dict:
    """A config.json with the fields (and only the fields) DeepSpec's Qwen3 draft config carries."""
    cfg = {
        "architectures": ["Qwen3DSparkModel"], "attention_bias": False, "attention_dropout": 0.0,
        "block_size": BLOCK, "bos_token_id": 1, "dtype": "float32", "enable_confidence_head": confidence,
        "eos_token_id": 2, "head_dim": HEAD_DIM, "hidden_act": "silu", "hidden_size": HIDDEN,
        "initializer_range": 0.02, "intermediate_size": INTER, "layer_types": ["full_attention"] * LAYERS,
        "markov_rank": rank, "mask_token_id": MASK_ID, "max_position_embeddings": 256,
        "max_window_layers": LAYERS, "model_type": "qwen3", "num_anchors": 16,
        "num_attention_heads": HEADS, "num_hidden_layers": LAYERS, "num_key_value_heads": KV_HEADS,
        "num_target_layers": TARGET_LAYERS, "pad_token_id": None, "rms_norm_eps": EPS,
        "rope_parameters": {"rope_theta": THETA, "rope_type": "default"}, "sliding_window": None,
        "target_layer_ids": LAYER_IDS, "tie_word_embeddings": False, "transformers_version": "5.10.2",
        "use_cache": True, "use_sliding_window": False, "vocab_size": VOCAB,
    }
    if rank > 0:
        cfg["markov_head_type"] = kind
    if confidence:
        cfg["confidence_head_with_markov"] = with_markov
    return cfg


def released_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the released names. Norm weights are drawn around 1 and every bias is
    non-zero, so a norm or bias the module skipped would show."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm(n: int) -> torch.Tensor:
        return 1.0 + w(n, scale=0.2)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    t = {"embed_tokens.weight": w(VOCAB, HIDDEN, scale=1.0), "lm_head.weight": w(VOCAB, HIDDEN),
         "norm.weight": norm(HIDDEN), "fc.weight": w(HIDDEN, WIDTH), "hidden_norm.weight": norm(HIDDEN)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        t |= {p + "input_layernorm.weight": norm(HIDDEN), p + "post_attention_layernorm.weight": norm(HIDDEN),
              p + "self_attn.q_proj.weight": w(q, HIDDEN), p + "self_attn.k_proj.weight": w(kv, HIDDEN),
              p + "self_attn.v_proj.weight": w(kv, HIDDEN), p + "self_attn.o_proj.weight": w(HIDDEN, q),
              p + "self_attn.q_norm.weight": norm(HEAD_DIM), p + "self_attn.k_norm.weight": norm(HEAD_DIM),
              p + "mlp.gate_proj.weight": w(INTER, HIDDEN), p + "mlp.up_proj.weight": w(INTER, HIDDEN),
              p + "mlp.down_proj.weight": w(HIDDEN, INTER)}
    rank, kind = cfg["markov_rank"], cfg.get("markov_head_type")
    if rank:
        t |= {"markov_head.markov_w1.weight": w(VOCAB, rank, scale=1.0),
              "markov_head.markov_w2.weight": w(VOCAB, rank, scale=1.0)}
        if kind == "gated":
            t |= {"markov_head.gate_proj.weight": w(rank, HIDDEN + rank),
                  "markov_head.gate_proj.bias": w(rank)}
        if kind == "rnn":
            t |= {"markov_head.joint_proj.weight": w(3 * rank, 2 * rank + HIDDEN),
                  "markov_head.joint_proj.bias": w(3 * rank)}
    if cfg["enable_confidence_head"]:
        width = HIDDEN + (rank if cfg["confidence_head_with_markov"] else 0)
        t |= {"confidence_head.proj.weight": w(1, width), "confidence_head.proj.bias": w(1)}
    return t


def write_checkpoint(path: Path, cfg: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


# -- the reference: the published equations, one vector at a time ------------------------------

def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / math.sqrt(float((x * x).mean()) + EPS) * weight


def rope(x: torch.Tensor, pos: int) -> torch.Tensor:
    """Rotate-half RoPE of one head vector: pairs (i, i + D/2) turn by pos * theta^(-2i/D)."""
    half = HEAD_DIM // 2
    out = x.clone()
    for i in range(half):
        angle = pos * THETA ** (-2.0 * i / HEAD_DIM)
        c, s = math.cos(angle), math.sin(angle)
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


def head_rows(w: torch.Tensor, h: int) -> torch.Tensor:
    return w[h * HEAD_DIM:(h + 1) * HEAD_DIM]


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def reference_step(t: dict[str, torch.Tensor], cfg: dict, feats: torch.Tensor, anchor: int, gamma: int,
                   pick) -> tuple[list[int], list[torch.Tensor], list[float] | None]:
    """One draft step of one request: context features `feats[C, WIDTH]` at positions 0..C-1, the
    anchor token at position C. Returns the drafted tokens, each slot's corrected logits and each
    slot's confidence logit."""
    t = {k: v.double() for k, v in t.items()}
    ctx_len, per_kv = feats.shape[0], HEADS // KV_HEADS
    c = [rms(t["fc.weight"] @ feats[j].double(), t["hidden_norm.weight"]) for j in range(ctx_len)]
    ids = [anchor] + [MASK_ID] * (gamma - 1)
    x = [t["embed_tokens.weight"][i].clone() for i in ids]
    for layer in range(LAYERS):
        p = f"layers.{layer}."
        wq, wk, wv = (t[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        qn, kn = t[p + "self_attn.q_norm.weight"], t[p + "self_attn.k_norm.weight"]

        def key(v: torch.Tensor, hk: int, pos: int) -> torch.Tensor:
            return rope(rms(head_rows(wk, hk) @ v, kn), pos)  # noqa: B023 (used within this layer)

        # Context keys/values come from the projected target features, without the input norm.
        keys = [[key(c[j], hk, j) for j in range(ctx_len)] for hk in range(KV_HEADS)]
        vals = [[head_rows(wv, hk) @ c[j] for j in range(ctx_len)] for hk in range(KV_HEADS)]
        normed = [rms(xi, t[p + "input_layernorm.weight"]) for xi in x]
        for hk in range(KV_HEADS):
            keys[hk] += [key(normed[i], hk, ctx_len + i) for i in range(gamma)]
            vals[hk] += [head_rows(wv, hk) @ normed[i] for i in range(gamma)]
        new_x = []
        for i in range(gamma):
            heads = []
            for h in range(HEADS):
                q = rope(rms(head_rows(wq, h) @ normed[i], qn), ctx_len + i)
                hk = h // per_kv
                scores = torch.stack([q.dot(k) / math.sqrt(HEAD_DIM) for k in keys[hk]])
                probs = torch.exp(scores - scores.max())
                probs = probs / probs.sum()
                heads.append(sum(pr * v for pr, v in zip(probs, vals[hk], strict=True)))
            xi = x[i] + t[p + "self_attn.o_proj.weight"] @ torch.cat(heads)
            m = rms(xi, t[p + "post_attention_layernorm.weight"])
            mlp = silu(t[p + "mlp.gate_proj.weight"] @ m) * (t[p + "mlp.up_proj.weight"] @ m)
            new_x.append(xi + t[p + "mlp.down_proj.weight"] @ mlp)
        x = new_x
    hidden = [rms(xi, t["norm.weight"]) for xi in x]

    rank, kind = cfg["markov_rank"], cfg.get("markov_head_type")
    tokens, logits, prevs = [], [], []
    prev, state = anchor, torch.zeros(rank, dtype=torch.float64)
    for k in range(gamma):
        prevs.append(prev)
        step = t["lm_head.weight"] @ hidden[k]
        if rank:
            e = t["markov_head.markov_w1.weight"][prev]
            w2 = t["markov_head.markov_w2.weight"]
            if kind == "vanilla":
                step = step + w2 @ e
            elif kind == "gated":
                gate = sigmoid(t["markov_head.gate_proj.weight"] @ torch.cat((hidden[k], e))
                               + t["markov_head.gate_proj.bias"])
                step = step + w2 @ (gate * e)
            else:
                z = t["markov_head.joint_proj.weight"] @ torch.cat((state, e, hidden[k])) \
                    + t["markov_head.joint_proj.bias"]
                g, cand, out = z[:rank], z[rank:2 * rank], z[2 * rank:]
                state = sigmoid(g) * state + (1 - sigmoid(g)) * torch.tanh(cand)
                step = step + w2 @ torch.tanh(out)
        logits.append(step)
        prev = int(pick(step[None])[0])
        tokens.append(prev)
    conf = None
    if cfg["enable_confidence_head"]:
        conf = []
        for k in range(gamma):
            f = hidden[k]
            if cfg["confidence_head_with_markov"]:
                f = torch.cat((f, t["markov_head.markov_w1.weight"][prevs[k]]))
            conf.append(float(t["confidence_head.proj.weight"][0] @ f + t["confidence_head.proj.bias"][0]))
    return tokens, logits, conf


class GumbelSampler:
    """A seeded token picker: step k adds the k-th pre-drawn Gumbel noise to the logits / T and takes
    the argmax, so two pickers built alike pick the same tokens from the same logits."""

    def __init__(self, rows: int, seed: int, temperature: float = 0.8) -> None:
        g = torch.Generator().manual_seed(seed)
        u = torch.rand(BLOCK, rows, VOCAB, generator=g, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
        self.noise = -torch.log(-torch.log(u))
        self.temperature = temperature
        self.calls = 0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        noise = self.noise[self.calls, :logits.shape[0]]
        self.calls += 1
        return (logits.double() / self.temperature + noise).argmax(-1)


def row_picker(sampler: GumbelSampler, row: int):
    """The reference runs one request at a time: give it that request's row of the noise."""
    def pick(logits: torch.Tensor) -> torch.Tensor:
        noise = sampler.noise[sampler.calls, row:row + 1]
        sampler.calls += 1
        return (logits.double() / sampler.temperature + noise).argmax(-1)
    return pick


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def propose_batch(draft, feats: list[torch.Tensor], anchors: list[int], pick=None, gamma=None):
    """The module's serving path: context K/V per request (as the engine caches it), padded to the
    longest context, then one `propose` for the whole batch."""
    cap = max(f.shape[0] for f in feats)
    per_layer: list[tuple[list, list]] = [([], []) for _ in range(LAYERS)]
    for f in feats:
        kv = draft.context_kv(f.to(draft.fc.weight.dtype), torch.arange(f.shape[0]))
        for (ks, vs), (k, v) in zip(per_layer, kv, strict=True):
            pad = (0, 0, 0, 0, 0, cap - f.shape[0])
            ks.append(torch.nn.functional.pad(k, pad))
            vs.append(torch.nn.functional.pad(v, pad))
    ctx = [(torch.stack(ks), torch.stack(vs)) for ks, vs in per_layer]
    lens = torch.tensor([f.shape[0] for f in feats])
    return draft.propose(torch.tensor(anchors), lens, ctx, lens, pick, gamma=gamma)


VARIANTS = {
    "vanilla": dict(kind="vanilla"),
    "gated": dict(kind="gated"),
    "rnn": dict(kind="rnn"),
    "confidence-without-markov": dict(kind="gated", with_markov=False),
    "no-confidence-head": dict(kind="rnn", confidence=False),
    "no-markov-head": dict(kind=None, rank=0, with_markov=False),
}


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_proposals_match_the_reference(tmp_path: Path, variant: str, sampled: bool) -> None:
    cfg = released_config(**VARIANTS[variant])
    tensors = released_tensors(cfg)
    draft = load_block_draft(write_checkpoint(tmp_path / "draft", cfg, tensors), dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    # Three requests with different context lengths share one step (the padding must be masked).
    feats = [torch.randn(n, WIDTH, generator=g) for n in (5, 9, 1)]
    anchors = [int(a) for a in torch.randint(0, MASK_ID, (3,), generator=g)]
    sampler = GumbelSampler(3, seed=7) if sampled else None
    out = propose_batch(draft, feats, anchors, sampler)

    ref_sampler = GumbelSampler(3, seed=7)
    for r in range(3):
        ref_sampler.calls = 0
        pick = row_picker(ref_sampler, r) if sampled else greedy
        tokens, logits, conf = reference_step(tensors, cfg, feats[r], anchors[r], BLOCK, pick)
        assert out.drafts[r].tolist() == tokens
        torch.testing.assert_close(out.logits[r], torch.stack(logits), rtol=1e-5, atol=1e-5)
        if conf is None:
            assert out.conf_logits is None
        else:
            torch.testing.assert_close(out.conf_logits[r].double(), torch.tensor(conf, dtype=torch.float64),
                                       rtol=1e-5, atol=1e-5)
    if sampled:  # the noise really changed the picks somewhere, or this would test greedy twice
        assert out.drafts.tolist() != propose_batch(draft, feats, anchors).drafts.tolist()


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_float32_module_matches_the_reference(tmp_path: Path, kind: str) -> None:
    cfg = released_config(kind)
    tensors = released_tensors(cfg, seed=3)
    draft = load_block_draft(write_checkpoint(tmp_path / "draft", cfg, tensors))
    g = torch.Generator().manual_seed(4)
    feats, anchor = torch.randn(6, WIDTH, generator=g), 17
    out = propose_batch(draft, [feats], [anchor])
    tokens, logits, conf = reference_step(tensors, cfg, feats, anchor, BLOCK, greedy)
    assert out.drafts[0].tolist() == tokens
    torch.testing.assert_close(out.logits[0].double(), torch.stack(logits), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.conf_logits[0].double(), torch.tensor(conf, dtype=torch.float64),
                               rtol=1e-4, atol=1e-4)


def test_gamma_defaults_to_the_block_size_and_a_shorter_block_is_its_own_forward(tmp_path: Path) -> None:
    cfg = released_config("rnn")
    tensors = released_tensors(cfg)
    draft = load_block_draft(write_checkpoint(tmp_path / "draft", cfg, tensors), dtype=torch.float64)
    assert draft.cfg.default_gamma == BLOCK
    feats = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(2))
    assert propose_batch(draft, [feats], [9]).drafts.shape == (1, BLOCK)
    # gamma < block_size: a block of gamma slots (the mask slots see one another, so it differs
    # from truncating a full block).
    out = propose_batch(draft, [feats], [9], gamma=2)
    tokens, logits, conf = reference_step(tensors, cfg, feats, 9, 2, greedy)
    assert out.drafts[0].tolist() == tokens
    torch.testing.assert_close(out.logits[0], torch.stack(logits), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.conf_logits[0].double(), torch.tensor(conf, dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="gamma 5 outside 1..block_size 4"):
        propose_batch(draft, [feats], [9], gamma=5)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_teacher_forced_blocks_match_the_serving_path(tmp_path: Path, kind: str) -> None:
    """`forward_blocks` (training) fed the drafted tokens reproduces `propose`'s logits and
    confidences for every block of a sequence at once."""
    cfg = released_config(kind)
    draft = load_block_draft(write_checkpoint(tmp_path / "draft", cfg, released_tensors(cfg)),
                             dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    seq_len, anchors = 20, [3, 8, 12]
    tokens = torch.randint(0, MASK_ID, (1, seq_len), generator=g)
    feats = torch.randn(1, seq_len, WIDTH, generator=g, dtype=torch.float64)
    for a in anchors:
        out = propose_batch(draft, [feats[0, :a]], [int(tokens[0, a])])
        forced = tokens.clone()
        forced[0, a + 1:a + BLOCK] = out.drafts[0, :BLOCK - 1]
        with torch.no_grad():
            train = draft.forward_blocks(feats, forced, torch.tensor([anchors]))
        i = anchors.index(a)
        torch.testing.assert_close(train.logits[0, i], out.logits[0], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(train.conf_logits[0, i], out.conf_logits[0], rtol=1e-5, atol=1e-5)


def test_context_features_of_the_wrong_width_are_refused(tmp_path: Path) -> None:
    cfg = released_config()
    draft = load_block_draft(write_checkpoint(tmp_path / "draft", cfg, released_tensors(cfg)))
    with pytest.raises(ValueError, match=r"reads 3 layers x 32 = 96 .*\[-1, 1, 2\]"):
        draft.context_kv(torch.randn(3, HIDDEN), torch.arange(3))


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_a_request_drafts_bit_for_bit_the_same_whatever_shares_its_step(tmp_path: Path, kind: str) -> None:
    """CPU batch invariance (as for the target, docs/architecture.md "Losslessness"): a request's
    drafts, logits and confidences do not depend on how many requests share the step or on how
    long their contexts are (which sets the padded context width)."""
    cfg = released_config(kind)
    draft = load_block_draft(write_checkpoint(tmp_path / "draft", cfg, released_tensors(cfg)))
    g = torch.Generator().manual_seed(0)
    lengths = (37, 5, 130, 64, 1, 77, 12, 200, 63, 65)
    feats = [torch.randn(n, WIDTH, generator=g) for n in lengths]
    anchors = list(range(3, 3 + len(lengths)))
    for gamma in (BLOCK, 3):
        full = propose_batch(draft, feats, anchors, gamma=gamma)
        for r in range(len(lengths)):
            other = (r + 2) % len(lengths)
            for out, row in ((propose_batch(draft, [feats[r]], [anchors[r]], gamma=gamma), 0),
                             (propose_batch(draft, [feats[other], feats[r]], [anchors[other], anchors[r]],
                                            gamma=gamma), 1)):
                assert torch.equal(out.logits[row], full.logits[r]), (gamma, r)
                assert torch.equal(out.conf_logits[row], full.conf_logits[r]), (gamma, r)
                assert torch.equal(out.drafts[row], full.drafts[r]), (gamma, r)
