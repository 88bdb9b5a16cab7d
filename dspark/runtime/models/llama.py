"""Llama-family target model: RMSNorm, RoPE, SwiGLU, grouped-query attention.

Parameter names follow the Hugging Face Llama layout, so a `config.json` + safetensors
directory loads without renaming. The config (`ModelGeometry`) says what else changes the
computation: RoPE scaling, tied embeddings, projection biases. Two forward paths share the weights:

* `forward_dense` — batched, causal, for training and evaluation;
* `forward_paged` — ragged rows against a paged KV cache, for serving; attention goes through
  an attention backend that owns the cache and reads the metadata the generated module built.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dspark.runtime.attention.metadata import AttentionBackend, AttentionMetadata
from dspark.runtime.config import ModelGeometry
from dspark.runtime.models import ops

# The model's config is the deployment geometry itself (HF config.json <-> ModelGeometry).
LlamaConfig = ModelGeometry


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def paged_linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """`layer(x)` through the row-invariant product (`ops.linear`). A tensor-parallel shard of the
    layer (`dspark.runtime.distributed.tensor_parallel`) runs its own forward, which takes its local
    product the same way and adds its collective."""
    if isinstance(layer, nn.Linear):
        return ops.linear(x, layer.weight, layer.bias)
    return layer(x)


def paged_linears(x: torch.Tensor, *layers: nn.Module) -> tuple[torch.Tensor, ...]:
    """`paged_linear` for several layers read from the same rows, as one product where all are plain
    (`ops.linear_many`); a tensor-parallel shard runs its own forward."""
    if all(isinstance(layer, nn.Linear) for layer in layers):
        return ops.linear_many(x, [layer.weight for layer in layers], [layer.bias for layer in layers])
    return tuple(paged_linear(x, layer) for layer in layers)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # The heads this module computes: the config's, or this rank's share under tensor parallelism
        # (`shard_dense_target` lowers them with the projections).
        self.local_num_heads = cfg.num_heads
        self.local_num_kv_heads = cfg.num_kv_heads
        d, hd, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=bias)

    def qk_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a family does to the query and key heads `[..., H, D]` before RoPE: nothing in Llama
        (Qwen3 normalises each head)."""
        return q, k

    def forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      cache: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Causal attention over `[b, t]` rows. With `cache` (a `[k, v]` pair, appended to in
        place) the rows follow the cached ones: one new row per call attends to all of them."""
        b, t, _ = x.shape
        h, h_kv, hd = self.local_num_heads, self.local_num_kv_heads, self.cfg.head_dim
        q, k = self.qk_heads(self.q_proj(x).view(b, t, h, hd), self.k_proj(x).view(b, t, h_kv, hd))
        q = ops.apply_rope(q, cos, sin).transpose(1, 2)  # [b, H, t, D]
        k = ops.apply_rope(k, cos, sin).transpose(1, 2)  # [b, Hkv, t, D]
        v = self.v_proj(x).view(b, t, h_kv, hd).transpose(1, 2)
        causal = True
        if cache is not None:
            if cache:
                if t != 1:
                    raise ValueError("a cached dense forward appends one row at a time")
                k, v = torch.cat((cache[0], k), dim=2), torch.cat((cache[1], v), dim=2)
                causal = False
            cache[:] = [k, v]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=h != h_kv)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward_paged(self, layer_id: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      attn: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        h, h_kv, hd = self.local_num_heads, self.local_num_kv_heads, self.cfg.head_dim
        q, k, v = paged_linears(x, self.q_proj, self.k_proj, self.v_proj)
        q, k = self.qk_heads(q.reshape(t, h, hd), k.reshape(t, h_kv, hd))
        q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)  # [T, H | Hkv, D]
        v = v.reshape(t, h_kv, hd)
        out = attn.attend(layer_id, q, k, v, meta)  # [T, H, D]
        return paged_linear(out.reshape(t, -1), self.o_proj)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        d, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(d, i, bias=bias)
        self.up_proj = nn.Linear(d, i, bias=bias)
        self.down_proj = nn.Linear(i, d, bias=bias)

    def forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_paged(self, x: torch.Tensor) -> torch.Tensor:
        # lanewise: a width off the CPU's vector lanes (a tensor-parallel shard's, say) would otherwise
        # round a row's SiLU differently with the rows beside it
        gate, up = paged_linears(x, self.gate_proj, self.up_proj)
        h = ops.lanewise(F.silu, gate) * up
        return paged_linear(h, self.down_proj)


class LlamaDecoderLayer(nn.Module):
    attention_class: type[LlamaAttention] = LlamaAttention  # a family's own attention (Qwen3's)

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = self.attention_class(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaBackbone(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_class: type[LlamaDecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_class(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _Captured:
    """The residual streams a forward keeps: after `n` decoder layers for each `n` in `capture`."""

    def __init__(self, capture: Sequence[int], num_layers: int, embeddings: torch.Tensor) -> None:
        bad = [n for n in capture if not 0 <= n <= num_layers]
        if bad:
            raise ValueError(f"cannot capture the residual stream after {bad} layers of a {num_layers}-layer "
                             "model (0 is the embeddings)")
        self.capture = tuple(capture)
        self.kept: dict[int, torch.Tensor] = {}
        self.after(0, embeddings)

    def after(self, layers: int, x: torch.Tensor) -> None:
        if layers in self.capture:
            self.kept[layers] = x

    def states(self) -> torch.Tensor | None:
        return torch.cat([self.kept[n] for n in self.capture], dim=-1) if self.capture else None


class LlamaForCausalLM(nn.Module):
    """The target model the runtime serves (`dspark.runtime.models.families.TargetModel`)."""

    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # The attention heads of this process's shard, what its KV cache and attention backend are
        # sized for: the config's, until `shard_dense_target` splits them across tensor-parallel ranks.
        self.local_num_heads = cfg.num_heads
        self.local_num_kv_heads = cfg.num_kv_heads
        self.model = LlamaBackbone(cfg, self.layer_class)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # [V, d], one tensor for both

    @property
    def tied_weights(self) -> tuple[str, ...]:
        """State-dict keys that alias another (checkpoints leave them out, as transformers does)."""
        return ("lm_head.weight",) if self.cfg.tie_word_embeddings else ()

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables `[..., T, head_dim]` for `positions`, with the config's RoPE scaling."""
        c = self.cfg
        return ops.rope_cos_sin(positions, c.head_dim, c.rope_theta, c.rope_scaling)

    def forward_dense(self, input_ids: torch.Tensor, cache: list[list[torch.Tensor]] | None = None,
                      start: int = 0) -> torch.Tensor:
        """Causal forward over `[b, t]` tokens at positions `start …`; returns the last layer's
        residual stream `[b, t, d]`. `cache` (one `[k, v]` per layer) enables incremental decoding."""
        return self.forward_dense_states(input_ids, cache, start)[0]

    def forward_dense_states(self, input_ids: torch.Tensor, cache: list[list[torch.Tensor]] | None = None,
                             start: int = 0, capture: Sequence[int] = ()
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward_dense` that also returns the residual streams after `capture` layers (see
        `capture_states`), concatenated `[b, t, len(capture) · d]`; None without `capture`."""
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        cos, sin = self.rope(positions)
        x = self.model.embed_tokens(input_ids)  # [b, t, d]
        kept = _Captured(capture, len(self.model.layers), x)
        for i, layer in enumerate(self.model.layers):
            layer_cache = cache[i] if cache is not None else None
            x = x + layer.self_attn.forward_dense(layer.input_layernorm(x), cos, sin, layer_cache)
            x = x + layer.mlp.forward_dense(layer.post_attention_layernorm(x))
            kept.after(i + 1, x)
        return x, kept.states()

    @torch.no_grad()
    def greedy_continue(self, prompts: torch.Tensor, steps: int) -> torch.Tensor:
        """`[b, P + steps]`: the prompts followed by their greedy continuations (dense KV cache)."""
        cache: list[list[torch.Tensor]] = [[] for _ in self.model.layers]
        hidden = self.forward_dense(prompts, cache)
        out = [prompts]
        for i in range(steps):
            nxt = self.dense_logits(hidden[:, -1:]).argmax(-1)
            out.append(nxt)
            if i + 1 < steps:
                hidden = self.forward_dense(nxt, cache, start=prompts.shape[1] + i)
        return torch.cat(out, dim=1)

    def dense_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., V]` logits of residual-stream rows (the final norm, then the LM head)."""
        return self.lm_head(self.model.norm(hidden))

    @torch.inference_mode()
    def forward_paged(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      attn: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        """Ragged forward over `[T]` rows; returns the last layer's residual stream `[T, d]`.

        The residual stream (before the final norm) is also what the DSpark draft conditions on.
        """
        return self.forward_paged_states(input_ids, positions, attn, meta)[0]

    @torch.inference_mode()
    def forward_paged_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                             meta: AttentionMetadata, capture: Sequence[int] = ()
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward_paged` that also returns the residual streams after `capture` layers, what a
        draft reading several target layers conditions on: `capture[j] = n` is the stream after
        n decoder layers (0: the embeddings; before any final norm), concatenated in `capture`'s
        order `[T, len(capture) · d]`; None without `capture`."""
        cos, sin = self.rope(positions)
        x = self.model.embed_tokens(input_ids)  # [T, d]
        kept = _Captured(capture, len(self.model.layers), x)
        for i, layer in enumerate(self.model.layers):
            x = x + layer.self_attn.forward_paged(i, layer.input_layernorm(x), cos, sin, attn, meta)
            x = x + layer.mlp.forward_paged(layer.post_attention_layernorm(x))
            kept.after(i + 1, x)
        return x, kept.states()

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[T, V]` logits of `[T, d]` residual-stream rows, row-invariant (`ops.linear`); whole on
        every rank when the LM head is split by vocabulary."""
        return paged_linear(self.model.norm(hidden), self.lm_head)
