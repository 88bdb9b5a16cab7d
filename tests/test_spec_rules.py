"""Whole-spec rules: one test per rule, each checking the field it blames and its advice."""

from __future__ import annotations

import json

import pytest

from dspark.checkpoints.dspark_block_config import BlockDraftConfig
from dspark.spec import SpecError, load_spec
from dspark.spec.facts import SpecFacts
from dspark.spec.models import DraftSpec
from dspark.spec.rules import check_num_draft_tokens
from dspark.spec.tier_rules import StepShapes

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
        checkpoint="x", gamma=0, confidence_head=True)})
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
    # B*3 > 90 from B=31; B=31 requests run anywhere from 62 to 93 packed rows, so 91 is the smallest
    # step that overflows.
    assert "B=31..32 (91..96 tokens) exceed the largest tier 90" in issue.message
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


def test_dp_attention_splits_heads_over_tp_over_dp(write_spec):
    # 4 heads, 2 kv heads: tp 4 alone cannot split them, but with DP attention over dp 2 each DP rank's
    # 2 attention ranks hold one KV head each
    spec = load_spec(write_spec({"parallelism": {"dp_attention": True, "dp": 2, "tp": 4}})).spec
    assert spec.parallelism.tp == 4
    issue = only_issue(write_spec, {"parallelism": {"dp_attention": True, "dp": 2, "tp": 8}})
    assert issue.path == ("parallelism", "tp") and "tp / dp = 4 does not divide" in issue.message
    assert "tp / dp in [1, 2]" in issue.hint


def test_ep_is_one_for_dense_models(write_spec):
    issue = only_issue(write_spec, {"parallelism": {"ep": 2}})
    assert issue.path == ("parallelism", "ep") and "dense" in issue.message


def test_dp_attention_needs_dp(write_spec):
    issue = only_issue(write_spec, {"parallelism": {"dp_attention": True}})
    assert issue.path == ("parallelism", "dp_attention")
    load_spec(write_spec({"parallelism": {"dp_attention": True, "dp": 2, "tp": 2}}))


def test_dp_attention_splits_tp(write_spec):
    # SGLang's attention TP size is tp / dp with DP attention: tp 2 cannot be split over dp 4.
    issue = only_issue(write_spec, {"parallelism": {"dp_attention": True, "dp": 4, "tp": 2}})
    assert issue.path == ("parallelism", "dp") and "tp 2 is not a multiple of dp 4" in issue.message
    without = load_spec(write_spec({"parallelism": {"dp": 4, "tp": 2}}))  # no DP attention: fine
    assert without.spec.parallelism.dp == 4


def _draft_config(**changes: object) -> dict:
    """A released-layout draft config.json for the conftest target (2 layers, hidden 64, vocab 256)."""
    cfg = BlockDraftConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, block_size=5,
        mask_token_id=255, target_layer_ids=(0,), num_target_layers=2, markov_rank=8,
        markov_head_type="vanilla", confidence_head=True, confidence_with_markov=True).to_hf()
    return {**cfg, **changes}


