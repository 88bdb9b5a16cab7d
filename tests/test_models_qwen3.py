"""The qwen3 family served end to end: the committed `specs/qwen3_tiny_cpu_compact.yaml` (dummy Qwen3
target with tied embeddings and a dummy draft) decodes greedily exactly as target-only decoding, in
every verify mode. Acceptance is irrelevant here (random drafts); what is checked is that the Qwen3
forward is row-invariant through prefill chunks, ragged verify steps and decode, so speculation never
changes a token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.models.qwen3 import Qwen3ForCausalLM
from dspark.runtime.package import load_package

from .runtime_helpers import REPO, compile_variant

SPEC = "qwen3_tiny_cpu_compact.yaml"
PROMPTS = ["def main(", "import os\n", "class Parser:\n    def __init__(self", "x", "for i in range(10):\n",
           "# A tiny Qwen3 with random weights"]


def runtime(mode: str, tmp_path: Path) -> Runtime:
    if mode == "compact":  # the committed package itself
        return Runtime(load_package(REPO / "generated" / "qwen3_tiny_cpu_compact"))
    overrides = {"verify": {"mode": mode}, **({"cost_model": None} if mode == "static" else {})}
    name = f"qwen3_tiny_{mode.replace('-', '_')}"
    return Runtime(load_package(compile_variant(tmp_path, SPEC, overrides, name)))


def test_the_committed_package_serves_a_qwen3_target() -> None:
    rt = runtime("compact", Path())
    assert rt.deployment.model.family == "qwen3"
    assert isinstance(rt.target, Qwen3ForCausalLM)
    assert rt.target.lm_head.weight is rt.target.model.embed_tokens.weight  # tie_word_embeddings: true
    assert rt.target.cfg.head_dim * rt.target.cfg.num_heads != rt.target.cfg.hidden_size


@pytest.mark.parametrize("mode", ["static", "cap-accept", "compact"])
def test_greedy_speculative_equals_target_only(mode: str, tmp_path: Path) -> None:
    rt = runtime(mode, tmp_path)
    prompts = [rt.package.tokenizer.encode(p) for p in PROMPTS]
    reference, _ = rt.generate(prompts, 16, target_only=True)
    speculative, stats = rt.generate(prompts, 16)
    assert speculative == reference
    assert all(len(out) == 16 or not out for out in reference)  # max_new_tokens, or an early EOS
    if mode == "compact":  # the committed cost table makes the planner cut rows: ragged steps ran
        assert stats.verify_rows < stats.request_steps * rt.plan.num_draft_tokens
