"""The dsv4 family served end to end from its generated packages (specs/dsv4_tiny_cpu_*.yaml), in every verify
mode: target-only decoding over the paged caches equals the reference model's own greedy decoding, greedy
speculative output equals target-only output, and with scripted drafts (the target's own greedy continuation
with one error injected at a shuffled slot, or none) every acceptance length occurs across C4 and C16 block
boundaries, rejected suffixes rolled back by overwriting, and the output is still target-only's, token for
token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package

from .scripted_draft import assert_every_length, generate_scripted

REPO = Path(__file__).resolve().parents[1]
MODES = ("static", "cap_accept", "compact")
NEW_TOKENS = 24
# 70 rows need two prefill chunks (64 tokens a step); 3 and 19 end just before a C4 / C16 boundary.
PROMPT_LENS = (70, 3, 19)


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, min(vocab, 256), (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=MODES)
def runtime(request: pytest.FixtureRequest) -> Runtime:
    return Runtime(load_package(REPO / "generated" / f"dsv4_tiny_cpu_{request.param}"))


def reference(rt: Runtime, prompt: list[int], steps: int) -> list[int]:
    """The reference model's greedy continuation (its own incremental state, no paging), cut as the engine
    cuts an output at EOS."""
    seq = rt.target.greedy_continue(torch.tensor([prompt]), steps)[0, len(prompt):].tolist()
    eos = rt.package.tokenizer.eos_ids
    return next((seq[:i] for i, t in enumerate(seq) if t in eos), seq)


def test_target_only_serving_is_the_reference_greedy_decoding(runtime: Runtime) -> None:
    ps = prompts(runtime.target.cfg.vocab_size)
    out, _ = runtime.generate(ps, NEW_TOKENS, target_only=True)
    assert out == [reference(runtime, p, NEW_TOKENS) for p in ps]


def test_greedy_speculative_output_equals_target_only(runtime: Runtime) -> None:
    ps = prompts(runtime.target.cfg.vocab_size)
    want, _ = runtime.generate(ps, NEW_TOKENS, target_only=True)
    got, stats = runtime.generate(ps, NEW_TOKENS)
    assert got == want
    assert stats.steps > 0


def test_scripted_drafts_hit_every_acceptance_length(runtime: Runtime) -> None:
    """The draft proposes the target's greedy continuation with an error at a shuffled slot (or none): the
    verify steps accept every length 0 .. gamma and reject a draft at every slot, close compressed blocks
    for drafts then rejected, and the output is target-only's."""
    rt = runtime
    ps = prompts(rt.target.cfg.vocab_size)
    want, _ = rt.generate(ps, NEW_TOKENS, target_only=True)
    run = generate_scripted(rt, ps, NEW_TOKENS, seed=5)
    assert run.outputs == want
    assert_every_length(run, rt.plan.gamma)
    # scripted drafts are accepted: far fewer steps than tokens
    assert run.stats.steps < sum(len(o) for o in want) / 2