def test_draft_checkpoint_must_match(write_spec, tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    config = draft / "config.json"
    config.write_text(json.dumps(_draft_config()))
    # gamma defaults to the block size; above it is refused
    assert load_spec(write_spec({"draft": {"checkpoint": "draft", "gamma": None}})).spec.draft.gamma == 5
    issue = only_issue(write_spec, {"draft": {"checkpoint": "draft", "gamma": 6}})
    assert issue.path == ("draft", "gamma") and "block_size 5" in issue.message
    # settings the spec states must be the checkpoint's
    issue = only_issue(write_spec, {"draft": {"checkpoint": "draft", "markov_rank": 16}})
    assert issue.path == ("draft", "markov_rank") and "16 here but 8 in" in issue.message
    config.write_text(json.dumps(_draft_config(hidden_size=32)))
    issue = only_issue(write_spec, {"draft": {"checkpoint": "draft"}})
    assert issue.path == ("draft", "checkpoint") and "hidden_size is 32" in issue.message
    config.write_text(json.dumps(_draft_config(enable_confidence_head=False,
                                               confidence_head_with_markov=None)))
    issue = only_issue(write_spec, {"draft": {"checkpoint": "draft", "confidence_head": True}})
    assert issue.path == ("draft", "confidence_head")
    # a field the loader does not know is refused with the file and the field
    config.write_text(json.dumps(_draft_config(speculators_model_type="dspark")))
    issue = only_issue(write_spec, {"draft": {"checkpoint": "draft"}})
    assert issue.path == ("draft", "checkpoint") and "speculators_model_type" in issue.message
    config.write_text(json.dumps(_draft_config(target_layer_ids=[1], num_target_layers=2)))
    issue = only_issue(write_spec, {"draft": {"checkpoint": "draft"}})
    assert issue.path == ("draft", "checkpoint") and "final layer" in issue.message


def test_draft_settings_without_a_checkpoint(write_spec):
    resolved = load_spec(write_spec()).spec.draft  # conftest: the draft is not on this machine
    assert (resolved.block_size, resolved.num_layers, resolved.target_layer_ids, resolved.mask_token_id) == (
        7, 1, (0,), 255)
    assert (resolved.markov_rank, resolved.markov_head_type, resolved.confidence_with_markov) == (
        64, "vanilla", True)
    issue = only_issue(write_spec, {"draft": {"mask_token_id": 256}})
    assert issue.path == ("draft", "mask_token_id") and "vocab_size 256" in issue.message
    issue = only_issue(write_spec, {"draft": {"target_layer_ids": [0, 1]}})
    assert issue.path == ("draft", "target_layer_ids") and "final layer 1" in issue.message
    issue = only_issue(write_spec, {"draft": {"markov_rank": 0, "markov_head_type": "rnn"}})
    assert issue.path == ("draft", "markov_head_type")


def test_compact_needs_a_cost_model_unless_allowed(write_spec):
    issue = only_issue(write_spec, {"verify": {"mode": "compact"}})
    assert issue.path == ("verify", "mode") and "allow_no_cost_model" in issue.hint
    load_spec(write_spec({"verify": {"mode": "compact", "allow_no_cost_model": True}}))
    load_spec(write_spec({"verify": {"mode": "compact"}, "cost_model": SPS}))


def test_speculation_off_written_out_needs_a_planner_and_a_decode_priced_table(write_spec):
    priced = {**SPS, "decode_bs_probes": [1, 8], "decode_seconds": [0.002, 0.003]}
    issue = only_issue(write_spec, {"verify": {"off": "auto"}, "cost_model": priced})
    assert issue.path == ("verify", "off") and "static mode" in issue.message
    issue = only_issue(write_spec, {"verify": {"mode": "compact", "off": "auto"}, "cost_model": SPS})
    assert issue.path == ("verify", "off") and "decode term" in issue.message and "profile" in issue.hint
    no_table = {"mode": "compact", "off": "auto", "allow_no_cost_model": True}
    issue = only_issue(write_spec, {"verify": no_table})
    assert issue.path == ("verify", "off") and "without a cost model" in issue.message
    # left at its default, auto has nothing to decide with and resolves to never; with the term, auto
    unpriced = load_spec(write_spec({"verify": {"mode": "compact"}, "cost_model": SPS}))
    assert unpriced.speculation_off == "never"
    spec = load_spec(write_spec({"verify": {"mode": "compact"}, "cost_model": priced}))
    assert spec.speculation_off == "auto"
    pinned = load_spec(write_spec({"verify": {"mode": "compact", "off": "never"}, "cost_model": priced}))
    assert pinned.speculation_off == "never"
    issue = only_issue(write_spec, {"verify": {"off": "sometimes"}})
    assert issue.path == ("verify", "off")


def test_context_fits_the_model(write_spec):
    issue = only_issue(write_spec, {"serving": {"max_context_len": 4096}})
    assert issue.path == ("serving", "max_context_len") and "2048" in issue.hint


@pytest.mark.parametrize("mode", ["static", "cap-accept", "compact"])
def test_tiers_are_an_error_without_graph_capture(write_spec, mode):
    overrides = {"verify": {"mode": mode}, "cost_model": SPS, "graph": {"token_tiers": [4, 8]}}
    issue = only_issue(write_spec, overrides)
    assert issue.path == ("graph", "token_tiers") and "graph.enabled is false" in issue.message
    issue = only_issue(write_spec, {"graph": {"enabled": False, "capture_batch_sizes": [1, 2]}})
    assert issue.path == ("graph", "capture_batch_sizes")


def test_capture_batch_sizes_above_the_running_limit(write_spec):
    issue = only_issue(write_spec, {"serving": {"max_running_requests": 8},
                                    "graph": {"enabled": True, "capture_batch_sizes": [1, 8, 16, 32]}})
    assert issue.path == ("graph", "capture_batch_sizes", 2)
    assert "16, 32 exceed serving.max_running_requests (8)" in issue.message
    assert "max_running_requests to 32" in issue.hint


def test_capture_batch_sizes_and_token_tiers_are_exclusive(write_spec):
    issue = only_issue(write_spec, {"graph": {"enabled": True, "capture_batch_sizes": [1, 32],
                                              "token_tiers": [4, 128]}})
    assert issue.path == ("graph", "capture_batch_sizes") and "ignored" in issue.message


def test_static_tiers_hold_whole_requests(write_spec):
    # N = 4: tiers 2 and 6 cut a request; 8 and 128 are whole.
    issue = only_issue(write_spec, {"graph": {"enabled": True, "token_tiers": [2, 4, 6, 8, 128]}})
    assert issue.path == ("graph", "token_tiers", 0)
    assert "tiers 2, 6 are not multiples of 4" in issue.message and "multiples of 4" in issue.hint


def test_unreachable_tiers_are_listed(write_spec):
    # compact, 4 requests of 2..3 rows: steps of 2..12 rows (2..3, 4..6, 6..9, 8..12).
    overrides = {"verify": {"mode": "compact", "min_verify_len": 2, "max_verify_len": 3},
                 "cost_model": SPS, "serving": {"max_running_requests": 4},
                 "graph": {"enabled": True, "token_tiers": [1, 2, 3, 12, 16, 32]}}
    issue = only_issue(write_spec, overrides)
    assert issue.path == ("graph", "token_tiers", 0)
    assert "tiers 1 (no step has 1 row), 16 (above the largest step, 12 rows), 32 (above the " \
           "largest step, 12 rows) are never used" in issue.message
    assert "raise serving.max_running_requests (now 4)" in issue.hint
    overrides["graph"]["token_tiers"] = [2, 3, 12]
    assert load_spec(write_spec(overrides)).tiers == (2, 3, 12)


def test_cap_accept_and_static_steps_are_whole_batches(write_spec):
    # Static steps are exactly B x N: with N = 4 and 8 requests a tier of 40 is never the smallest
    # tier >= a step (32 fits 32, nothing lies in 33..40).
    issue = only_issue(write_spec, {"verify": {"mode": "cap-accept"}, "serving": {"max_running_requests": 8},
                                    "graph": {"enabled": True, "token_tiers": [4, 8, 16, 32, 40]}})
    assert issue.path == ("graph", "token_tiers", 4) and "tier 40 (above the largest step, 32 rows)" \
        in issue.message


def brute_force(shapes: StepShapes) -> set[int]:
    return {rows for b in range(1, shapes.requests + 1)
            for rows in range(b * shapes.floor, b * shapes.cap + 1)}


@pytest.mark.parametrize("requests, floor, cap", [(1, 1, 1), (3, 2, 2), (5, 2, 3), (7, 3, 8), (9, 5, 6),
                                                  (4, 1, 8), (6, 7, 8)])
def test_step_shapes_match_brute_force(requests, floor, cap):
    shapes = StepShapes("compact", requests, floor, cap)
    feasible = brute_force(shapes)
    assert shapes.largest == max(feasible)
    for low in range(0, shapes.largest + 2):
        for high in range(low + 1, shapes.largest + 3):
            assert shapes.any_between(low, high) == any(low < m <= high for m in feasible), (low, high)


def test_committed_grids_are_exact(write_spec):
    # The repository's grids: every step fits and every tier is used.
    tiers = [8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    compact = {"draft": {"gamma": 7}, "verify": {"mode": "compact"}, "cost_model": SPS,
               "graph": {"enabled": True, "token_tiers": tiers}}
    assert load_spec(write_spec(compact)).tiers == tuple(tiers)
    static = {"draft": {"gamma": 7}, "graph": {"enabled": True, "capture_batch_sizes": [1, 2, 4, 8, 16, 32]}}
    assert load_spec(write_spec(static)).tiers == (8, 16, 32, 64, 128, 256)


def test_context_holds_one_request(write_spec):
    wide = {"gamma": 15, "block_size": 15}
    issue = only_issue(write_spec, {"draft": wide, "serving": {"max_context_len": 16}})
    assert issue.path == ("serving", "max_context_len") and "need 18" in issue.message
    assert "at least 18" in issue.hint
    assert load_spec(write_spec({"draft": {"gamma": 13, "block_size": 13},
                                 "serving": {"max_context_len": 16}}))  # 1 + 1 + 14


def test_kv_pool_holds_one_full_context_request(write_spec):
    issue = only_issue(write_spec, {"serving": {"max_total_tokens": 1000, "max_context_len": 1024}})
    # 1000 // 16 = 62 pages, a 1024-token request needs 64.
    assert issue.path == ("serving", "max_total_tokens") and "holds 62 pages" in issue.message
    assert "at least 1024" in issue.hint
    assert load_spec(write_spec({"serving": {"max_total_tokens": 1024, "max_context_len": 1024}}))
