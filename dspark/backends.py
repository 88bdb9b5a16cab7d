"""The backends a deployment runs on and the attention each can run: shared by the spec and the runtime."""

from __future__ import annotations

from dspark.formats.dsv4_config import DSV4_FAMILY

# Each backend's attention implementations (`backend.attention`), its default first.
ATTENTION_BY_BACKEND: dict[str, tuple[str, ...]] = {
    "cpu": ("torch",),
    "cuda": ("triton", "flashinfer"),
    "ascend": ("fused_infer_attention", "sparse_attn_sharedkv"),
}
# The implementations that run DeepSeek-V4's compressed sparse attention (on the CPU its torch model,
# on CUDA its Triton kernel, each under its backend's name); every other one runs the dense families only.
DSV4_ATTENTION = frozenset({"torch", "triton", "sparse_attn_sharedkv"})
DENSE_ATTENTION = frozenset({"torch", "triton", "flashinfer", "fused_infer_attention"})


def family_attention(kind: str, family: str) -> tuple[str, ...]:
    """The `backend.attention` values that run a `family` model on backend `kind`, its default first
    (empty where the family does not run on that backend)."""
    runs = DSV4_ATTENTION if family == DSV4_FAMILY else DENSE_ATTENTION
    return tuple(attention for attention in ATTENTION_BY_BACKEND[kind] if attention in runs)


def default_attention(kind: str, family: str) -> str:
    """The attention a `family` model runs on backend `kind` when the spec names none. Where the family
    does not run there (a spec the rules refuse), the backend's own default, so the rules can still
    read one."""
    return (family_attention(kind, family) or ATTENTION_BY_BACKEND[kind])[0]
