"""DSpark draft model: block-parallel backbone + sequential Markov head + confidence head.

The draft is conditioned on the target: every committed position's target hidden state is
projected into a context feature that the draft layers attend to (their K/V for that position).
One forward over the block `[root, MASK x gamma]` at positions `T … T+gamma` gives a backbone
state `g_k` for every draft position at once. A light sequential head (a residual MLP, gamma
small steps) then turns `g_k` into logits from the Markov embedding of the previous draft token
(the root for `k = 1`) and its own previous hidden state, so position `k` knows what was drafted
before it. The confidence head maps `[hidden_k ; markov_embedding(prev_k)]` through one Linear
layer to one logit per position; with `confidence_draft_stats` the head also sees three
statistics of the draft's own distribution at that position (`draft_stats`), which a Linear
layer over the hidden state cannot compute but which say much about whether the target agrees.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dspark.runtime.models import ops
from dspark.runtime.models.llama import LlamaConfig, LlamaMLP, RMSNorm


@dataclass(frozen=True)
class DraftConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    target_hidden_size: int
    gamma: int
    markov_embedding_size: int
    confidence_head: bool = True
    confidence_draft_stats: bool = False  # the head also reads `draft_stats` of the draft logits
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    @property
    def mask_token_id(self) -> int:
        """The block's placeholder token: one row past the target vocabulary."""
        return self.vocab_size

    def to_json(self) -> dict[str, Any]:
        return {"model_type": "dspark_draft", **asdict(self)}

    @classmethod
    def from_json(cls, cfg: dict[str, Any]) -> DraftConfig:
        fields = {k: v for k, v in cfg.items() if k != "model_type"}
        return cls(**fields)

    def layer_config(self) -> LlamaConfig:
        # the Llama config fields the draft has; the rest (RoPE scaling, biases) keep their defaults
        return LlamaConfig(**{f: getattr(self, f) for f in LLAMA_FIELDS})

    @property
    def confidence_inputs(self) -> int:
        """Width of the confidence head's input `[hidden ; markov embedding ; draft stats]`."""
        return self.hidden_size + self.markov_embedding_size + (
            NUM_DRAFT_STATS if self.confidence_draft_stats else 0)


LLAMA_FIELDS = tuple(f.name for f in fields(LlamaConfig) if f.name in {g.name for g in fields(DraftConfig)})
NUM_DRAFT_STATS = 3


