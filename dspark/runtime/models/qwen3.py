"""Qwen3 dense target model: a Llama decoder whose attention RMS-normalises every query and key
head (over its `head_dim` features, one learned scale per feature shared by all heads) before RoPE.

Everything else — SwiGLU MLP without bias, GQA, pre-norm residual blocks, tied or untied LM head,
RoPE theta and scaling — is the Llama computation of `llama.py`, configured by the same
`ModelGeometry` (`dspark.formats.hf_config` reads Qwen3's config.json: head_dim defaults to 128
there, and sliding-window layers are refused). Tensor names are those of the released checkpoints:
`model.layers.N.self_attn.{q,k}_norm.weight` beside the Llama names.
"""

from __future__ import annotations

import torch

from dspark.runtime.config import ModelGeometry
from dspark.runtime.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, RMSNorm

Qwen3Config = ModelGeometry


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)  # weight [D]
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)  # weight [D]

    def qk_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q [..., H, D], k [..., Hkv, D]: each head normalised on its own, so each row's result is
        # its own (batch-invariant like every row-wise operation here)
        return self.q_norm(q), self.k_norm(k)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3DecoderLayer
