"""The qwen3 family served end to end: the committed `specs/qwen3_tiny_cpu_compact.yaml` (dummy Qwen3
target with tied embeddings and a dummy draft) decodes greedily exactly as target-only decoding, in
every verify mode: with its dummy draft (random drafts, rejected) and with a scripted one (the target's
greedy continuation with an error at a shuffled slot), which the verifier accepts at every length
0 … gamma. The Qwen3 forward is row-invariant through prefill chunks, ragged verify steps and decode, and
the accepted drafts' KV and draft context are committed as the target's own, so speculation never changes
a token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.models.qwen3 import Qwen3ForCausalLM
from dspark.runtime.package import load_package

from .runtime_helpers import REPO, compile_variant
from .scripted_draft import assert_every_length, generate_scripted

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
    scripted = generate_scripted(rt, prompts, 16)
    assert scripted.outputs == reference
    assert_every_length(scripted, rt.plan.gamma)
    if mode == "compact":  # unsure past its wrong draft, the draft's rows there are cut: ragged and accepted
        assert scripted.stats.verify_rows < scripted.stats.request_steps * rt.plan.num_draft_tokens
