"""Loading a DSpark draft checkpoint in the released layout: what loads, and what is refused.

Every refusal must name the file and the field or tensor, so a user with a checkpoint from another
trainer (or a newer DeepSpec) learns what this loader does not understand instead of getting a
draft that silently drafts badly.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dspark.checkpoints.dspark_block_config import BlockDraftConfig, BlockDraftConfigError
from dspark.runtime.models.dspark_block_loader import (
    INDEX_FILE,
    BlockDraftCheckpointError,
    expected_shapes,
    init_block_draft,
    load_block_draft,
    save_block_draft,
)
from tests.test_dspark_block_draft import (
    HIDDEN,
    VOCAB,
    WIDTH,
    propose_batch,
    released_config,
    released_tensors,
    write_checkpoint,
)


def _outputs(draft) -> tuple[list, torch.Tensor]:
    feats = torch.randn(5, WIDTH, generator=torch.Generator().manual_seed(0))
    out = propose_batch(draft, [feats], [11])
    return out.drafts.tolist(), out.conf_logits


def test_the_released_layout_loads_with_every_tensor_in_place(tmp_path: Path) -> None:
    cfg = released_config("gated")
    tensors = released_tensors(cfg)
    draft = load_block_draft(write_checkpoint(tmp_path / "d", cfg, tensors))
    state = draft.state_dict()
    assert set(state) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(state[name], t), name
    c = draft.cfg
    assert (c.block_size, c.mask_token_id, c.target_layer_ids, c.markov_rank, c.markov_head_type) == \
        (4, 60, (-1, 1, 2), 6, "gated")
    assert c.confidence_head and c.confidence_with_markov and c.rope_theta == 10000.0
    # Embeddings, then the outputs of target layers 1 and 2: 0, 2 and 3 layers run before each read.
    assert c.layers_before_capture == (0, 2, 3) and c.context_width == 3 * HIDDEN


def test_legacy_rope_fields_read_the_same_as_rope_parameters(tmp_path: Path) -> None:
    """transformers 4.x writes `rope_theta` and `rope_scaling: null` (and `torch_dtype`) where 5.x
    writes `rope_parameters` (and `dtype`)."""
    cfg = released_config()
    legacy = dict(cfg)
    del legacy["rope_parameters"], legacy["dtype"]
    legacy |= {"rope_theta": 10000.0, "rope_scaling": None, "torch_dtype": "bfloat16"}
    assert BlockDraftConfig.from_hf(legacy) == BlockDraftConfig.from_hf(cfg)
    legacy["rope_theta"] = 500.0
    assert BlockDraftConfig.from_hf(legacy).rope_theta == 500.0


def test_a_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path) -> None:
    cfg = released_config("rnn")
    tensors = released_tensors(cfg)
    single = load_block_draft(write_checkpoint(tmp_path / "single", cfg, tensors))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for layout in ("indexed", "plain"):
        path = tmp_path / layout
        path.mkdir()
        (path / "config.json").write_text(json.dumps(cfg))
        for file, part in shards.items():
            save_file({n: tensors[n] for n in part}, str(path / file))
        if layout == "indexed":
            weight_map = {n: file for file, part in shards.items() for n in part}
            (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        sharded = load_block_draft(path)
        assert _outputs(sharded)[0] == _outputs(single)[0]
        torch.testing.assert_close(_outputs(sharded)[1], _outputs(single)[1], rtol=0, atol=0)


def test_shard_problems_are_refused(tmp_path: Path) -> None:
    cfg = released_config()
    tensors = released_tensors(cfg)
    path = write_checkpoint(tmp_path / "d", cfg, tensors)
    (path / INDEX_FILE).write_text(json.dumps({"weight_map": {"fc.weight": "model-00009.safetensors"}}))
    with pytest.raises(BlockDraftCheckpointError, match="names shard model-00009.safetensors"):
        load_block_draft(path)
    (path / INDEX_FILE).unlink()
    save_file({"fc.weight": tensors["fc.weight"]}, str(path / "extra.safetensors"))
    with pytest.raises(BlockDraftCheckpointError, match="'fc.weight' is stored in both"):
        load_block_draft(path)


def test_a_bfloat16_checkpoint_loads_in_the_requested_dtype(tmp_path: Path) -> None:
    cfg = released_config()
    tensors = {k: v.to(torch.bfloat16) for k, v in released_tensors(cfg).items()}
    draft = load_block_draft(write_checkpoint(tmp_path / "d", cfg, tensors), dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in draft.parameters())
    assert torch.equal(draft.fc.weight, tensors["fc.weight"].float())


def test_embeddings_shared_with_the_target(tmp_path: Path) -> None:
    """A checkpoint stripped of its frozen copies of the target's embeddings and lm_head loads only
    when the target's are given, and then drafts as the full checkpoint does."""
    cfg = released_config()
    tensors = released_tensors(cfg)
    full = load_block_draft(write_checkpoint(tmp_path / "full", cfg, tensors))
    shared = (tensors["embed_tokens.weight"], tensors["lm_head.weight"])
    stripped = {k: v for k, v in tensors.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    path = write_checkpoint(tmp_path / "stripped", cfg, stripped)
    with pytest.raises(BlockDraftCheckpointError, match=r"missing tensors \['embed_tokens.weight', 'lm_head"):
        load_block_draft(path)
    assert _outputs(load_block_draft(path, target_embeddings=shared))[0] == _outputs(full)[0]
    with pytest.raises(BlockDraftCheckpointError, match=r"target's embed_tokens.weight has shape \(64, 16\)"):
        load_block_draft(path, target_embeddings=(torch.zeros(VOCAB, 16), shared[1]))


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("markov_head.markov_w2.weight"), r"missing tensors \['markov_head.markov_w2.weight'\]"),
    (lambda t: t.pop("confidence_head.proj.bias"), r"missing tensors \['confidence_head.proj.bias'\]"),
    (lambda t: t.pop("layers.1.self_attn.k_norm.weight"), r"missing tensors \['layers.1.self_attn.k_norm"),
    (lambda t: t.update({"markov_head.gate_proj.weight": torch.zeros(6, HIDDEN + 6)}),
     r"unexpected tensors \['markov_head.gate_proj.weight'\]"),
    (lambda t: t.update({"layers.2.mlp.up_proj.weight": torch.zeros(48, HIDDEN)}),
     r"unexpected tensors \['layers.2.mlp.up_proj.weight'\]"),
    (lambda t: t.update({"fc.weight": torch.zeros(HIDDEN, 2 * HIDDEN)}),
     r"tensor 'fc.weight' has shape \(32, 64\), config.json implies \(32, 96\)"),
    (lambda t: t.update({"markov_head.markov_w1.weight": torch.zeros(VOCAB, 8)}),
     r"tensor 'markov_head.markov_w1.weight' has shape \(64, 8\), config.json implies \(64, 6\)"),
])
def test_tensors_that_do_not_match_the_config_are_refused(tmp_path: Path, change, message: str) -> None:
    cfg = released_config("vanilla")
    tensors = released_tensors(cfg)
    change(tensors)
    path = write_checkpoint(tmp_path / "d", cfg, tensors)
    with pytest.raises(BlockDraftCheckpointError, match=message) as err:
        load_block_draft(path)
    assert str(path) in str(err.value)


