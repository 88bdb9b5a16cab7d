"""The published DSpark draft (DeepSpec's `Qwen3DSparkModel`), weight-compatible with the released
checkpoints (`deepseek-ai/dspark_qwen3_{4b,8b,14b}_block7`).

One draft step for a request whose committed tokens are `x_0 … x_{n-1}`:

* context: the target's hidden states at `target_layer_ids` for positions `0 … n-2`, concatenated
  per position (`[n-1, L·H]`), are projected once, `c = hidden_norm(fc(·))`, and every draft layer
  reads its keys and values from `c` (`K = rope(k_norm(k_proj(c)))`, `V = v_proj(c)`); they are
  cached, one entry per committed position, like a target's KV cache;
* block: `[x_{n-1}, MASK, …, MASK]` (`gamma` slots, the anchor `x_{n-1}` plus `gamma - 1` copies of
  `mask_token_id`) at positions `n-1 … n-2+gamma` runs through the Qwen3-style layers; each slot's
  queries attend to every context entry and to every slot of the block (no causal mask inside it);
* slot k's final hidden `h_k` gives base logits `lm_head(h_k)`, which the Markov head corrects
  sequentially with the token drafted at slot k-1 (the anchor for k = 0): slot k drafts `x_{n+k}`;
* the confidence head maps `[h_k ; markov_w1[prev_k]]` to one logit per slot.

Markov heads (`e = markov_w1[prev]`, `W2 = markov_w2`):

* vanilla: `bias = W2 e`
* gated:   `bias = W2 (sigmoid(gate_proj([h_k ; e])) * e)`
* rnn:     `[g ; c ; o] = joint_proj([s ; e ; h_k])`, `s' = sigmoid(g) * s + (1 - sigmoid(g)) * tanh(c)`,
           `bias = W2 tanh(o)`, with `s = 0` before slot 0 of every block.

Every linear runs through `ops.linear` on a 2-D row block, so a row's result does not depend on how
many rows share the product (CPU batch invariance, dspark/runtime/models/ops.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dspark.checkpoints.dspark_block_config import BlockDraftConfig
from dspark.runtime.models import ops
from dspark.runtime.models.dspark_block_attention import block_step_attention
from dspark.runtime.models.llama import RMSNorm  # the targets' (ops.rms_norm), Qwen3's order of casts
from dspark.runtime.models.ops import SMALL_ELEMENT_TILE, lanewise

# Picks one token per row from `[B, V]` step logits (argmax, or a sampler under each request's policy).
TokenPicker = Callable[[torch.Tensor], torch.Tensor]


class BlockAttention(Protocol):
    """A serving step's block attention over the draft's paged cache (`dspark.runtime.engine.forward`):
    it writes the block's keys and values where the commit will write the context's, and attends every
    block row to its request's context and whole block in one pass of a paged-attention backend."""

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`q[B * Q, H, D]`, `k`/`v[B * Q, Hkv, D]` (request-major) -> `[B * Q, H, D]`."""
        ...


@dataclass(frozen=True)
class Visibility:
    """Which keys a block row sees, besides every slot of its own block.

    Serving (`ctx_lens[B]`): request b's first `ctx_lens[b]` context entries, gathered densely, through
    the batch-invariant step attention; or (`paged`) the same keys read in place from the draft's paged
    cache. Training (`mask[B, Q, C + Q]`): an explicit mask over the context and every block of the
    sequence (True where allowed), through one fused kernel.
    """

    ctx_lens: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    paged: BlockAttention | None = None


def _small(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`lanewise` for a Markov head's `[B, rank]` tensors, in tiles of their size."""
    return lanewise(fn, x, SMALL_ELEMENT_TILE)


