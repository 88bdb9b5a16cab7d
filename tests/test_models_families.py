"""Target families are a registry, not a template choice: the generated package names its family
(`DEPLOYMENT.model.family`) and the runtime builds that family's model, so adding a dense family touches
no template (DeepSeek-V4, whose caches are not paged K/V, has its own attention templates)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dspark.formats.hf_config import FAMILIES
from dspark.runtime.config import MODEL_FAMILIES, ModelGeometry
from dspark.runtime.models.dummy import dummy_target
from dspark.runtime.models.families import TARGET_MODELS, target_model_class

TEMPLATES = Path(__file__).resolve().parents[1] / "dspark" / "templates"
GEOMETRY = ModelGeometry(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True)


def test_every_family_the_compiler_reads_has_a_model() -> None:
    assert set(TARGET_MODELS) == set(MODEL_FAMILIES) == {*FAMILIES, "dsv4"}
    with pytest.raises(ValueError, match="not one of llama, qwen3, dsv4"):
        target_model_class("deepseek_v4")


def test_no_template_names_a_family() -> None:
    for template in TEMPLATES.rglob("*.j2"):
        text = template.read_text()
        for family in FAMILIES:
            assert not re.search(family, text, re.IGNORECASE), (template, family)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dummy_weights_build_each_family(family: str) -> None:
    model = dummy_target(GEOMETRY, torch.float32, torch.device("cpu"), family)
    assert type(model) is target_model_class(family)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    norms = {name for name in model.state_dict() if name.endswith(("q_norm.weight", "k_norm.weight"))}
    assert bool(norms) == (family == "qwen3")
    with torch.no_grad():
        logits = model.dense_logits(model.forward_dense(torch.tensor([[1, 2, 3]])))
    assert logits.shape == (1, 3, GEOMETRY.vocab_size) and torch.isfinite(logits).all()