def _set(**fields):
    return lambda c: c.update(fields)


def _drop(name: str):
    return lambda c: c.pop(name)


@pytest.mark.parametrize("change, field, message", [
    (_set(dflash_config={"target_layer_ids": [1]}), "dflash_config",
     "not a field this DSpark draft loader knows"),
    (_set(attn_logit_softcapping=30.0), "attn_logit_softcapping", "unknown fields"),
    (_set(speculators_model_type="dspark"), "speculators_model_type", "speculators convention"),
    (_set(markov_head_type="lstm"), "markov_head_type", "expected one of"),
    (_set(hidden_act="gelu"), "hidden_act", "only 'silu'"),
    (_set(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}), "rope_parameters",
     "rope_type: default"),
    (_set(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling", "only unscaled"),
    (_set(rope_theta=20000.0), "rope_theta", "disagrees with rope_parameters"),
    (_set(layer_types=["full_attention", "sliding_attention"]), "layer_types",
     "entry 1 is 'sliding_attention'"),
    (_set(use_sliding_window=True), "use_sliding_window", "not implemented"),
    (_set(target_layer_ids=[-1, 3]), "target_layer_ids", "is the target's final layer"),
    (_set(target_layer_ids=[2, 1]), "target_layer_ids", "strictly increasing"),
    (_set(target_layer_ids=[-2, 1]), "target_layer_ids", "outside -1"),
    (_set(mask_token_id=64), "mask_token_id", "outside the vocabulary"),
    (_set(tie_word_embeddings=True), "tie_word_embeddings", "untied"),
    (_set(model_type="gemma4"), "model_type", "only Qwen3"),
    (_set(architectures=["DFlashDraftModel"]), "architectures", "Qwen3DSparkModel"),
    (_set(num_key_value_heads=3), "num_key_value_heads", "does not divide"),
    (_set(enable_confidence_head="yes"), "enable_confidence_head", "true or false"),
    (_set(markov_rank=0), "confidence_head_with_markov", "needs a Markov head"),
    (_drop("block_size"), "block_size", "required and missing"),
    (_drop("confidence_head_with_markov"), "confidence_head_with_markov", "required and missing"),
    (_drop("rope_parameters"), "rope_parameters", "refusing to guess"),
])
def test_config_fields_it_does_not_implement_are_refused(tmp_path: Path, change, field: str,
                                                         message: str) -> None:
    cfg = released_config("vanilla")
    change(cfg)
    path = write_checkpoint(tmp_path / "d", cfg, released_tensors(released_config("vanilla")))
    with pytest.raises(BlockDraftConfigError, match=message) as err:
        load_block_draft(path)
    assert f"{path / 'config.json'}: field {field!r}" in str(err.value)


def test_config_round_trips_and_implies_the_tensor_shapes() -> None:
    for kind in ("vanilla", "gated", "rnn"):
        cfg = BlockDraftConfig.from_hf(released_config(kind))
        assert BlockDraftConfig.from_hf(cfg.to_hf()) == cfg
        assert set(expected_shapes(cfg)) == set(released_tensors(released_config(kind)))
    assert BlockDraftConfig.from_hf(released_config(None, rank=0, with_markov=False)).markov_head_type is None


def test_a_missing_checkpoint_says_what_a_checkpoint_holds(tmp_path: Path) -> None:
    with pytest.raises(BlockDraftConfigError, match="no such file .* holds config.json and"):
        load_block_draft(tmp_path / "nowhere")


def test_a_saved_draft_loads_back_the_same(tmp_path: Path) -> None:
    cfg = released_config("rnn")
    tensors = released_tensors(cfg)
    draft = load_block_draft(write_checkpoint(tmp_path / "a", cfg, tensors))
    save_block_draft(tmp_path / "b", draft, dtype=torch.bfloat16)
    written = json.loads((tmp_path / "b" / "config.json").read_text())
    assert written["dtype"] == "bfloat16" and written["architectures"] == ["Qwen3DSparkModel"]
    assert written["num_anchors"] == 512  # DeepSpec's class needs it to construct
    with pytest.raises(ValueError, match=r"metadata fields \['block_size'\] are not inert"):
        save_block_draft(tmp_path / "c", draft, metadata={"block_size": 3})
    again = load_block_draft(tmp_path / "b")
    assert again.cfg == draft.cfg
    for name, t in tensors.items():
        assert torch.equal(again.state_dict()[name], t.to(torch.bfloat16).float()), name


def test_a_fresh_draft_starts_from_the_target_embeddings(tmp_path: Path) -> None:
    cfg = BlockDraftConfig.from_hf(released_config("gated"))
    embed, head = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)
    draft = init_block_draft(cfg, seed=3, target_embeddings=(embed, head))
    assert torch.equal(draft.embed_tokens.weight, embed) and torch.equal(draft.lm_head.weight, head)
    assert torch.equal(draft.norm.weight, torch.ones(HIDDEN))
    assert torch.equal(draft.markov_head.gate_proj.bias, torch.zeros(cfg.markov_rank))
    assert 0.015 < float(draft.fc.weight.detach().std()) < 0.025
    assert torch.equal(init_block_draft(cfg, seed=3).fc.weight, draft.fc.weight)
    save_block_draft(tmp_path / "fresh", draft)
    assert _outputs(load_block_draft(tmp_path / "fresh"))[0] == _outputs(draft)[0]
    with pytest.raises(ValueError, match=r"target's lm_head.weight has shape \(64, 8\)"):
        init_block_draft(cfg, target_embeddings=(embed, torch.zeros(VOCAB, 8)))


