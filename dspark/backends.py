"""The backends a deployment runs on and the attention each can run: shared by the spec and the runtime."""

from __future__ import annotations

# Each backend's attention implementations (`backend.attention`), its default first.
ATTENTION_BY_BACKEND: dict[str, tuple[str, ...]] = {
    "cpu": ("torch",),
    "cuda": ("triton", "flashinfer"),
    "ascend": ("fused_infer_attention",),
}
