"""The model family is read once (`dspark.families.ModelFamily`): the spec's `model.family` parses into it, a
generated deployment's `ModelRef` reads it back from its value, and every table that holds a per-family class
covers every family; the enum answers what code outside a family asks, without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dspark.backends import family_attention
from dspark.families import MODEL_FAMILIES, ModelFamily
from dspark.spec import load_spec

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("spec", "family"), [("tiny_cpu_compact", ModelFamily.LLAMA),
                                                ("qwen3_tiny_cpu_compact", ModelFamily.QWEN3),
                                                ("dsv4_tiny_cpu_compact", ModelFamily.DSV4)])
def test_the_spec_and_the_package_read_the_family_once(spec: str, family: ModelFamily) -> None:
    from dspark.runtime.package import load_package

    resolved = load_spec(REPO / "specs" / f"{spec}.yaml")
    assert resolved.spec.model.family is family
    deployment = load_package(REPO / "generated" / spec).deployment
    assert deployment.model.family is family  # written as its value, read back into the family
    assert f"family={family.value!r}" in (REPO / "generated" / spec / "deployment.py").read_text()


def test_the_family_answers_what_code_outside_it_asks() -> None:
    assert [f.dense for f in ModelFamily] == [True, True, False]
    assert ModelFamily.of_model_type("deepseek_v4") is ModelFamily.DSV4
    assert ModelFamily.of_model_type("qwen3") is ModelFamily.QWEN3
    assert ModelFamily.of_model_type("gpt2") is None
    assert ModelFamily.DSV4.template_folder == "dsv4" and ModelFamily.LLAMA.template_folder is None
    assert family_attention("ascend", "dsv4") == ("sparse_attn_sharedkv",)
    assert family_attention("cuda", "qwen3") == ("triton", "flashinfer")
    assert [f.has_experts for f in ModelFamily] == [False, False, True]
    assert MODEL_FAMILIES == ("llama", "qwen3", "dsv4")


def test_every_per_family_table_covers_every_family() -> None:
    from dspark.compiler.context import ATTENTION_CODE
    from dspark.runtime.engine.families import FAMILY_RUNTIMES
    from dspark.runtime.models.families import TARGET_MODELS
    from dspark.spec.facts import GEOMETRY_SECTIONS

    for table in (ATTENTION_CODE, FAMILY_RUNTIMES, TARGET_MODELS, GEOMETRY_SECTIONS):
        assert set(table) == set(ModelFamily)


def test_the_family_imports_no_torch() -> None:
    code = "import sys, dspark.families\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
