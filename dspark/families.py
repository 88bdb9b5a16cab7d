"""The target model families dspark serves. The spec reads `model.family` once into a `ModelFamily` (as it
reads `verify.mode` into a `VerifyMode`), and code outside a family asks the family what it needs (which
attention implementations run it, which templates plan its metadata, its config.json's model_type, whether
it has experts to split) instead of comparing names. No torch: the compiler and the runtime both import it.

Where a class differs by family (the spec's geometry section, the runtime's target model, the compiler's
attention code, the engine's `FamilyRuntime`), its module keeps a table keyed by every family.
"""

from __future__ import annotations

from enum import Enum

from dspark.formats.dsv4_hf_config import DSV4_MODEL_TYPE
from dspark.formats.hf_config import FAMILIES as DENSE_CONFIGS

# The `backend.attention` implementations that run each kind of attention (on the CPU its torch model, on
# CUDA the Triton kernel, each under its backend's name): dense paged attention, and DeepSeek-V4's
# compressed sparse attention.
DENSE_ATTENTION = frozenset({"torch", "triton", "flashinfer", "fused_infer_attention"})
DSV4_ATTENTION = frozenset({"torch", "triton", "sparse_attn_sharedkv"})


class ModelFamily(str, Enum):
    """- `llama`, `qwen3`: dense decoders (one paged K/V cache per layer, a dense MLP), read from Hugging
      Face checkpoints (`dspark.formats.hf_config`), served by `dspark.runtime.models`.
    - `dsv4`: DeepSeek-V4 (compressed sparse attention, routed experts, hyper-connections), its own home
      `dspark.runtime.families.dsv4` (docs/dsv4.md).
    """

    LLAMA = "llama"
    QWEN3 = "qwen3"
    DSV4 = "dsv4"

    def __str__(self) -> str:
        return self.value

    @property
    def dense(self) -> bool:
        """A dense decoder: the shared model code, K/V cache, attention backends and templates."""
        return self is not ModelFamily.DSV4

    @property
    def attentions(self) -> frozenset[str]:
        """The `backend.attention` implementations (on any backend) that run this family."""
        return DENSE_ATTENTION if self.dense else DSV4_ATTENTION

    @property
    def template_folder(self) -> str | None:
        """The family's own metadata templates (one for every backend: they plan the same arrays), or None
        where each attention implementation's folder has them."""
        return None if self.dense else self.value

    @property
    def model_type(self) -> str:
        """config.json's `model_type` for this family."""
        return DENSE_CONFIGS[self.value].model_type if self.dense else DSV4_MODEL_TYPE

    @property
    def has_experts(self) -> bool:
        """Routed experts, which `parallelism.ep` may split over the ranks."""
        return self is ModelFamily.DSV4

    @property
    def exports_to_sglang(self) -> bool:
        """Whether `dspark-compile export-sglang` covers it (SGLang drafts DeepSeek-V4 with its own stages
        and flags dspark does not produce)."""
        return self.dense

    @classmethod
    def of_model_type(cls, model_type: str) -> ModelFamily | None:
        """The family whose checkpoints carry this config.json `model_type` (None: none of dspark's)."""
        return next((family for family in cls if family.model_type == model_type), None)


MODEL_FAMILIES = tuple(family.value for family in ModelFamily)
DENSE_FAMILIES = tuple(family.value for family in ModelFamily if family.dense)
assert set(DENSE_FAMILIES) == set(DENSE_CONFIGS), "every dense config reader is a family"
