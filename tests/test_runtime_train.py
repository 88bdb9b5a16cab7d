"""The embedded pair's training command end to end at a toy budget, and checkpoint round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dspark.checkpoints.dspark_block_config import default_layer_ids
from dspark.runtime.models.checkpoint import CheckpointError, load_target
from dspark.runtime.models.dspark_block_loader import load_block_draft
from dspark.train.draft import DraftTrainSettings
from dspark.train.tiny import TARGET_CONFIG, TrainSettings, corpus_files, train_tiny


def test_held_out_split_is_deterministic_and_disjoint() -> None:
    train, held = corpus_files()
    assert held and train
    assert not set(train) & set(held)
    assert corpus_files() == (train, held)


@pytest.mark.slow
def test_train_tiny_writes_loadable_hf_layout_checkpoints(tmp_path: Path) -> None:
    draft_settings = DraftTrainSettings(steps=2, batch_size=2, anchors_per_seq=4, continuation_tokens=8,
                                        num_layers=1, markov_head_type="rnn", train_lm_head=True)
    settings = TrainSettings(target_steps=2, seq_len=64, batch_size=2, target_short_seq_len=32,
                             eval_windows=2, draft_prompts=4, draft=draft_settings)
    report = train_tiny(tmp_path, settings, log=lambda _: None)
    assert report["held_out_bits_per_byte"] > 0
    target = load_target(str(tmp_path / "target"))
    draft = load_block_draft(tmp_path / "draft")
    cfg = json.loads((tmp_path / "target" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == 2
    assert "model.layers.0.self_attn.q_proj.weight" in target.state_dict()
    assert draft.cfg.block_size == 7 and draft.cfg.hidden_size == target.cfg.hidden_size
    assert draft.cfg.target_layer_ids == default_layer_ids(TARGET_CONFIG.num_layers) == (1, 2, 3, 4, 5)
    assert draft.cfg.mask_token_id == 256
    assert "dspark train-draft" in report["draft"]["command"]
    with torch.no_grad():
        assert target.forward_dense(torch.tensor([[256, 100, 101]])).shape == (1, 3, 256)


def test_missing_checkpoint_names_the_spec_field(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="model.checkpoint"):
        load_target(str(tmp_path / "nowhere"))


def test_greedy_continue_with_dense_cache_matches_full_recompute() -> None:
    from dspark.runtime.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(TARGET_CONFIG).eval()
    prompts = torch.randint(0, 256, (2, 9))
    fast = model.greedy_continue(prompts, 6)
    slow = prompts
    with torch.no_grad():
        for _ in range(6):
            nxt = model.dense_logits(model.forward_dense(slow))[:, -1].argmax(-1, keepdim=True)
            slow = torch.cat((slow, nxt), dim=1)
    assert torch.equal(fast, slow)
