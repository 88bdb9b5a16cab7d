"""The engine on the published DSpark draft: a saved random-weight draft in the released layout next
to a saved random target decodes losslessly with gamma below the block size, its context holds the
target's states at `target_layer_ids`, and a draft swapped after compiling is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark.checkpoints.dspark_block_config import BlockDraftConfig
from dspark.compiler import build
from dspark.runtime.engine.requests import RequestError
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.models.checkpoint import save_target
from dspark.runtime.models.dspark_block_loader import init_block_draft, save_block_draft
from dspark.runtime.models.llama import LlamaConfig, LlamaForCausalLM
from dspark.runtime.package import load_package

TARGET = LlamaConfig(vocab_size=258, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_position_embeddings=512)


def draft_config(markov_rank: int = 8, layer_ids: tuple[int, ...] = (-1, 1)) -> BlockDraftConfig:
    return BlockDraftConfig(
        vocab_size=258, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, attention_bias=False, block_size=6,
        mask_token_id=256, target_layer_ids=layer_ids, num_target_layers=3, markov_rank=markov_rank,
        markov_head_type="gated", confidence_head=True, confidence_with_markov=True)


@pytest.fixture
def pair(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    save_target(tmp_path / "target", LlamaForCausalLM(TARGET).eval())
    save_block_draft(tmp_path / "draft", init_block_draft(draft_config(), seed=1, std=0.05))
    return tmp_path


def package(write_spec, root: Path, mode: str, gamma: int | None = 4) -> Path:
    verify = {"mode": mode} | ({"allow_no_cost_model": True} if mode == "compact" else {})
    spec = write_spec({"model": {"checkpoint": str(root / "target"), "geometry": None},
                       "draft": {"checkpoint": str(root / "draft"), "gamma": gamma},
                       "verify": verify, "serving": {"max_context_len": 256, "max_running_requests": 4}})
    out = root / f"pkg_{mode}"
    build(spec, out, force=True)
    return out


@pytest.mark.parametrize("mode", ["static", "cap-accept", "compact"])
def test_a_released_layout_draft_decodes_losslessly_below_its_block_size(write_spec, pair: Path,
                                                                         mode: str) -> None:
    pkg = load_package(package(write_spec, pair, mode))
    runtime = Runtime(pkg)
    assert runtime.plan.gamma == 4 and runtime.draft.cfg.block_size == 6
    assert runtime.models.capture == (0, 2)  # the embeddings and the stream after layer 1
    prompts = [[256, 1, 2, 3, 4], [256, 7, 8], [256, 100, 200, 250, 9, 9, 9]]
    expected, _ = runtime.generate(prompts, 20, target_only=True)
    got, stats = runtime.generate(prompts, 20)
    assert got == expected and stats.steps > 0


def test_the_draft_context_is_the_targets_states_at_its_layer_ids(write_spec, pair: Path) -> None:
    runtime = Runtime(load_package(package(write_spec, pair, "static")))
    written: list[tuple[torch.Tensor, torch.Tensor]] = []
    append = runtime.models.append_draft_context

    def spy(features: torch.Tensor, positions: torch.Tensor, *rest: torch.Tensor) -> None:
        written.append((features.clone(), positions.clone()))
        append(features, positions, *rest)

    runtime.models.append_draft_context = spy  # type: ignore[method-assign]
    prompt = [256, 5, 6, 7, 8, 9]
    out, _ = runtime.generate([prompt], 10)
    # prefill writes every prompt position; each verify step its root and accepted drafts
    features = torch.cat([f for f, _ in written])
    positions = torch.cat([p for _, p in written])
    assert positions.tolist() == list(range(len(prompt) + len(out[0]) - 1))
    with torch.no_grad():
        _, states = runtime.target.forward_dense_states(torch.tensor([prompt + out[0][:-1]]), capture=(0, 2))
    torch.testing.assert_close(features, states[0], rtol=1e-4, atol=1e-4)


def test_a_draft_changed_after_compiling_is_refused_naming_the_field(write_spec, pair: Path) -> None:
    pkg = load_package(package(write_spec, pair, "static", gamma=None))
    assert pkg.deployment.draft.gamma == 6  # the block size, read from the checkpoint
    save_block_draft(pair / "draft", init_block_draft(draft_config(markov_rank=16), seed=1))
    with pytest.raises(RequestError, match=r"markov_rank 16 \(compiled 8\)"):
        Runtime(pkg)
