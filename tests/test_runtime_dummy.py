"""Dummy weights (`load_format: dummy`): seeded random weights of the spec's geometry, no checkpoint read."""

from __future__ import annotations

import pytest
import torch

from dspark.cli.main import main as dspark_main
from dspark.compiler import build
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package
from dspark.runtime.tokenizer import ByteTokenizer
from dspark.spec import SpecError, load_spec

from .scripted_draft import assert_every_length, generate_scripted

GEOMETRY = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
            "num_kv_heads": 2, "max_position_embeddings": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}
DUMMY = {"model": {"checkpoint": "nowhere/target", "geometry": GEOMETRY, "load_format": "dummy"},
         "draft": {"checkpoint": "nowhere/draft", "gamma": 3, "load_format": "dummy", "num_layers": 2}}


@pytest.fixture
def dummy_package(write_spec, tmp_path):
    def make(overrides: dict | None = None):
        spec = write_spec({**DUMMY, "serving": {"max_context_len": 256, "max_running_requests": 4},
                           **(overrides or {})})
        out = tmp_path / "pkg"
        build(spec, out, force=True)
        return out
    return make


def test_dummy_models_have_the_spec_geometry_and_seeded_weights(dummy_package) -> None:
    pkg = load_package(dummy_package())
    assert isinstance(pkg.tokenizer, ByteTokenizer)  # the checkpoint is not here: bytes
    first, second = Runtime(pkg), Runtime(pkg)
    assert first.target.cfg.hidden_size == 64 and first.target.cfg.vocab_size == 300
    assert first.draft.cfg.num_layers == 2 and first.draft.cfg.hidden_size == 64
    assert first.draft.cfg.target_layer_ids == (0,) and first.draft.cfg.mask_token_id == 299
    for a, b in zip(first.target.state_dict().values(), second.target.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # seeded: the same weights every time
    norms = [p for n, p in first.target.named_parameters() if "norm" in n]
    assert all(torch.equal(p, torch.ones_like(p)) for p in norms)
    weights = first.target.lm_head.weight
    assert 0.015 < float(weights.detach().std()) < 0.025 and weights.dtype == torch.float32


@pytest.mark.parametrize("mode", ["static", "compact"])
def test_dummy_weights_decode_losslessly(dummy_package, mode: str) -> None:
    """With the dummy draft (almost never accepted) and with a scripted one (the target's greedy
    continuation with an error at a shuffled slot): the verifier accepts every draft length 0 … gamma,
    and the output is target-only's."""
    verify = {"mode": mode, "allow_no_cost_model": True}
    runtime = Runtime(load_package(dummy_package({"verify": verify})))
    prompts = [[1, 2, 3, 4], [7, 8], [100, 200, 250]]
    expected, _ = runtime.generate(prompts, 12, target_only=True)
    got, stats = runtime.generate(prompts, 12)
    assert got == expected and stats.steps > 0
    scripted = generate_scripted(runtime, prompts, 12)
    assert scripted.outputs == expected
    assert_every_length(scripted, runtime.plan.gamma)


def test_the_compiler_records_dummy_weights(dummy_package) -> None:
    pkg = load_package(dummy_package())
    model, draft = pkg.deployment.model, pkg.deployment.draft
    assert (model.load_format, model.digest, draft.load_format, draft.num_layers, draft.digest) == (
        "dummy", "", "dummy", 2, "")


def test_dspark_run_warns_loudly(dummy_package, capsys) -> None:
    assert dspark_main(["run", str(dummy_package()), "--prompt", "ab", "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert "WARNING" in err and "DUMMY (random) target and draft weights" in err


def test_dummy_weights_rules(write_spec) -> None:
    small = {**DUMMY["model"], "geometry": {**GEOMETRY, "vocab_size": 200}}
    with pytest.raises(SpecError, match="byte-level tokenizer, which needs vocab_size >= 258"):
        load_spec(write_spec({**DUMMY, "model": small}))
