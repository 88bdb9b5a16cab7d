"""Llama-family target model: RMSNorm, RoPE, SwiGLU, grouped-query attention.

Parameter names follow the Hugging Face Llama layout, so a `config.json` + safetensors
directory loads without renaming. Two forward paths share the weights:

* `forward_dense` — batched, causal, for training and evaluation;
* `forward_paged` — ragged rows against a paged KV cache, for serving; attention goes through
  an attention backend that owns the cache and reads the metadata the generated module built.
"""

from __future__ import annotations

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


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)

    def forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      cache: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Causal attention over `[b, t]` rows. With `cache` (a `[k, v]` pair, appended to in
        place) the rows follow the cached ones: one new row per call attends to all of them."""
        b, t, _ = x.shape
        c = self.cfg
        q = ops.apply_rope(self.q_proj(x).view(b, t, c.num_heads, c.head_dim), cos, sin).transpose(1, 2)
        k = ops.apply_rope(self.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim), cos, sin).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        causal = True
        if cache is not None:
            if cache:
                if t != 1:
                    raise ValueError("a cached dense forward appends one row at a time")
                k, v = torch.cat((cache[0], k), dim=2), torch.cat((cache[1], v), dim=2)
                causal = False
            cache[:] = [k, v]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                             enable_gqa=c.num_heads != c.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward_paged(self, layer_id: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      attn: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        c = self.cfg
        q = ops.apply_rope(ops.linear(x, self.q_proj.weight).view(t, c.num_heads, c.head_dim), cos, sin)
        k = ops.apply_rope(ops.linear(x, self.k_proj.weight).view(t, c.num_kv_heads, c.head_dim), cos, sin)
        v = ops.linear(x, self.v_proj.weight).view(t, c.num_kv_heads, c.head_dim)
        out = attn.attend(layer_id, q, k, v, meta)
        return ops.linear(out.reshape(t, -1), self.o_proj.weight)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_paged(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(ops.linear(x, self.gate_proj.weight)) * ops.linear(x, self.up_proj.weight)
        return ops.linear(h, self.down_proj.weight)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaBackbone(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward_dense(self, input_ids: torch.Tensor, cache: list[list[torch.Tensor]] | None = None,
                      start: int = 0) -> torch.Tensor:
        """Causal forward over `[b, t]` tokens at positions `start …`; returns the last layer's
        residual stream `[b, t, d]`. `cache` (one `[k, v]` per layer) enables incremental decoding."""
        c = self.cfg
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        cos, sin = ops.rope_cos_sin(positions, c.head_dim, c.rope_theta)
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            layer_cache = cache[i] if cache is not None else None
            x = x + layer.self_attn.forward_dense(layer.input_layernorm(x), cos, sin, layer_cache)
            x = x + layer.mlp.forward_dense(layer.post_attention_layernorm(x))
        return x

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
        return self.lm_head(self.model.norm(hidden))

    @torch.inference_mode()
    def forward_paged(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      attn: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        """Ragged forward over `[T]` rows; returns the last layer's residual stream `[T, d]`.

        The residual stream (before the final norm) is also what the DSpark draft conditions on.
        """
        c = self.cfg
        cos, sin = ops.rope_cos_sin(positions, c.head_dim, c.rope_theta)
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = x + layer.self_attn.forward_paged(i, layer.input_layernorm(x), cos, sin, attn, meta)
            x = x + layer.mlp.forward_paged(layer.post_attention_layernorm(x))
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return ops.linear(self.model.norm(hidden), self.lm_head.weight)
