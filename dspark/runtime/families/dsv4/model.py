"""DeepSeek-V4 (DSV4): a CPU reference for speculative verification, the whole architecture at any size.

What is modelled (the structure verification depends on)
--------------------------------------------------------
Every layer has a compress ratio r, one of three kinds:

* r = 0, sliding window only: a row at position p attends to the raw KV of positions [p - W + 1, p].
* C4 (``csa_ratio``, 4 in the published model): a compressor turns each closed block of r positions into
  one compressed entry; an indexer scores the closed entries for each row and attention reads only the
  ``index_topk`` best of them, besides the window.
* C128 (``hca_ratio``, 128 in the published model): the same compressor, no indexer; attention reads every
  closed entry, besides the window.

Block j covers positions [j*r, (j+1)*r) and closes, writing its entry, at the row whose position p has
(p + 1) % r == 0; that row already sees the entry (the compressor runs before attention). Attention is one
softmax over the union of the window's raw keys, the compressed entries the row may read, and a learned
per-head "sink" logit that takes probability mass and returns no value.

The arithmetic follows DeepSeek's V4 inference code:

* one latent KV head shared by all query heads (K = V = the head_dim vector, MQA); queries come through a
  low-rank latent ``qr = q_norm(wq_a x)``, are RMS-normalised per head without a weight, and RoPE rotates
  only the trailing ``rope_dim`` channels of queries, keys and entries; as V carries rotated channels too,
  the attention output is rotated back by the row's own position before the output projection;
* the compressor projects each position to a value and a gate (``wkv``, ``wgate``) and adds a learned
  position-in-block bias (``ape``) to the gate; an entry is the softmax-over-positions (per channel) weighted
  sum of the block's values, then RMSNorm, then RoPE at the block's first position j*r;
* C4 compressors overlap: they project to 2*d channels, and entry j pools 2r rows, the first half of
  block j-1's channels and the second half of block j's (block 0's missing predecessor is value 0 with gate
  -inf, so it takes no weight);
* the indexer (C4 layers) has its own overlapping compressor producing index keys (``index_head_dim``),
  a query ``wq_b(qr)`` of ``index_n_heads`` heads with RoPE, and per-head weights ``weights_proj(x)`` scaled
  by (index_head_dim * index_n_heads)^-0.5; an entry's score is sum_h w_h * relu(q_h . k). Ties go to the
  lower entry index, so the choice is the same however the scores were batched.
* RoPE base: ``rope_theta`` on window-only layers, ``compress_rope_theta`` on compressed ones.

Sources read (no code copied): a torch port of DeepSeek's V4-Flash ``inference/model.py`` (Compressor,
Indexer, Attention, get_window_topk_idxs / get_compress_topk_idxs, sparse_attn with sink);
vllm-project/vllm-ascend ``vllm_ascend/models/deepseek_v4/compressor.py`` and ``.../indexer.py`` (ape, overlap
for ratio 4 only, fp32 state of 2*coff*head_dim per position, indexer compressor with rotation); and
sgl-project/sglang ``python/sglang/srt/layers/attention/compressed/compressor.py`` (the open block's
per-position value/gate rows live beside the window's raw KV, keyed by position, which is what makes
a rollback a matter of forgetting rows). They agree on the points above.

The rest of the architecture
----------------------------
* MoE (`moe`): routed experts with sqrtsoftplus / sigmoid / softmax scores, a selection bias, top-k
  renormalised and scaled, hash routing by ``tid2eid`` in the first ``n_hash_layers`` layers, one shared
  expert, every SwiGLU clamped by ``swiglu_limit``. ``ffn="dense"`` keeps one SwiGLU of ``inter_dim``
  instead: a simplification for small tests, which a spec must ask for.
* Hyper-connections (`hyper`): ``hc_mult`` residual streams, mixed around every sub-layer by a
  Sinkhorn-normalised matrix, collapsed by the head; ``hc_mult=0`` is a plain residual (small tests).
* The grouped low-rank output projection: ``o_groups`` groups of heads, each through its rows of ``wo_a``
  to ``o_lora_rank`` channels, then ``wo_b``; ``o_groups=0`` is one ``wo`` (small tests).
* YaRN (`dspark.formats.dsv4_config.Rope`) on the compressed layers' RoPE (their compressors and indexer
  included), as transformers computes it, without an attention factor.
* Not here: quantised computation (fp8 / fp4 weights load dequantised; the QAT round trips) and so no
  Hadamard rotation of indexer queries and keys (orthogonal on both sides, it leaves the scores unchanged
  in exact arithmetic); all fp32.
  MTP / DSpark stages are not part of the target. Every size is a config field, and ``hca_ratio`` can be
  small in tests so C128-kind blocks close often.

State and exact rollback
------------------------
:class:`DSV4State` is one request's attention state: per layer the raw-KV ring of the window (position p in
slot p % W), and per compressor the closed entries, the open block's projected rows, and (C4) the overlap
half of the last closed block; the indexer's compressor has the same state with the index keys as entries.
:meth:`DSV4Model.step` runs L rows at positions P .. P+L-1 at once (a verify step) without touching its input
state: row i reads the raw KV of rows <= i and every entry closed at or before its position, including those
closed by earlier rows of the same step. It returns each row's projected writes, and :meth:`DSV4Model.commit`
replays only the first ``accepted`` of them onto the state before the step, so entries and index keys closed
by rejected rows never exist. For the result to be *bitwise* the state of target-only decoding, every
computation a row's writes depend on must not depend on how many rows share the step: linear layers are an
elementwise product and a sum over the input (a BLAS GEMM picks other kernels for 1 row than for 5), each
row's attention and top-k run on that row's own key list, and transcendental element-wise ops (SiLU, exp)
run in fixed tiles (`ops.tiled`), so a vectorised main loop and a scalar tail never split elements by
how many rows there are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dspark.formats.dsv4_config import Dsv4Geometry, Rope
from dspark.runtime.families.dsv4.hyper import HyperConnection, HyperHead
from dspark.runtime.families.dsv4.moe import MoE
from dspark.runtime.families.dsv4.ops import (
    apply_rope,
    int8_index_scores,
    ordered_sum,
    quantize_int8,
    rms_norm,
    row_linear,
    swiglu,
)

# --------------------------------------------------------------------------------------------------------
# Row-invariant primitives: `ops` (shared with the MoE and the hyper-connections).


def _attend(q: Tensor, keys: Tensor, sink: Tensor, scale: float) -> Tensor:
    """One row's attention: q [H, D] over keys [n, D] (also the values) plus a per-head sink logit [H]
    that takes probability and gives nothing back -> [H, D]."""
    scores = (q.unsqueeze(1) * keys).sum(-1) * scale  # [H, n]
    probs = torch.cat([scores, sink.unsqueeze(1)], dim=1).softmax(-1)[:, :-1]
    return (probs.unsqueeze(-1) * keys).sum(1)


# --------------------------------------------------------------------------------------------------------
# State


@dataclass(frozen=True)
class CompressorState:
    entries: Tensor  # [n_closed, d]: entry j pools block j = positions [j*r, (j+1)*r)
    open_kv: Tensor  # [P % r, coff*d]: projected values of the open block's positions so far
    open_score: Tensor  # [P % r, coff*d]: their gate logits, ape already added
    prev_kv: Tensor  # [r, d] (C4; [0, d] otherwise): first-half values of the last closed block, 0 before any
    prev_score: Tensor  # [r, d] (C4; [0, d] otherwise): its first-half gates, -inf before any block closed


@dataclass(frozen=True)
class LayerState:
    window_kv: Tensor  # [W, head_dim] ring: raw KV of position p in slot p % W (zeros never written)
    attn: CompressorState | None  # compressed entries the attention reads (ratio > 0)
    index: CompressorState | None  # the indexer's keys, as entries of its own compressor (C4 only)


@dataclass(frozen=True)
class DSV4State:
    length: int  # positions processed: the next row is at this position
    layers: tuple[LayerState, ...]

    def tensors(self) -> list[tuple[str, Tensor]]:
        out: list[tuple[str, Tensor]] = []
        for i, layer in enumerate(self.layers):
            out.append((f"layers.{i}.window_kv", layer.window_kv))
            for kind, comp in (("attn", layer.attn), ("index", layer.index)):
                if comp is not None:
                    for field in ("entries", "open_kv", "open_score", "prev_kv", "prev_score"):
                        out.append((f"layers.{i}.{kind}.{field}", getattr(comp, field)))
        return out

    def bitwise_equal(self, other: DSV4State) -> bool:
        mine, theirs = self.tensors(), other.tensors()
        if self.length != other.length or [n for n, _ in mine] != [n for n, _ in theirs]:
            return False
        pairs = zip(mine, theirs, strict=True)
        return all(a.shape == b.shape and torch.equal(a, b) for (_, a), (_, b) in pairs)


@dataclass(frozen=True)
class LayerRows:
    """What one layer's rows of a step write, before any is accepted."""

    kv: Tensor  # [L, head_dim] raw KV (RoPE'd) for the window ring
    attn: tuple[Tensor, Tensor] | None  # compressor values, gates (+ape) [L, coff*head_dim]
    index: tuple[Tensor, Tensor] | None  # indexer compressor values, gates (+ape) [L, 2*index_head_dim]


