"""The backends a deployment runs on and the attention each can run: shared by the spec and the runtime."""

from __future__ import annotations

from dspark.families import ModelFamily

# Each backend's attention implementations (`backend.attention`), its default first.
ATTENTION_BY_BACKEND: dict[str, tuple[str, ...]] = {
    "cpu": ("torch",),
    "cuda": ("triton", "flashinfer"),
    "ascend": ("fused_infer_attention", "sparse_attn_sharedkv"),
}


def family_attention(kind: str, family: str) -> tuple[str, ...]:
    """The `backend.attention` values that run a `family` model on backend `kind`, its default first
    (empty where the family does not run on that backend)."""
    runs = ModelFamily(family).attentions
    return tuple(attention for attention in ATTENTION_BY_BACKEND[kind] if attention in runs)


def default_attention(kind: str, family: str) -> str:
    """The attention a `family` model runs on backend `kind` when the spec names none. Where the family
    does not run there (a spec the rules refuse), the backend's own default, so the rules can still
    read one."""
    return (family_attention(kind, family) or ATTENTION_BY_BACKEND[kind])[0]