def draft_stats(logits: torch.Tensor) -> torch.Tensor:
    """`[..., 3]` float32: the top draft token's log-probability, its margin over the runner-up,
    and the entropy of the draft distribution (nats)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top2 = logp.topk(2, dim=-1).values
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.stack((top2[..., 0], top2[..., 0] - top2[..., 1], entropy), dim=-1)


class HeadStep(NamedTuple):
    """One sequential head step: draft logits, confidence logit, the confidence head's input
    (`DraftConfig.confidence_inputs` wide) and the hidden carried to the next position."""

    logits: torch.Tensor
    conf_logit: torch.Tensor | None
    conf_input: torch.Tensor | None
    hidden: torch.Tensor


@dataclass(frozen=True)
class Proposal:
    """What the head produced over the gamma draft positions."""

    drafts: torch.Tensor | None  # [..., gamma] drafted tokens; None when teacher-forced
    conf_logits: torch.Tensor | None  # [..., gamma]; None without a confidence head
    logits: torch.Tensor  # [..., gamma, V]
    conf_inputs: torch.Tensor | None = None  # [..., gamma, confidence_inputs] when asked for


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.layer_config())

    def kv(self, feats: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V heads for features `[..., T, d]` at the positions `cos/sin` were built for."""
        c = self.cfg
        h = self.input_layernorm(feats)
        k = self.k_proj(h).unflatten(-1, (c.num_kv_heads, c.head_dim))
        v = self.v_proj(h).unflatten(-1, (c.num_kv_heads, c.head_dim))
        return ops.apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Block rows `x[b, Q, d]` attend context K/V `[b, C, Hkv, D]` plus their own K/V.

        `mask[b, Q, C + Q]` is True where attention is allowed.
        """
        c = self.cfg
        h = self.input_layernorm(x)
        q = ops.apply_rope(self.q_proj(h).unflatten(-1, (c.num_heads, c.head_dim)), cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)
        k = torch.cat((ctx_k, k_blk), dim=1).transpose(1, 2)
        v = torch.cat((ctx_v, v_blk), dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None],
                                             enable_gqa=c.num_heads != c.num_kv_heads)
        x = x + self.o_proj(out.transpose(1, 2).flatten(-2))
        return x + self.mlp.forward_dense(self.post_attention_layernorm(x))


class DSparkDraft(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size + 1, d)
        self.ctx_norm = RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps)
        self.ctx_proj = nn.Linear(cfg.target_hidden_size, d, bias=False)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        m = cfg.markov_embedding_size
        if m > 0:
            self.markov_embed = nn.Embedding(cfg.vocab_size, m)
        # The sequential head: a residual MLP over [backbone state ; previous-token embedding ;
        # the head's previous hidden state], so position k knows the whole drafted prefix.
        self.head_up = nn.Linear(2 * d + m, d, bias=False)
        self.head_down = nn.Linear(d, d, bias=False)
        if cfg.confidence_head:
            self.confidence_head = nn.Linear(cfg.confidence_inputs, 1)

    # -- shared pieces -------------------------------------------------------------------
    def context_features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.ctx_proj(self.ctx_norm(target_hidden))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)

    def block_ids(self, root_ids: torch.Tensor) -> torch.Tensor:
        """`[..., gamma + 1]` block inputs: the root token followed by gamma MASK tokens."""
        mask = torch.full((*root_ids.shape, self.cfg.gamma), self.cfg.mask_token_id,
                          dtype=root_ids.dtype, device=root_ids.device)
        return torch.cat((root_ids[..., None], mask), dim=-1)

    def backbone(self, block_ids: torch.Tensor, block_pos: torch.Tensor,
                 ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> torch.Tensor:
        """Block forward; returns the backbone states of the gamma draft positions `[b, Q', d]`."""
        cos, sin = self._rope(block_pos)
        x = self.embed_tokens(block_ids)
        for layer, (ck, cv) in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, cos, sin, ck, cv, mask)
        return x

    def head(self, g: torch.Tensor, prev_ids: torch.Tensor, state: torch.Tensor) -> HeadStep:
        """One sequential step at position k.

        `g` is the backbone state of position k, `prev_ids` the token at k - 1 (the root for
        k = 1) and `state` the hidden of position k - 1 (zeros for k = 1).
        """
        if self.cfg.markov_embedding_size > 0:
            m = self.markov_embed(prev_ids)
        else:
            m = g.new_zeros(*g.shape[:-1], 0)
        head_in = torch.cat((g, m, state), dim=-1)
        hidden = self.norm(g + self.head_down(F.silu(self.head_up(head_in))))
        logits = self.lm_head(hidden)
        if not self.cfg.confidence_head:
            return HeadStep(logits, None, None, hidden)
        conf_in = torch.cat((hidden, m), dim=-1)
        if self.cfg.confidence_draft_stats:
            conf_in = torch.cat((conf_in, draft_stats(logits).to(conf_in.dtype)), dim=-1)
        return HeadStep(logits, self.confidence_head(conf_in).squeeze(-1), conf_in, hidden)

    def _run_head(self, g: torch.Tensor, first_prev: torch.Tensor,
                  choose: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  forced_prev: torch.Tensor | None = None, keep_conf_inputs: bool = False
                  ) -> Proposal:
        """The head over all gamma positions of `g[..., gamma, d]`.

        The previous token is the drafted one, `choose(logits)` (argmax, or a sample), or
        `forced_prev[..., k]` (training, which drafts nothing: `drafts` is None then).
        """
        state = torch.zeros_like(g[..., 0, :])
        prev = first_prev
        logits, confs, conf_ins, tokens = [], [], [], []
        for k in range(self.cfg.gamma):
            if forced_prev is not None:
                prev = forced_prev[..., k]
            step = self.head(g[..., k, :], prev, state)
            state = step.hidden
            if choose is not None:
                prev = choose(step.logits)
                tokens.append(prev)
            logits.append(step.logits)
            confs.append(step.conf_logit)
            conf_ins.append(step.conf_input)
        has_conf = self.cfg.confidence_head
        return Proposal(
            drafts=torch.stack(tokens, dim=-1) if tokens else None,
            conf_logits=torch.stack(confs, dim=-1) if has_conf else None,
            logits=torch.stack(logits, dim=-2),
            conf_inputs=torch.stack(conf_ins, dim=-2) if has_conf and keep_conf_inputs else None)

    # -- training ------------------------------------------------------------------------
    def forward_train(self, target_hidden: torch.Tensor, tokens: torch.Tensor,
                      anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced draft outputs for blocks rooted at `anchors[b, A]` of each sequence.

        Returns logits `[b, A, gamma, V]` for tokens `anchor+1 … anchor+gamma` and confidence
        logits `[b, A, gamma]`. The Markov head sees the true previous tokens.
        """
        b, seq_len = tokens.shape
        gamma = self.cfg.gamma
        n_anchor = anchors.shape[1]
        feats = self.context_features(target_hidden)
        ctx_cos, ctx_sin = self._rope(torch.arange(seq_len, device=tokens.device))
        ctx_kv = [layer.kv(feats, ctx_cos, ctx_sin) for layer in self.layers]

        offs = torch.arange(gamma + 1, device=tokens.device)
        block_pos = (anchors[..., None] + offs).reshape(b, -1)
        block_ids = self.block_ids(tokens.gather(1, anchors)).reshape(b, -1)
        # Context key j is visible to a block rooted at T iff j < T; block keys only within a block.
        q_anchor = anchors.repeat_interleave(gamma + 1, dim=1)
        ctx_mask = torch.arange(seq_len, device=tokens.device)[None, None, :] < q_anchor[..., None]
        blk = torch.arange(n_anchor, device=tokens.device).repeat_interleave(gamma + 1)
        blk_mask = (blk[:, None] == blk[None, :]).expand(b, -1, -1)
        mask = torch.cat((ctx_mask, blk_mask), dim=-1)

        g = self.backbone(block_ids, block_pos, ctx_kv, mask).view(b, n_anchor, gamma + 1, -1)[:, :, 1:]
        prev = tokens.gather(1, (anchors[..., None] + offs[:-1]).reshape(b, -1)).view(b, n_anchor, gamma)
        out = self._run_head(g, prev[..., 0], forced_prev=prev)
        return out.logits, out.conf_logits

    # -- serving -------------------------------------------------------------------------
    @torch.inference_mode()
    def context_kv(self, target_hidden: torch.Tensor, positions: torch.Tensor
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer K/V `[T, Hkv, D]` of newly committed positions, for the draft's cache."""
        feats = self.context_features(target_hidden)
        cos, sin = self._rope(positions)
        return [layer.kv(feats, cos, sin) for layer in self.layers]

    @torch.inference_mode()
    def propose(self, root_ids: torch.Tensor, root_pos: torch.Tensor,
                ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_lens: torch.Tensor,
                choose: Callable[[torch.Tensor], torch.Tensor] | None = None,
                keep_conf_inputs: bool = False) -> Proposal:
        """Drafts `[B, gamma]`, confidence logits `[B, gamma]` and draft logits `[B, gamma, V]`
        (and the confidence head's inputs `[B, gamma, confidence_inputs]` with `keep_conf_inputs`, which
        `dspark run --record-features` stores for `dspark fit-confidence`).

        `ctx_kv` holds each layer's context K/V gathered to `[B, C, Hkv, D]`; request r's
        first `ctx_lens[r]` entries are valid. `choose(logits)` picks each draft token (a
        sampler); greedy (argmax) without it.
        """
        gamma = self.cfg.gamma
        n = gamma + 1
        cap = ctx_kv[0][0].shape[1]
        block_ids = self.block_ids(root_ids)
        block_pos = root_pos[:, None] + torch.arange(n, device=root_ids.device)
        ctx_mask = torch.arange(cap, device=root_ids.device)[None, :] < ctx_lens[:, None]
        mask = torch.cat((ctx_mask[:, None, :].expand(-1, n, -1),
                          torch.ones(len(root_ids), n, n, dtype=torch.bool, device=root_ids.device)),
                         dim=-1)
        g = self.backbone(block_ids, block_pos, ctx_kv, mask)[:, 1:]
        return self._run_head(g, root_ids, choose or _argmax, keep_conf_inputs=keep_conf_inputs)