def test_a_config_as_transformers_writes_it_for_deepspec_is_read(tmp_path: Path) -> None:
    """DeepSpec builds a draft's config as a copy of the target's transformers Qwen3Config with its
    own attributes set, and transformers writes it (with whatever defaults its version adds)."""
    transformers = pytest.importorskip("transformers")
    target = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    draft = copy.deepcopy(target)
    for name, value in {"architectures": ["Qwen3DSparkModel"], "num_target_layers": 4, "num_hidden_layers": 2,
                        "block_size": 4, "tie_word_embeddings": False, "layer_types": ["full_attention"] * 2,
                        "mask_token_id": 60, "target_layer_ids": [-1, 1, 2], "num_anchors": 512,
                        "enable_confidence_head": True, "confidence_head_with_markov": True, "markov_rank": 6,
                        "markov_head_type": "gated"}.items():
        setattr(draft, name, value)
    draft.save_pretrained(tmp_path / "d")
    assert BlockDraftConfig.from_file(tmp_path / "d") == BlockDraftConfig.from_hf(released_config("gated"))


def test_loading_a_package_leaves_parameter_initialisation_and_torch_dynamo_alone() -> None:
    """Loading builds the models as shapes only and assigns the checkpoint's tensors: no initialiser
    runs (on meta tensors, one imports torch._dynamo, seconds of every process's start)."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path\n"
            "from dspark.runtime.package import load_package\n"
            "from dspark.runtime.engine.runtime import Runtime\n"
            "Runtime(load_package(Path('generated/tiny_cpu_static')))\n"
            "import torch.nn as nn\n"
            "assert nn.init.normal_.__module__ == 'torch.nn.init'\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n")
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
