"""`dspark fit-confidence`: recorded head inputs, the survival fit, and the refitted draft it writes."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.checkpoints.dspark_block_config import BlockDraftConfig
from dspark.cli.main import main
from dspark.formats.sts_shards import StsShardWriter
from dspark.measure.head_fit import (
    BIAS,
    FIT_FILE,
    WEIGHT,
    FeatureData,
    HeadFitSettings,
    backbone_digest,
    checkpoint_state,
    fit_confidence_head,
    load_feature_shards,
    refit_draft,
)
from dspark.runtime.models.checkpoint import load_draft
from dspark.runtime.models.dspark_block_draft import DSparkBlockDraft
from dspark.runtime.models.dspark_block_loader import init_block_draft, save_block_draft
from dspark.runtime.package import load_package
from dspark.runtime.planner.calibration_metrics import ece
from dspark.runtime.planner.sts import CalibrationError

from .runtime_helpers import compile_variant

GAMMA = 5
WIDTH = 12


def _tiny_draft(seed: int = 0) -> DSparkBlockDraft:
    cfg = BlockDraftConfig(vocab_size=40, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                           num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope_theta=10000.0,
                           attention_bias=False, block_size=GAMMA, mask_token_id=39, target_layer_ids=(0,),
                           num_target_layers=2, markov_rank=4, markov_head_type="vanilla",
                           confidence_head=True, confidence_with_markov=True)
    return init_block_draft(cfg, seed=seed)


def _synthetic(n: int, seed: int, true_w: torch.Tensor, true_b: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and prefix masks drawn from the cumulative model the fit assumes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, GAMMA, WIDTH, generator=g)
    p_accept = torch.sigmoid(x @ true_w + true_b)
    accept = torch.rand(n, GAMMA, generator=g) < p_accept
    return x, accept.long().cumprod(-1).bool()


def _record(directory, x, mask, backbone: str, policy: str = "greedy") -> None:
    rec = StsShardWriter(directory, GAMMA, policy, shard_size=700, features_backbone=backbone)
    logits = torch.zeros(len(x), GAMMA)
    rec.add(logits, mask.sum(-1), torch.ones(len(x), dtype=torch.bool), x)
    rec.close()


def test_recorder_stores_features_beside_the_labels_and_names_the_backbone(tmp_path) -> None:
    x, mask = _synthetic(1500, 0, torch.randn(WIDTH), 1.0)
    _record(tmp_path / "sts", x, mask, "abc123")
    shards = sorted((tmp_path / "sts").glob("shard-*.pt"))
    assert len(shards) == 3  # 700 + 700 + the flushed 100
    first = torch.load(shards[0], weights_only=True)
    assert set(first) == {"logits", "prefix_mask", "features"}
    assert first["features"].shape == (700, GAMMA, WIDTH) and first["features"].dtype == torch.float16
    meta = json.loads((tmp_path / "sts" / "meta.json").read_text())
    assert meta["features"] == {"draft_backbone": "abc123"}
    data = load_feature_shards([tmp_path / "sts"])
    assert data.num_samples == 1500 and data.backbone == "abc123" and data.policy == "greedy"
    torch.testing.assert_close(data.features, x.half().float())
    assert torch.equal(data.prefix_mask, mask)


def test_recorder_refuses_a_step_without_features_when_it_stores_them(tmp_path) -> None:
    rec = StsShardWriter(tmp_path, GAMMA, "greedy", features_backbone="abc")
    with pytest.raises(ValueError, match="inputs"):
        rec.add(torch.zeros(2, GAMMA), torch.zeros(2), torch.ones(2, dtype=torch.bool))


def test_shards_without_features_say_how_to_record_them(tmp_path) -> None:
    rec = StsShardWriter(tmp_path / "sts", GAMMA, "greedy")
    rec.add(torch.zeros(3, GAMMA), torch.ones(3), torch.ones(3, dtype=torch.bool))
    rec.close()
    with pytest.raises(CalibrationError, match="--record-features"):
        load_feature_shards([tmp_path / "sts"])


def test_shards_of_two_backbones_are_not_fitted_together(tmp_path) -> None:
    x, mask = _synthetic(50, 0, torch.randn(WIDTH), 0.0)
    _record(tmp_path / "a", x, mask, "aaa")
    _record(tmp_path / "b", x, mask, "bbb")
    with pytest.raises(CalibrationError, match="different drafts"):
        load_feature_shards([tmp_path / "a", tmp_path / "b"])


def test_backbone_digest_ignores_the_head_and_sees_every_other_weight() -> None:
    state = {k: v.clone() for k, v in _tiny_draft().state_dict().items()}
    base = backbone_digest(state)
    state[WEIGHT] += 1.0
    assert backbone_digest(state) == base
    state["lm_head.weight"][0, 0] += 1e-3
    assert backbone_digest(state) != base


def test_fit_recovers_a_miscalibrated_head_and_improves_held_out_calibration() -> None:
    true_w, true_b = torch.randn(WIDTH, generator=torch.Generator().manual_seed(3)) * 0.8, 1.5
    x, mask = _synthetic(20000, 1, true_w, true_b)
    data = FeatureData(x, mask, "b", "greedy", ("synthetic",))
    # The head being replaced ranks right but is far too confident, as an off-event head would be.
    fit = fit_confidence_head(data, (3.0 * true_w)[None], torch.tensor([4.0]), HeadFitSettings(l2=0.0))
    assert fit.num_fit + fit.num_holdout == 20000 and fit.num_holdout == 4000
    assert fit.loss_after < fit.loss_before
    assert max(fit.holdout_before["ece"]) > 0.1
    assert max(fit.holdout_after["ece"]) < 0.03
    torch.testing.assert_close(fit.weight[0], true_w, atol=0.1, rtol=0.0)
    assert abs(float(fit.bias) - true_b) < 0.15
    # The report is on rows the fit never saw: refitting on them alone gives other numbers.
    x_new, mask_new = _synthetic(4000, 2, true_w, true_b)
    s = torch.sigmoid(x_new @ fit.weight[0] + fit.bias).cumprod(-1)
    assert max(ece(s[:, k].numpy(), mask_new[:, k].numpy()) for k in range(GAMMA)) < 0.03


def test_fit_settings_are_validated() -> None:
    with pytest.raises(CalibrationError, match="holdout"):
        HeadFitSettings(holdout_fraction=1.0)
    with pytest.raises(CalibrationError, match="l2"):
        HeadFitSettings(l2=-1.0)


def test_refit_writes_a_new_draft_with_only_the_head_changed(tmp_path) -> None:
    draft = _tiny_draft()
    src = tmp_path / "draft"
    save_block_draft(src, draft)
    state = checkpoint_state(src)
    width = state[WEIGHT].shape[1]
    g = torch.Generator().manual_seed(0)
    true_w = torch.randn(width, generator=g)
    x = torch.randn(3000, GAMMA, width, generator=g)
    mask = (torch.rand(3000, GAMMA, generator=g) < torch.sigmoid(x @ true_w + 1.0)).long().cumprod(-1).bool()
    _record(tmp_path / "run" / "sts", x, mask, backbone_digest(state))

    out = tmp_path / "draft_refit"
    assert main(["fit-confidence", str(tmp_path / "run" / "sts"), "--draft", str(src), "-o", str(out)]) == 0
    new = checkpoint_state(out)
    assert set(new) == set(state)
    for name, tensor in state.items():
        assert torch.equal(new[name], tensor) != name.startswith("confidence_head.")
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    report = json.loads((out / FIT_FILE).read_text())
    assert report["draft_backbone"] == backbone_digest(state) and report["num_fit"] == 2400
    assert report["loss_after"] < report["loss_before"]
    reloaded = load_draft(str(out))  # the runtime loads it like any draft
    assert torch.equal(reloaded.confidence_head.proj.weight, new[WEIGHT])
    assert not list(tmp_path.glob(".staging-*"))

    # Written once: the same output again, or a draft the features were not recorded with, fail
    # without touching anything.
    with pytest.raises(CalibrationError, match="already exists"):
        refit_draft([tmp_path / "run" / "sts"], src, out)
    other = tmp_path / "other"
    save_block_draft(other, _tiny_draft(seed=1))
    with pytest.raises(CalibrationError, match="record with this draft"):
        refit_draft([tmp_path / "run" / "sts"], other, tmp_path / "never")
    assert not (tmp_path / "never").exists() and not list(tmp_path.glob(".staging-*"))


def test_cli_errors_name_the_problem(tmp_path, capsys) -> None:
    assert main(["fit-confidence", str(tmp_path / "missing"), "--draft", str(tmp_path), "-o",
                 str(tmp_path / "out")]) == 2
    assert "not a draft checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_served_features_are_the_head_inputs_and_the_refitted_draft_serves(tmp_path, capsys) -> None:
    """End to end: record a run with features, refit, compile a spec naming the new draft, run it."""
    from dspark.checkpoints import embedded_root

    pkg_dir = compile_variant(tmp_path, "tiny_cpu_static.yaml",
                              {"verify": {"mode": "cap-accept"}, "serving": {"max_running_requests": 4}},
                              "feat_rec")
    prompts = ["def f(x):", "import os\n", "class A:\n    ", "for i in range(", "return self."]
    args = ["run", str(pkg_dir), "--max-new-tokens", "40", "--record", str(tmp_path / "rec"),
            "--record-features"]
    for p in prompts:
        args += ["--prompt", p]
    assert main(args) == 0
    capsys.readouterr()
    shards = [torch.load(p, weights_only=True) for p in sorted((tmp_path / "rec" / "sts").glob("*.pt"))]
    feats = torch.cat([s["features"] for s in shards]).float()
    logits = torch.cat([s["logits"] for s in shards])
    head = checkpoint_state(embedded_root() / "tiny" / "draft")
    # The stored features reproduce the served confidence logits through the head (to float16).
    torch.testing.assert_close(feats @ head[WEIGHT][0] + head[BIAS], logits, atol=0.05, rtol=0.0)

    out = tmp_path / "tiny_draft_refit"
    assert main(["fit-confidence", str(tmp_path / "rec" / "sts"), "--draft",
                 str(embedded_root() / "tiny" / "draft"), "-o", str(out), "--holdout", "0.3"]) == 0
    capsys.readouterr()
    refit_pkg = load_package(compile_variant(
        tmp_path, "tiny_cpu_static.yaml",
        {"draft": {"checkpoint": str(out)}, "verify": {"mode": "cap-accept"},
         "serving": {"max_running_requests": 4}}, "refit_serve"))
    assert refit_pkg.deployment.draft.checkpoint.endswith("tiny_draft_refit")
    spec_args = ["run", str(refit_pkg.directory), "--max-new-tokens", "24", "--json"]
    for p in prompts:
        spec_args += ["--prompt", p]
    assert main(spec_args) == 0
    spec_out = json.loads(capsys.readouterr().out)
    assert main(spec_args + ["--target-only"]) == 0
    target_out = json.loads(capsys.readouterr().out)
    # A new head changes only which drafts get verified, never the output.
    assert [c["token_ids"] for c in spec_out["completions"]] == \
        [c["token_ids"] for c in target_out["completions"]]
