"""The oracle in every verify mode: greedy speculative output equals greedy target-only output.

cap-accept and compact run with a cost table under which the planner really chooses partial
budgets (checked: fewer planned rows than B x N), with and without tier padding, tier
alignment, lagged confidence and a verify-length floor/cap, at several batch sizes.
"""

from __future__ import annotations

from typing import Any

import pytest

from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package

from .runtime_helpers import compile_variant
from .test_runtime_lossless import MAX_NEW, _prompts

# Step time grows by ~6% per verify row over a fixed overhead: rows with low survival do not
# pay for themselves, so budgets are partial and differ between requests and steps.
COSTLY_ROWS = {"type": "additive", "bias_seconds": 0.01, "bs_probes": [1, 32],
               "alpha_seconds": [0.0, 0.0], "m_probes": [1, 256], "theta_seconds": [0.0, 0.15]}

VARIANTS: dict[str, dict[str, Any]] = {
    "cap_accept": {"verify": {"mode": "cap-accept"}, "cost_model": COSTLY_ROWS},
    "compact": {"verify": {"mode": "compact"}, "cost_model": COSTLY_ROWS},
    "compact_no_cost_model": {"verify": {"mode": "compact", "allow_no_cost_model": True}},
    "compact_floor_cap_lag": {"verify": {"mode": "compact", "min_verify_len": 2, "max_verify_len": 6,
                                         "lag_steps": 2}, "cost_model": COSTLY_ROWS},
    "static_tiers": {"graph": {"enabled": True, "capture_batch_sizes": [1, 2, 4, 8]}},
    "cap_accept_tiers": {"verify": {"mode": "cap-accept"}, "cost_model": COSTLY_ROWS,
                         "graph": {"enabled": True, "capture_batch_sizes": [1, 2, 4, 8]}},
    "compact_tiers_aligned": {"verify": {"mode": "compact", "align_to_graph_tier": True},
                              "cost_model": COSTLY_ROWS,
                              "graph": {"enabled": True, "token_tiers": [8, 16, 24, 32, 48, 64]}},
}
CASES = [("cap_accept", 3), ("compact", 1), ("compact", 3), ("compact", 8),
         ("compact_no_cost_model", 3), ("compact_floor_cap_lag", 3), ("static_tiers", 3),
         ("cap_accept_tiers", 8), ("compact_tiers_aligned", 3), ("compact_tiers_aligned", 8)]
# The compiler refuses tiers no step can reach, so a smaller batch captures fewer of them.
REACHABLE_TIERS = {("static_tiers", 3): {"capture_batch_sizes": [1, 3]},  # B=2 pads to 3
                   ("compact_tiers_aligned", 3): {"token_tiers": [8, 16, 24]}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("modes")
    pkg = load_package(compile_variant(tmp, "tiny_cpu_static.yaml", {}, "modes_ref"))
    prompts = _prompts(pkg.tokenizer)
    outputs, _ = Runtime(pkg).generate(prompts, MAX_NEW, target_only=True)
    return tmp, prompts, outputs


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "batch"), CASES)
def test_speculative_equals_target_only(reference, variant: str, batch: int) -> None:
    tmp, prompts, expected = reference
    overrides = {**VARIANTS[variant],
                 "serving": {"max_running_requests": batch, "max_context_len": 1024}}
    if (variant, batch) in REACHABLE_TIERS:
        overrides["graph"] = {"enabled": True, **REACHABLE_TIERS[variant, batch]}
    runtime = Runtime(load_package(compile_variant(tmp, "tiny_cpu_static.yaml", overrides,
                                                   f"modes_{variant}_b{batch}")))
    outputs, stats = runtime.generate(prompts, MAX_NEW)
    for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert got == want, f"{variant} B={batch} prompt {i}: speculative output differs from target-only"
    n = runtime.plan.num_draft_tokens
    full = stats.request_steps * n
    mode = runtime.deployment.verify_mode
    if mode == "compact":
        assert stats.verify_rows == stats.planned_rows  # only planned rows ran
    else:
        assert stats.verify_rows == full  # static and cap-accept run every row
    if "cost_model" in VARIANTS[variant]:
        assert stats.planned_rows < full  # the planner really cut rows
        assert stats.planned_committed > 0
    if runtime.tiers and not getattr(runtime.plan, "align_to_graph_tier", False):
        assert stats.padding_rows > 0  # steps were padded up to their tiers
    assert runtime.slots.num_free_slots == batch


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.0, 0.4])
def test_forced_budget_fraction_sets_the_rows_and_stays_lossless(reference, fraction: float) -> None:
    tmp, prompts, expected = reference
    overrides = {**VARIANTS["compact"], "serving": {"max_running_requests": 4}}
    pkg = load_package(compile_variant(tmp, "tiny_cpu_static.yaml", overrides, "modes_forced"))
    runtime = Runtime(pkg, forced_budget_fraction=fraction)
    outputs, stats = runtime.generate(prompts, MAX_NEW)
    assert outputs == expected
    if fraction == 0.0:  # only the roots: exactly one row, one committed token per request-step
        assert stats.verify_rows == stats.request_steps == stats.committed_tokens
    else:
        assert stats.request_steps < stats.verify_rows < stats.request_steps * runtime.plan.num_draft_tokens