@dataclass(frozen=True)
class StepResult:
    start: int  # position of the step's first row
    logits: Tensor  # [L, vocab]: row i's prediction for position start + i + 1
    rows: tuple[LayerRows, ...]  # per layer, for commit
    state: DSV4State  # the state if every row is accepted


# --------------------------------------------------------------------------------------------------------
# Modules


class Compressor(nn.Module):
    """Turns each closed block of `ratio` positions into one entry of `out_dim` channels."""

    def __init__(self, dim: int, out_dim: int, ratio: int, overlap: bool, rope: Rope, eps: float) -> None:
        super().__init__()
        self.out_dim, self.ratio, self.overlap = out_dim, ratio, overlap
        self.rope, self.eps = rope, eps
        width = (2 if overlap else 1) * out_dim  # overlap: half for this block, half for the next one's
        self.wkv = nn.Parameter(torch.empty(width, dim))
        self.wgate = nn.Parameter(torch.empty(width, dim))
        self.ape = nn.Parameter(torch.empty(ratio, width))  # gate bias by position within the block
        self.norm = nn.Parameter(torch.empty(out_dim))

    def project(self, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        """x [L, dim] at positions pos [L] -> values, gates [L, width]."""
        return row_linear(x, self.wkv), row_linear(x, self.wgate) + self.ape[pos % self.ratio]

    def _finish(self, pooled: Tensor, block: Tensor) -> Tensor:
        # pooled [..., d], block [...] -> entry: normalised, rotated to the block's first position
        return apply_rope(rms_norm(pooled, self.norm, self.eps), block * self.ratio, self.rope)

    def init_state(self) -> CompressorState:
        d, r = self.out_dim, self.ratio
        width = self.wkv.shape[0]
        prev = r if self.overlap else 0
        return CompressorState(entries=torch.zeros(0, d), open_kv=torch.zeros(0, width),
                               open_score=torch.zeros(0, width), prev_kv=torch.zeros(prev, d),
                               prev_score=torch.full((prev, d), float("-inf")))

    def absorb(self, state: CompressorState, kv: Tensor, score: Tensor, start: int) -> CompressorState:
        """Feed rows at positions start .. start+L-1 (kv, score [L, width]) one at a time, closing a block
        at each row with (position + 1) % ratio == 0. The same code serves a step and a commit, so a block
        closed by a commit is pooled from exactly the tensors target-only decoding would pool."""
        d, r = self.out_dim, self.ratio
        entries, open_kv, open_score = state.entries, state.open_kv, state.open_score
        prev_kv, prev_score = state.prev_kv, state.prev_score
        for i in range(kv.shape[0]):
            open_kv = torch.cat([open_kv, kv[i : i + 1]])
            open_score = torch.cat([open_score, score[i : i + 1]])
            if (start + i + 1) % r:
                continue
            block_kv, block_score = open_kv, open_score  # [r, width]
            if self.overlap:
                block_kv = torch.cat([prev_kv, open_kv[:, d:]])  # [2r, d]
                block_score = torch.cat([prev_score, open_score[:, d:]])
                prev_kv, prev_score = open_kv[:, :d], open_score[:, :d]
            entry = self.pool_block(block_kv, block_score, (start + i + 1) // r - 1)
            entries = torch.cat([entries, entry.unsqueeze(0)])
            open_kv, open_score = open_kv[:0], open_score[:0]
        return CompressorState(entries, open_kv, open_score, prev_kv, prev_score)

    def pool_block(self, block_kv: Tensor, block_score: Tensor, block: int) -> Tensor:
        """Entry of block `block` from its pooled rows: values, gates [n, d] (n = r, or 2r with the overlap
        half of the previous block first) -> [d]. The one pooling every path (absorb, the paged runtime)
        calls, so they round alike."""
        pooled = (block_kv * block_score.softmax(0)).sum(0)  # [d]: per-channel softmax over positions
        return self._finish(pooled, torch.tensor(block))

    def close_block(self, block: int, kv: Tensor, score: Tensor, prev_kv: Tensor | None = None,
                    prev_score: Tensor | None = None) -> Tensor:
        """Entry of block `block` from its own projected rows kv, score [r, width] and, with the overlap,
        the previous block's rows prev_kv, prev_score [r, width] (None for block 0, which has none) -> [d].
        The rows as `project` returned them, e.g. read back from a cache keyed by position."""
        if self.overlap:
            d, r = self.out_dim, self.ratio
            if prev_kv is None or prev_score is None:
                prev_kv, prev_score = torch.zeros(r, d), torch.full((r, d), float("-inf"))
            else:
                prev_kv, prev_score = prev_kv[:, :d], prev_score[:, :d]
            kv, score = torch.cat([prev_kv, kv[:, d:]]), torch.cat([prev_score, score[:, d:]])
        return self.pool_block(kv, score, block)

    def full(self, x: Tensor) -> Tensor:
        """Reference: the entries of every closed block of a whole sequence x [T, dim] -> [T // r, d]."""
        d, r = self.out_dim, self.ratio
        n_blocks = x.shape[0] // r
        kv, score = self.project(x[: n_blocks * r], torch.arange(n_blocks * r))
        kv, score = kv.unflatten(0, (n_blocks, r)), score.unflatten(0, (n_blocks, r))  # [nb, r, width]
        if self.overlap:
            prev_kv = torch.cat([torch.zeros(1, r, d), kv[:-1, :, :d]])
            prev_score = torch.cat([torch.full((1, r, d), float("-inf")), score[:-1, :, :d]])
            kv = torch.cat([prev_kv, kv[:, :, d:]], dim=1)  # [nb, 2r, d]
            score = torch.cat([prev_score, score[:, :, d:]], dim=1)
        pooled = (kv * score.softmax(1)).sum(1)  # [nb, d]
        return self._finish(pooled, torch.arange(n_blocks))


class Indexer(nn.Module):
    """C4 layers: scores closed entries per row and picks the top-k the attention reads."""

    def __init__(self, cfg: Dsv4Geometry, rope: Rope) -> None:
        super().__init__()
        self.cfg, self.rope = cfg, rope
        self.wq_b = nn.Parameter(torch.empty(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank))
        self.weights_proj = nn.Parameter(torch.empty(cfg.index_n_heads, cfg.dim))
        self.compressor = Compressor(cfg.dim, cfg.index_head_dim, cfg.csa_ratio, True, rope, cfg.norm_eps)

    def query(self, x: Tensor, qr: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        """-> index queries [L, IH, ID] (RoPE'd), head weights [L, IH]."""
        cfg = self.cfg
        q = row_linear(qr, self.wq_b).unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))
        q = apply_rope(q, pos.unsqueeze(-1), self.rope)
        weights = row_linear(x, self.weights_proj) * (cfg.index_head_dim * cfg.index_n_heads) ** -0.5
        return q, weights

    def scores(self, q: Tensor, weights: Tensor, keys: Tensor) -> Tensor:
        """One row's scores of its closed index keys [n, ID] for its query q [IH, ID] and head weights [IH]
        -> [n]: sum_h w_h * relu(q_h . k), or with `index_quant` the same over int8 queries and keys
        (`ops.int8_index_scores`, as Ascend's quantised lightning indexer scores them)."""
        if self.cfg.index_quant:
            (q_codes, q_scale), (k_codes, k_scale) = quantize_int8(q), quantize_int8(keys)
            return int8_index_scores(q_codes, q_scale, k_codes, k_scale, weights)
        return ((q.unsqueeze(1) * keys).sum(-1).relu() * weights.unsqueeze(1)).sum(0)

    def select(self, q: Tensor, weights: Tensor, keys: Tensor) -> Tensor:
        """One row: q [IH, ID], weights [IH], its closed index keys [n, ID] -> chosen entry ids, ascending."""
        scores = self.scores(q, weights, keys)  # [n]
        # stable: equal scores (all heads' relu at 0 is common) go to the lower index, on every path
        top = torch.sort(scores, descending=True, stable=True).indices[: self.cfg.index_topk]
        return top.sort().values


Mixes = tuple[Tensor, Tensor]  # a sub-layer's hyper-connection post [L, n] and comb [L, n, n]


class DSV4Layer(nn.Module):
    def __init__(self, cfg: Dsv4Geometry, ratio: int, layer_id: int = 0) -> None:
        super().__init__()
        self.cfg, self.ratio = cfg, ratio
        self.rope = cfg.rope_for(ratio)
        h, d = cfg.n_heads, cfg.head_dim
        self.attn_norm = nn.Parameter(torch.empty(cfg.dim))
        self.wq_a = nn.Parameter(torch.empty(cfg.q_lora_rank, cfg.dim))
        self.q_norm = nn.Parameter(torch.empty(cfg.q_lora_rank))
        self.wq_b = nn.Parameter(torch.empty(h * d, cfg.q_lora_rank))
        self.wkv = nn.Parameter(torch.empty(d, cfg.dim))
        self.kv_norm = nn.Parameter(torch.empty(d))
        self.attn_sink = nn.Parameter(torch.empty(h))
        if cfg.o_groups:
            # each group of n_heads / o_groups heads to o_lora_rank channels, then all groups to dim
            self.wo_a = nn.Parameter(torch.empty(cfg.o_groups * cfg.o_lora_rank, h * d // cfg.o_groups))
            self.wo_b = nn.Parameter(torch.empty(cfg.dim, cfg.o_groups * cfg.o_lora_rank))
        else:
            self.wo = nn.Parameter(torch.empty(cfg.dim, h * d))
        self.ffn_norm = nn.Parameter(torch.empty(cfg.dim))
        self.ffn: MoE | None = None
        if cfg.ffn == "moe":
            self.ffn = MoE(dim=cfg.dim, inter_dim=cfg.inter_dim, n_experts=cfg.n_routed_experts,
                           topk=cfg.n_activated_experts, vocab_size=cfg.vocab_size,
                           hashed=cfg.is_hash_layer(layer_id), score_func=cfg.score_func,
                           route_scale=cfg.route_scale, swiglu_limit=cfg.swiglu_limit)
        else:
            self.w1 = nn.Parameter(torch.empty(cfg.inter_dim, cfg.dim))
            self.w3 = nn.Parameter(torch.empty(cfg.inter_dim, cfg.dim))
            self.w2 = nn.Parameter(torch.empty(cfg.dim, cfg.inter_dim))
        self.compressor = (Compressor(cfg.dim, d, ratio, ratio == cfg.csa_ratio, self.rope, cfg.norm_eps)
                           if ratio else None)
        self.indexer = Indexer(cfg, self.rope) if ratio == cfg.csa_ratio else None
        self.hc_attn = self.hc_ffn = None
        if cfg.hc_mult:
            self.hc_attn, self.hc_ffn = (
                HyperConnection(cfg.hc_mult, cfg.dim, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)
                for _ in range(2))
        # Tensor parallelism (`sharding.shard_dsv4_target`) keeps
        # `local_heads` of the query heads here (their wq_b rows, sinks and output-projection columns:
        # whole groups of wo_a) and a share of a dense MLP (w1 / w3 rows, w2 columns), and sets `partial_sum`
        # to what adds the output projection's and w2's partial products over the ranks. Whole: every head,
        # nothing to add.
        self.local_heads = h
        self.partial_sum: Callable[[Tensor], Tensor] | None = None

    # -- shared by every path -----------------------------------------------------------------------------
    def attn_input(self, h: Tensor) -> tuple[Tensor, Mixes | None]:
        """The residual h ([L, dim], or [L, hc_mult, dim] streams) -> the attention's normed input x [L, dim]
        and the hyper-connection mixes `output_rows` spreads its output with (None without)."""
        if self.hc_attn is None:
            return rms_norm(h, self.attn_norm, self.cfg.norm_eps), None
        pre, post, comb = self.hc_attn.mixes(h)
        return rms_norm(HyperConnection.collapse(h, pre), self.attn_norm, self.cfg.norm_eps), (post, comb)

    def _project(self, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [L, dim] -> queries [L, H, D], query latent qr [L, q_lora], raw KV [L, D]."""
        cfg = self.cfg
        qr = rms_norm(row_linear(x, self.wq_a), self.q_norm, cfg.norm_eps)
        q = row_linear(qr, self.wq_b).unflatten(-1, (self.local_heads, cfg.head_dim))
        q = apply_rope(rms_norm(q, None, cfg.norm_eps), pos.unsqueeze(-1), self.rope)
        return q, qr, self.project_kv(x, pos)

    def project_kv(self, x: Tensor, pos: Tensor) -> Tensor:
        """x [L, dim] at positions pos [L] -> the latent K=V [L, D], normalised and rotated."""
        return apply_rope(rms_norm(row_linear(x, self.wkv), self.kv_norm, self.cfg.norm_eps), pos, self.rope)

    def _whole(self, partial: Tensor) -> Tensor:
        return partial if self.partial_sum is None else self.partial_sum(partial)

    def output_projection(self, o: Tensor) -> Tensor:
        """This rank's heads' attention output o [L, H, D] (rotated back) -> its partial product [L, dim]."""
        if self.cfg.o_groups:
            groups = self.wo_a.shape[0] // self.cfg.o_lora_rank  # this rank's
            rank = self.cfg.o_lora_rank
            per_group = o.flatten(1).unflatten(-1, (groups, -1))  # [L, G, heads per group * D]
            low = torch.cat([row_linear(per_group[:, g], self.wo_a[g * rank : (g + 1) * rank])
                             for g in range(groups)], dim=-1)  # [L, G * o_lora_rank]
            return row_linear(low, self.wo_b)
        return row_linear(o.flatten(1), self.wo)

    def output_rows(self, h: Tensor, o: Tensor, tokens: Tensor | None = None, mixes: Mixes | None = None,
                    static_shapes: bool = False) -> Tensor:
        """h (the residual as `attn_input` took it), the attention output o [L, H, D] already rotated back,
        the rows' tokens [L] (hash-routed layers) and `attn_input`'s mixes -> the layer's output residual:
        the output projection and the FFN, each a sum over the ranks' partial products under tensor
        parallelism. `static_shapes` (device backends): no host reads and no shape set by the data, so a
        graph captures it."""
        attn = self._whole(self.output_projection(o))
        if self.hc_attn is None:
            h = h + attn
            return h + self.mlp_rows(rms_norm(h, self.ffn_norm, self.cfg.norm_eps), tokens, static_shapes)
        assert self.hc_ffn is not None and mixes is not None, "the attention's mixes come from attn_input"
        h = HyperConnection.expand(h, attn, *mixes)
        pre, post, comb = self.hc_ffn.mixes(h)
        x = rms_norm(HyperConnection.collapse(h, pre), self.ffn_norm, self.cfg.norm_eps)
        return HyperConnection.expand(h, self.mlp_rows(x, tokens, static_shapes), post, comb)

    def mlp_rows(self, x: Tensor, tokens: Tensor | None = None, static_shapes: bool = False) -> Tensor:
        """The FFN of normed rows x [L, dim] (tokens [L]: a hash-routed MoE's) -> [L, dim], summed over the
        ranks under tensor parallelism (a dense MLP's columns; the MoE's experts over the ranks under expert
        parallelism, else whole on every rank)."""
        if self.ffn is not None:
            return self.ffn(x, tokens, static_shapes)
        return self.dense_rows(x)

    def dense_rows(self, x: Tensor) -> Tensor:
        """The dense MLP of normed rows x [L, dim] -> [L, dim], its columns' partial products summed over the
        tensor-parallel ranks."""
        return self._whole(self.mlp_partial(x))

    def mlp_partial(self, x: Tensor) -> Tensor:
        """This rank's partial dense-MLP product of x [L, dim] (its w1/w3 columns, w2 rows) -> [L, dim]."""
        return row_linear(swiglu(row_linear(x, self.w1), row_linear(x, self.w3), self.cfg.swiglu_limit),
                          self.w2)

    # -- pieces for other paths (`cpu_paged`), the same math as step -------------------------------------
    def attn_inputs(self, h: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Mixes | None]:
        """h (residual) at positions pos [L] -> normed input x [L, dim], queries [L, H, D], query latent qr
        [L, q_lora], raw KV [L, D], and the hyper-connection mixes for `finish_rows`."""
        x, mixes = self.attn_input(h)
        return (x, *self._project(x, pos), mixes)

    def attend_row(self, q: Tensor, keys: Tensor) -> Tensor:
        """One row's attention, q [H, D] over its keys [n, D] (window raw KV in position order, then its
        compressed entries) with this layer's sink -> [H, D]."""
        return _attend(q, keys, self.attn_sink, self.cfg.head_dim**-0.5)

    def finish_rows(self, h: Tensor, o: Tensor, pos: Tensor, tokens: Tensor | None = None,
                    mixes: Mixes | None = None) -> Tensor:
        """h (residual), attention output o [L, H, D] -> the layer's output residual: V carried rotated
        channels, so o is rotated back by its row's own angle first."""
        o = apply_rope(o, pos.unsqueeze(-1), self.rope, inverse=True)
        return self.output_rows(h, o, tokens, mixes)

    # -- reference: the whole sequence, dense masks ----------------------------------------------------------
    def forward_full(self, h: Tensor, tokens: Tensor) -> Tensor:
        cfg = self.cfg
        n = tokens.shape[0]
        pos = torch.arange(n)
        x, mixes = self.attn_input(h)
        q, qr, kv = self._project(x, pos)
        scale = cfg.head_dim**-0.5
        raw_scores = torch.einsum("thd,sd->ths", q, kv) * scale  # [T, H, T]
        delta = pos.unsqueeze(1) - pos.unsqueeze(0)  # query minus key position
        raw_scores = raw_scores.masked_fill(((delta < 0) | (delta >= cfg.window)).unsqueeze(1), float("-inf"))
        entries = torch.zeros(0, cfg.head_dim)
        readable = torch.zeros(n, 0, dtype=torch.bool)
        if self.compressor is not None:
            entries = self.compressor.full(x)  # [nb, D]
            n_blocks = entries.shape[0]
            # block j closes at position (j+1)*r - 1
            readable = (torch.arange(n_blocks) + 1).unsqueeze(0) * self.ratio <= pos.unsqueeze(1) + 1
            if self.indexer is not None:
                keys = self.indexer.compressor.full(x)  # [nb, ID]
                iq, weights = self.indexer.query(x, qr, pos)
                if cfg.index_quant:
                    scores = torch.stack([self.indexer.scores(iq[t], weights[t], keys) for t in range(n)])
                else:
                    scores = (torch.einsum("thd,nd->thn", iq, keys).relu() * weights.unsqueeze(-1)).sum(1)
                scores = scores.masked_fill(~readable, float("-inf"))  # [T, nb]
                top = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : cfg.index_topk]
                chosen = torch.zeros_like(readable).scatter(1, top, True)
                readable = readable & chosen
        comp_scores = torch.einsum("thd,nd->thn", q, entries) * scale
        comp_scores = comp_scores.masked_fill(~readable.unsqueeze(1), float("-inf"))
        sink = self.attn_sink.view(1, -1, 1).expand(n, -1, 1)
        probs = torch.cat([raw_scores, comp_scores, sink], dim=-1).softmax(-1)
        o = (torch.einsum("ths,sd->thd", probs[..., :n], kv)
             + torch.einsum("thn,nd->thd", probs[..., n : n + entries.shape[0]], entries))
        return self.finish_rows(h, o, pos, tokens, mixes)

    # -- incremental: L rows at once against a state ------------------------------------------------------
    def init_state(self) -> LayerState:
        return LayerState(window_kv=torch.zeros(self.cfg.window, self.cfg.head_dim),
                          attn=None if self.compressor is None else self.compressor.init_state(),
                          index=None if self.indexer is None else self.indexer.compressor.init_state())

    def advance(self, state: LayerState, rows: LayerRows, start: int, n: int) -> LayerState:
        """The state after the first n of `rows` (positions start ..) are accepted."""
        window = self.cfg.window
        pos = torch.arange(start, start + n)
        keep = pos >= start + n - window  # older rows' slots are overwritten within these n anyway
        ring = state.window_kv.clone()
        ring[pos[keep] % window] = rows.kv[:n][keep]
        attn, index = state.attn, state.index
        if self.compressor is not None and rows.attn is not None and attn is not None:
            attn = self.compressor.absorb(attn, rows.attn[0][:n], rows.attn[1][:n], start)
        if self.indexer is not None and rows.index is not None and index is not None:
            index = self.indexer.compressor.absorb(index, rows.index[0][:n], rows.index[1][:n], start)
        return LayerState(ring, attn, index)

    def step(self, h: Tensor, state: LayerState, start: int, tokens: Tensor
             ) -> tuple[Tensor, LayerRows, LayerState]:
        cfg, window = self.cfg, self.cfg.window
        n_rows = tokens.shape[0]
        pos = torch.arange(start, start + n_rows)
        x, mixes = self.attn_input(h)
        q, qr, kv = self._project(x, pos)
        rows = LayerRows(kv=kv,
                         attn=None if self.compressor is None else self.compressor.project(x, pos),
                         index=None if self.indexer is None else self.indexer.compressor.project(x, pos))
        after = self.advance(state, rows, start, n_rows)
        iq, weights = (None, None) if self.indexer is None else self.indexer.query(x, qr, pos)
        outs = []
        for i in range(n_rows):
            p = start + i
            lo = max(0, p - window + 1)
            before = torch.arange(lo, max(lo, start))  # window positions written by earlier steps
            keys = [state.window_kv[before % window], kv[max(lo, start) - start : i + 1]]
            if after.attn is not None:
                # entries only append, so those row i may read are a prefix of those after the whole step
                n_closed = (p + 1) // self.ratio
                entries = after.attn.entries[:n_closed]
                if self.indexer is not None and after.index is not None and iq is not None:
                    assert weights is not None
                    entries = entries[self.indexer.select(iq[i], weights[i], after.index.entries[:n_closed])]
                keys.append(entries)
            outs.append(_attend(q[i], torch.cat(keys), self.attn_sink, cfg.head_dim**-0.5))
        return self.finish_rows(h, torch.stack(outs), pos, tokens, mixes), rows, after


@torch.no_grad()
def draw_weights_(module: nn.Module, gen: torch.Generator) -> None:
    """Random weights for `module`'s parameters, in order: norms near 1, sinks, positional biases and
    embeddings unit normal, every matrix scaled by 1/sqrt(its input width) (activations stay O(1))."""
    for name, param in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in leaf:
            param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
        elif leaf in ("attn_sink", "ape", "embed"):
            param.copy_(torch.randn(param.shape, generator=gen))
        else:
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)


class DSV4Model(nn.Module):
    """Embedding (copied into hc_mult streams), one DSV4Layer per compress ratio, the streams' collapse
    (hc_head), final RMSNorm, LM head; seeded random weights."""

    def __init__(self, cfg: Dsv4Geometry, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim))
        self.layers = nn.ModuleList(DSV4Layer(cfg, ratio, i) for i, ratio in enumerate(cfg.compress_ratios))
        self.final_norm = nn.Parameter(torch.empty(cfg.dim))
        self.head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim))
        self.hc_head = HyperHead(cfg.hc_mult, cfg.dim, cfg.hc_eps, cfg.norm_eps) if cfg.hc_mult else None
        # Tensor parallelism (`sharding.shard_dsv4_target`) replaces `embed`
        # and `head` with this rank's vocabulary rows behind a vocab-parallel embedding and LM head, which
        # `embed_tokens` and `lm_head` then call. None: the whole tables.
        self.vocab_embed: nn.Module | None = None
        self.vocab_head: nn.Module | None = None
        self.init_random_(seed)

    @torch.no_grad()
    def init_random_(self, seed: int) -> None:
        """Dummy weights scaled so activations and attention stay O(1) and the top-k has real choices."""
        gen = torch.Generator().manual_seed(seed)
        draw_weights_(self, gen)
        for layer in self.layers:
            gate = None if layer.ffn is None else layer.ffn.gate
            if gate is not None and gate.tid2eid is not None:  # each token's own distinct experts
                scores = torch.rand(gate.tid2eid.shape[0], layer.ffn.n_experts, generator=gen)
                gate.tid2eid.copy_(scores.argsort(-1)[:, : gate.tid2eid.shape[1]])

    @torch.no_grad()
    def forward_full(self, tokens: Tensor | list[int]) -> Tensor:
        """Reference: logits [T, vocab] of the whole sequence at once, causal semantics by masks."""
        tokens = _as_tokens(tokens)
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer.forward_full(h, tokens)
        return self.lm_head(h)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """tokens [L] -> the residual: rows [L, dim], or [L, hc_mult, dim] streams (copies) with
        hyper-connections."""
        h = self.embed[tokens] if self.vocab_embed is None else self.vocab_embed(tokens)
        if self.hc_head is None:
            return h
        return h.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()

    def draft_features(self, h: Tensor) -> Tensor:
        """A residual as a DSpark draft reads it -> [L, dim]: the rows, or the mean of the hyper-connection
        streams (as vLLM's DeepSeek-V4 hands its target layers to the DSpark stages), added in stream
        order."""
        if self.hc_head is None:
            return h
        return ordered_sum([h[:, j] for j in range(h.shape[1])]) / h.shape[1]

    def collapse(self, h: Tensor) -> Tensor:
        """The residual -> rows [L, dim]: the head's collapse of the streams (the rows themselves without)."""
        return h if self.hc_head is None else self.hc_head(h)

    def lm_head(self, h: Tensor) -> Tensor:
        """The last residual -> logits [L, vocab] (streams' collapse, final norm, row-invariant head)."""
        x = rms_norm(self.collapse(h), self.final_norm, self.cfg.norm_eps)
        return row_linear(x, self.head) if self.vocab_head is None else self.vocab_head(x)

    def init_state(self) -> DSV4State:
        return DSV4State(0, tuple(layer.init_state() for layer in self.layers))

    @torch.no_grad()
    def step(self, state: DSV4State, tokens: Tensor | list[int]) -> StepResult:
        """L rows at positions state.length .. + L - 1; the input state is left as it was."""
        tokens = _as_tokens(tokens)
        if tokens.numel() == 0:
            raise ValueError("step needs at least one token")
        h = self.embed_tokens(tokens)
        rows, layers = [], []
        for layer, layer_state in zip(self.layers, state.layers, strict=True):
            h, layer_rows, after = layer.step(h, layer_state, state.length, tokens)
            rows.append(layer_rows)
            layers.append(after)
        logits = self.lm_head(h)
        return StepResult(state.length, logits, tuple(rows),
                          DSV4State(state.length + tokens.numel(), tuple(layers)))

    def prefill(self, tokens: Tensor | list[int]) -> StepResult:
        """The prompt as one step from the empty state (bitwise what decoding it token by token gives)."""
        return self.step(self.init_state(), tokens)

    @torch.no_grad()
    def commit(self, before: DSV4State, result: StepResult, accepted: int) -> DSV4State:
        """The state after only the first `accepted` rows of `result` (a step run on `before`)."""
        n_rows = result.logits.shape[0]
        if result.start != before.length:
            raise ValueError(f"step started at position {result.start}, the state is at {before.length}")
        if not 0 <= accepted <= n_rows:
            raise ValueError(f"accepted must be in [0, {n_rows}] (got {accepted})")
        if accepted == n_rows:
            return result.state
        per_layer = zip(self.layers, before.layers, result.rows, strict=True)
        layers = tuple(layer.advance(layer_state, rows, before.length, accepted)
                       for layer, layer_state, rows in per_layer)
        return DSV4State(before.length + accepted, layers)


def _as_tokens(tokens: Tensor | list[int]) -> Tensor:
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be one sequence [L] (got shape {tuple(tokens.shape)})")
    return tokens