def dense(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """`layer(x)` for `x[..., in]` with the product on a 2-D row block through `ops.linear`."""
    out = ops.linear(x.reshape(-1, x.shape[-1]), layer.weight)
    if layer.bias is not None:
        out = out + layer.bias
    return out.view(*x.shape[:-1], out.shape[-1])


def dense_many(x: torch.Tensor, *layers: nn.Linear) -> tuple[torch.Tensor, ...]:
    """`dense` for several layers read from the same rows, as one product (`ops.linear_many`)."""
    outs = ops.linear_many(x.reshape(-1, x.shape[-1]), [layer.weight for layer in layers],
                           [layer.bias for layer in layers])
    return tuple(out.reshape(*x.shape[:-1], out.shape[-1]) for out in outs)


class BlockDraftAttention(nn.Module):
    def __init__(self, cfg: BlockDraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed per head, rotated) and values `[..., T, Hkv, D]` of rows `x[..., T, d]`."""
        c = self.cfg
        k = self.k_norm(dense(x, self.k_proj).unflatten(-1, (c.num_kv_heads, c.head_dim)))
        v = dense(x, self.v_proj).unflatten(-1, (c.num_kv_heads, c.head_dim))
        return ops.apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor | None,
                ctx_v: torch.Tensor | None, visible: Visibility, layer_id: int) -> torch.Tensor:
        """Block rows `x[B, Q, d]` (already input-normed) attend to the context keys/values
        `[B, C, Hkv, D]` (or, `visible.paged`, the paged cache's) and to the block's own (`Visibility`
        says which)."""
        c = self.cfg
        q, k_blk, v_blk = dense_many(x, self.q_proj, self.k_proj, self.v_proj)
        q = ops.apply_rope(self.q_norm(q.unflatten(-1, (c.num_heads, c.head_dim))), cos, sin)
        k_blk = ops.apply_rope(self.k_norm(k_blk.unflatten(-1, (c.num_kv_heads, c.head_dim))), cos, sin)
        v_blk = v_blk.unflatten(-1, (c.num_kv_heads, c.head_dim))
        if visible.paged is not None:
            rows = q.shape[0] * q.shape[1]
            out = visible.paged.attend(layer_id, q.reshape(rows, c.num_heads, c.head_dim),
                                       k_blk.reshape(rows, c.num_kv_heads, c.head_dim),
                                       v_blk.reshape(rows, c.num_kv_heads, c.head_dim)).view(q.shape)
            return dense(out.flatten(-2), self.o_proj)
        assert ctx_k is not None and ctx_v is not None
        ctx_k, ctx_v, scale = ctx_k.to(x.dtype), ctx_v.to(x.dtype), c.head_dim ** -0.5
        if visible.ctx_lens is not None:
            out = block_step_attention(q, ctx_k, ctx_v, visible.ctx_lens, k_blk, v_blk, scale)
        else:
            assert visible.mask is not None
            k = torch.cat((ctx_k, k_blk), dim=1).transpose(1, 2)  # [B, Hkv, C+Q, D]
            v = torch.cat((ctx_v, v_blk), dim=1).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k, v, attn_mask=visible.mask[:, None], scale=scale,
                enable_gqa=c.num_heads != c.num_kv_heads).transpose(1, 2)  # [B, Q, H, D]
        return dense(out.flatten(-2), self.o_proj)


class BlockDraftMLP(nn.Module):
    def __init__(self, cfg: BlockDraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = dense_many(x, self.gate_proj, self.up_proj)
        return dense(lanewise(F.silu, gate) * up, self.down_proj)


class BlockDraftLayer(nn.Module):
    def __init__(self, cfg: BlockDraftConfig) -> None:
        super().__init__()
        self.self_attn = BlockDraftAttention(cfg)
        self.mlp = BlockDraftMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor | None,
                ctx_v: torch.Tensor | None, visible: Visibility, layer_id: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, visible, layer_id)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """The token-transition bias added to slot k's logits, from the token at slot k-1.

    `step(prev_ids, hidden, state)` returns `(bias [.., V], new state)`; only the rnn kind carries
    a state (`[.., markov_rank]`, zeros at the start of a block); the others return it unchanged.
    """

    def __init__(self, cfg: BlockDraftConfig) -> None:
        super().__init__()
        r, d, kind = cfg.markov_rank, cfg.hidden_size, cfg.markov_head_type
        self.kind = kind
        self.markov_w1 = nn.Embedding(cfg.vocab_size, r)
        self.markov_w2 = nn.Linear(r, cfg.vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(d + r, r)
        elif kind == "rnn":
            # One product gives the update gate, the candidate state and the output: [s ; e ; h] -> 3r.
            self.joint_proj = nn.Linear(2 * r + d, 3 * r)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev_ids)

    def initial_state(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[.., r]` zeros for a block whose slot hidden states are `hidden[.., d]`."""
        return hidden.new_zeros(*hidden.shape[:-1], self.markov_w1.embedding_dim)

    def step(self, prev_ids: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.embed(prev_ids).to(hidden.dtype)
        if self.kind == "vanilla":
            return dense(e, self.markov_w2), state
        if self.kind == "gated":
            gate = _small(torch.sigmoid, dense(torch.cat((hidden, e), dim=-1), self.gate_proj))
            return dense(gate * e, self.markov_w2), state
        g, cand, o = dense(torch.cat((state, e, hidden), dim=-1), self.joint_proj).chunk(3, dim=-1)
        g = _small(torch.sigmoid, g)
        new_state = g * state + (1.0 - g) * _small(torch.tanh, cand)
        return dense(_small(torch.tanh, o), self.markov_w2), new_state


class ConfidenceHead(nn.Module):
    """One linear layer: `[h_k ; markov_w1[prev_k]]` (or `h_k` alone) -> the slot's confidence logit."""

    def __init__(self, cfg: BlockDraftConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.confidence_inputs, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return dense(features, self.proj).squeeze(-1).float()


@dataclass(frozen=True)
class BlockProposal:
    """One draft step over `gamma` slots."""

    drafts: torch.Tensor | None  # [B, gamma] drafted tokens; None when teacher-forced
    conf_logits: torch.Tensor | None  # [B, gamma] float32; None without a confidence head
    logits: torch.Tensor  # [B, gamma, V] Markov-corrected draft logits (what rejection sampling reads)
    hidden: torch.Tensor  # [B, gamma, d] the backbone's final (normed) hidden state per slot
    conf_inputs: torch.Tensor | None = None  # [B, gamma, confidence_inputs] when asked for


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


class DSparkBlockDraft(nn.Module):
    """Parameter names are the released ones (`embed_tokens`, `layers.{i}.…`, `norm`, `fc`,
    `hidden_norm`, `lm_head`, `markov_head.…`, `confidence_head.proj`)."""

    def __init__(self, cfg: BlockDraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(BlockDraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.context_width, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.markov_head = MarkovHead(cfg) if cfg.markov_rank > 0 else None
        self.confidence_head = ConfidenceHead(cfg) if cfg.confidence_head else None

    # -- shared pieces -------------------------------------------------------------------
    def resolve_gamma(self, gamma: int | None) -> int:
        g = self.cfg.block_size if gamma is None else gamma
        if not 1 <= g <= self.cfg.block_size:
            # Slots past the trained block size were never trained to predict anything.
            raise ValueError(f"gamma {g} outside 1..block_size {self.cfg.block_size} of this draft")
        return g

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)

    def block_ids(self, anchor_ids: torch.Tensor, gamma: int) -> torch.Tensor:
        """`[..., gamma]`: the anchor then `gamma - 1` mask tokens."""
        ids = torch.full((*anchor_ids.shape, gamma), self.cfg.mask_token_id,
                         dtype=torch.long, device=anchor_ids.device)
        ids[..., 0] = anchor_ids
        return ids

    def context_features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """`[..., context_width]` target features -> `[..., d]`, what every layer's K/V read."""
        if target_hidden.shape[-1] != self.cfg.context_width:
            raise ValueError(f"target features are {target_hidden.shape[-1]} wide; this draft reads "
                             f"{len(self.cfg.target_layer_ids)} layers x {self.cfg.hidden_size} = "
                             f"{self.cfg.context_width} (the target's hidden states at "
                             f"{list(self.cfg.target_layer_ids)}, concatenated)")
        return self.hidden_norm(dense(target_hidden.to(self.fc.weight.dtype), self.fc))

    def backbone(self, block_ids: torch.Tensor, block_pos: torch.Tensor,
                 ctx_kv: list[tuple[torch.Tensor, torch.Tensor]] | None, visible: Visibility) -> torch.Tensor:
        """Block rows `[B, Q]` at positions `[B, Q]` -> final normed hidden states `[B, Q, d]`; the
        context K/V per layer, or none when `visible.paged` reads them from the cache."""
        cos, sin = self._rope(block_pos)
        x = self.embed_tokens(block_ids)
        for i, layer in enumerate(self.layers):
            ck, cv = ctx_kv[i] if ctx_kv is not None else (None, None)
            x = layer(x, cos, sin, ck, cv, visible, i)
        return self.norm(x)

    def heads(self, hidden: torch.Tensor, first_prev: torch.Tensor, pick: TokenPicker | None = None,
              forced_prev: torch.Tensor | None = None, keep_conf_inputs: bool = False) -> BlockProposal:
        """The Markov and confidence heads over the slots of `hidden[..., gamma, d]`.

        Slot k's previous token is `first_prev` for k = 0, then the token drafted at slot k-1
        (`pick(step logits)`), or `forced_prev[..., k]` when teacher-forced (training: no drafts).
        """
        gamma = hidden.shape[-2]
        base = dense(hidden, self.lm_head)  # [..., gamma, V]
        markov = self.markov_head
        state = markov.initial_state(hidden[..., 0, :]) if markov is not None else None
        prev = first_prev
        prevs, logits, tokens = [], [], []
        for k in range(gamma):
            if forced_prev is not None:
                prev = forced_prev[..., k]
            prevs.append(prev)
            step = base[..., k, :]
            if markov is not None:
                bias, state = markov.step(prev, hidden[..., k, :], state)
                step = step + bias
            logits.append(step)
            if forced_prev is None:
                prev = (pick or _argmax)(step)
                tokens.append(prev)
        prev_ids = torch.stack(prevs, dim=-1)  # [..., gamma]
        conf_logits = conf_in = None
        if self.confidence_head is not None:
            conf_in = hidden
            if self.cfg.confidence_with_markov:
                assert markov is not None
                conf_in = torch.cat((hidden, markov.embed(prev_ids).to(hidden.dtype)), dim=-1)
            conf_logits = self.confidence_head(conf_in)
        return BlockProposal(
            drafts=torch.stack(tokens, dim=-1) if tokens else None, conf_logits=conf_logits,
            logits=torch.stack(logits, dim=-2), hidden=hidden,
            conf_inputs=conf_in if keep_conf_inputs else None)

    def _context_kv(self, target_hidden: torch.Tensor, positions: torch.Tensor
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        feats = self.context_features(target_hidden)
        cos, sin = self._rope(positions)
        return [layer.self_attn.kv(feats, cos, sin) for layer in self.layers]

    # -- serving -------------------------------------------------------------------------
    @torch.inference_mode()
    def context_kv(self, target_hidden: torch.Tensor, positions: torch.Tensor
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context K/V `[T, Hkv, D]` of committed positions `[T]`, from the target's
        features there (`[T, context_width]`), for the draft's cache."""
        return self._context_kv(target_hidden, positions)

    @torch.inference_mode()
    def propose(self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor,
                ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_lens: torch.Tensor,
                pick: TokenPicker | None = None, gamma: int | None = None,
                keep_conf_inputs: bool = False) -> BlockProposal:
        """One draft step for `B` requests.

        `anchor_ids[B]` is each request's last committed token, at position `anchor_pos[B]`;
        `ctx_kv` holds every layer's cached context K/V gathered to `[B, C, Hkv, D]`, of which
        request b's first `ctx_lens[b]` entries (positions `0 … ctx_lens[b]-1`, normally
        `anchor_pos[b]`) are valid. `pick` chooses each slot's token from its `[B, V]` corrected
        logits (greedy argmax without it); `gamma` defaults to the checkpoint's block size.
        """
        return self._propose(anchor_ids, anchor_pos, ctx_kv, Visibility(ctx_lens), pick, gamma,
                             keep_conf_inputs)

    @torch.inference_mode()
    def propose_paged(self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, attention: BlockAttention,
                      pick: TokenPicker | None = None, gamma: int | None = None,
                      keep_conf_inputs: bool = False) -> BlockProposal:
        """`propose` with the context read in place from the draft's paged cache by `attention`, laid
        out for these requests' blocks at `anchor_pos[b] …` (no gathered copy of the context)."""
        return self._propose(anchor_ids, anchor_pos, None, Visibility(paged=attention), pick, gamma,
                             keep_conf_inputs)

    def _propose(self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor,
                 ctx_kv: list[tuple[torch.Tensor, torch.Tensor]] | None, visible: Visibility,
                 pick: TokenPicker | None, gamma: int | None, keep_conf_inputs: bool) -> BlockProposal:
        gamma = self.resolve_gamma(gamma)
        block_pos = anchor_pos[:, None] + torch.arange(gamma, device=anchor_ids.device)
        hidden = self.backbone(self.block_ids(anchor_ids, gamma), block_pos, ctx_kv, visible)
        return self.heads(hidden, anchor_ids, pick, keep_conf_inputs=keep_conf_inputs)

    # -- training ------------------------------------------------------------------------
    def forward_blocks(self, target_hidden: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                       gamma: int | None = None) -> BlockProposal:
        """Teacher-forced outputs for blocks anchored at `anchors[b, A]` of sequences `tokens[b, S]`
        whose target features are `target_hidden[b, S, context_width]`.

        Block a's slot k predicts `tokens[b, anchors[b, a] + k + 1]`; its context is every position
        before its anchor, and the Markov head reads the true previous tokens. Returns logits
        `[b, A, gamma, V]` and confidence logits `[b, A, gamma]` (`drafts` is None).
        """
        gamma = self.resolve_gamma(gamma)
        b, seq_len = tokens.shape
        n_blocks, dev = anchors.shape[1], tokens.device
        ctx_kv = self._context_kv(target_hidden, torch.arange(seq_len, device=dev))

        offs = torch.arange(gamma, device=dev)
        block_pos = (anchors[..., None] + offs).reshape(b, -1)  # [b, A*gamma]
        block_ids = self.block_ids(tokens.gather(1, anchors), gamma).reshape(b, -1)
        q_anchor = anchors.repeat_interleave(gamma, dim=1)  # [b, A*gamma]
        ctx_mask = torch.arange(seq_len, device=dev)[None, None, :] < q_anchor[..., None]
        blk = torch.arange(n_blocks, device=dev).repeat_interleave(gamma)
        blk_mask = (blk[:, None] == blk[None, :]).expand(b, -1, -1)
        mask = torch.cat((ctx_mask, blk_mask), dim=-1)
        hidden = self.backbone(block_ids, block_pos, ctx_kv, Visibility(mask=mask))
        hidden = hidden.view(b, n_blocks, gamma, -1)
        # Slot k's previous token is the one at anchor + k (the anchor itself for k = 0).
        prev_idx = (anchors[..., None] + offs).clamp(max=seq_len - 1).reshape(b, -1)
        prev = tokens.gather(1, prev_idx).view(b, n_blocks, gamma)
        return self.heads(hidden, prev[..., 0], forced_prev=prev)
