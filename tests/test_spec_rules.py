"""Whole-spec rules: one test per rule, each checking the field it blames and its advice."""

from __future__ import annotations

import json

import pytest

from dspark.spec import SpecError, load_spec
from dspark.spec.facts import SpecFacts
from dspark.spec.models import DraftSpec
from dspark.spec.rules import check_num_draft_tokens

SPS = {"type": "sps-1d", "sample_batch_tokens": [4, 64], "sample_steps_per_sec": [100.0, 50.0],
       "max_batch_tokens": 64}


def only_issue(write_spec, overrides):
    with pytest.raises(SpecError) as info:
        load_spec(write_spec(overrides))
    (issue,) = info.value.issues
    assert issue.location is not None and issue.location.line >= 1
    return issue


def test_num_draft_tokens_at_least_two(write_spec):
    spec = load_spec(write_spec()).spec
    broken = spec.model_copy(update={"draft": DraftSpec.model_construct(
        checkpoint="x", gamma=0, confidence_head=True, markov_embedding_size=64)})
    facts = SpecFacts(broken, None, None, None, None, None, None)
    (issue,) = check_num_draft_tokens(facts)
    assert issue.path == ("draft", "gamma") and "N = gamma + 1 = 1" in issue.message


def test_max_verify_len_at_most_n(write_spec):
    issue = only_issue(write_spec, {"verify": {"max_verify_len": 5}})
    assert issue.path == ("verify", "max_verify_len") and "N = gamma + 1 = 4" in issue.message


def test_min_verify_len_at_most_max(write_spec):
    issue = only_issue(write_spec, {"verify": {"min_verify_len": 3, "max_verify_len": 2}})
    assert issue.path == ("verify", "min_verify_len")
    # 0 means N, so min 4 with the default max is fine
    assert load_spec(write_spec({"verify": {"min_verify_len": 4}})).max_verify_len == 4


@pytest.mark.parametrize("mode", ["cap-accept", "compact"])
def test_planning_modes_need_the_confidence_head(write_spec, mode):
    issue = only_issue(write_spec, {"draft": {"confidence_head": False},
                                    "verify": {"mode": mode}, "cost_model": SPS})
    assert issue.path == ("verify", "mode") and "confidence_head" in issue.hint
    load_spec(write_spec({"draft": {"confidence_head": False}}))  # static does not


def test_calibration_needs_one_temperature_per_draft(write_spec, tmp_path):
    issue = only_issue(write_spec, {"calibration": {"temperatures": [1.0, 1.0]}})
    assert issue.path == ("calibration", "temperatures") and "2 temperatures" in issue.message
    (tmp_path / "sts.json").write_text(json.dumps({"temperatures": [1.0] * 5}))
    issue = only_issue(write_spec, {"calibration": {"file": "sts.json"}})
    assert issue.path == ("calibration", "file") and "gamma is 3" in issue.message


def test_tier_grid_must_cover_static_steps(write_spec):
    # N = 8, tiers 8..128 from batch sizes up to 16, but 32 requests need 256 tokens.
    issue = only_issue(write_spec, {"draft": {"gamma": 7}, "graph": {
        "enabled": True, "capture_batch_sizes": [1, 2, 4, 8, 16]}})
    assert issue.path == ("graph", "capture_batch_sizes")
    assert "B=17..32 (136..256 tokens) exceed the largest tier 128" in issue.message
    assert "add 32 to graph.capture_batch_sizes" in issue.hint
    assert "max_running_requests to 16" in issue.hint


def test_tier_grid_must_cover_cap_accept_steps(write_spec):
    issue = only_issue(write_spec, {"verify": {"mode": "cap-accept"}, "graph": {
        "enabled": True, "token_tiers": [4, 64]}, "serving": {"max_running_requests": 17}})
    assert issue.path == ("graph", "token_tiers")
    assert "B=17 (68 tokens)" in issue.message and "tier >= 68" in issue.hint


def test_tier_grid_must_cover_compact_steps(write_spec):
    overrides = {"verify": {"mode": "compact", "min_verify_len": 2, "max_verify_len": 3},
                 "cost_model": SPS, "graph": {"enabled": True, "token_tiers": [16, 90]}}
    issue = only_issue(write_spec, overrides)
    # B*3 > 90 from B=31; the smallest overflowing count is 31*3 = 93 (B=31,l=3) vs 32*2 = 64.
    assert "B=31..32 (93..96 tokens) exceed the largest tier 90" in issue.message
    overrides["graph"]["token_tiers"] = [16, 96]
    assert load_spec(write_spec(overrides)).tiers == (16, 96)


def test_enabled_graph_needs_tiers(write_spec):
    issue = only_issue(write_spec, {"graph": {"enabled": True}})
    assert issue.path == ("graph", "enabled") and "no tiers" in issue.message


def test_tier_alignment_needs_graphs(write_spec):
    issue = only_issue(write_spec, {"verify": {"align_to_graph_tier": True}})
    assert issue.path == ("verify", "align_to_graph_tier")


def test_tp_divides_heads(write_spec):
    issue = only_issue(write_spec, {"parallelism": {"tp": 4}})  # 4 heads, 2 kv heads
    assert issue.path == ("parallelism", "tp") and "[1, 2]" in issue.hint
    assert load_spec(write_spec({"parallelism": {"tp": 2}})).spec.parallelism.tp == 2


def test_ep_is_one_for_dense_models(write_spec):
    issue = only_issue(write_spec, {"parallelism": {"ep": 2}})
    assert issue.path == ("parallelism", "ep") and "dense" in issue.message


def test_dp_attention_needs_dp(write_spec):
    issue = only_issue(write_spec, {"parallelism": {"dp_attention": True}})
    assert issue.path == ("parallelism", "dp_attention")
    load_spec(write_spec({"parallelism": {"dp_attention": True, "dp": 2}}))


def test_draft_checkpoint_must_match(write_spec, tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"gamma": 5, "markov_embedding_size": 64}))
    issue = only_issue(write_spec, {"draft": {"checkpoint": "draft"}})
    assert issue.path == ("draft", "gamma") and "trained with 5" in issue.message
    (draft / "config.json").write_text(json.dumps({"gamma": 3, "target_hidden_size": 32}))
    issue = only_issue(write_spec, {"draft": {"checkpoint": "draft"}})
    assert issue.path == ("draft", "checkpoint") and "target_hidden_size" in issue.message
    (draft / "config.json").write_text(json.dumps({"gamma": 3, "confidence_head": False}))
    issue = only_issue(write_spec, {"draft": {"checkpoint": "draft"}})
    assert issue.path == ("draft", "confidence_head")


def test_compact_needs_a_cost_model_unless_allowed(write_spec):
    issue = only_issue(write_spec, {"verify": {"mode": "compact"}})
    assert issue.path == ("verify", "mode") and "allow_no_cost_model" in issue.hint
    load_spec(write_spec({"verify": {"mode": "compact", "allow_no_cost_model": True}}))
    load_spec(write_spec({"verify": {"mode": "compact"}, "cost_model": SPS}))


def test_context_fits_the_model(write_spec):
    issue = only_issue(write_spec, {"serving": {"max_context_len": 4096}})
    assert issue.path == ("serving", "max_context_len") and "2048" in issue.hint
