"""`dspark.simulate`: the policies' arithmetic on hand-made traces whose answers are known, the
oracle's and static's relations to the fixed verify lengths, the run replay, and traces refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.formats.run_info import RUN_FORMAT, RUN_VERSION, RunInfo, write_run_info
from dspark.formats.step_records import RequestRecord, StepRecord, StepRing
from dspark.modes import VerifyMode
from dspark.runtime.planner.cost_models import AdditiveCostTable, SpsTable
from dspark.runtime.planner.survival import LaggedSurvival, survival_from_logits
from dspark.runtime.planner.verify_plan import AdaptiveVerifyPlan
from dspark.simulate.policies import (
    AdaptivePolicy,
    Batch,
    FixedPolicy,
    InformedPolicy,
    OraclePolicy,
    StaticPolicy,
    StepLens,
    dropped_drafts,
    policies_for,
)
from dspark.simulate.pricing import StepPricer
from dspark.simulate.run_replay import replay_run
from dspark.simulate.sweep import compare, simulate, simulate_concurrency
from dspark.simulate.trace import Trace, TraceError, read_trace, trace_from_steps

GAMMA = 3
N = GAMMA + 1
RAW = [0, 1, 3, 2]
# T(M) = 1 s + 10 ms per row beyond the first, up to 16 rows: a fixed part plus rows at a constant price.
LINEAR = {"bias_seconds": 1.0, "bs_probes": [1, 4], "alpha_seconds": [0.0, 0.0], "m_probes": [1, 16],
          "theta_seconds": [0.0, 0.15]}


def seconds(rows: int) -> float:
    return 1.0 + 0.01 * (rows - 1)


def logits_for(raw: int, sure: float = 30.0) -> list[float]:
    """Confidence that is right: drafts 1..raw certain to match, the rest certain not to."""
    return [sure if k < raw else -sure for k in range(GAMMA)]


def hand_trace(raw: list[int] = RAW, steps_per_request: int = 1) -> Trace:
    """One request-step per (request, step); request r at step s has raw_correct_len raw[r]."""
    rows = [(s, r) for s in range(steps_per_request) for r in range(len(raw))]
    return Trace(source="hand", gamma=GAMMA, policy="greedy", mode=VerifyMode.STATIC,
                 confidence=np.array([logits_for(raw[r]) for _, r in rows], dtype=np.float32),
                 raw_correct_len=np.array([raw[r] for _, r in rows]),
                 step=np.array([s for s, _ in rows]), request=np.array([r for _, r in rows]),
                 offset=np.array([s * (raw[r] + 1) for s, r in rows]),
                 commit_len=np.array([raw[r] + 1 for _, r in rows]))


def plan(cost_model: dict | None = None, **changes) -> AdaptiveVerifyPlan:
    return AdaptiveVerifyPlan(gamma=GAMMA, mode=VerifyMode.COMPACT, cost_model=cost_model or LINEAR,
                              **changes)


def test_every_policy_commits_and_costs_what_the_hand_arithmetic_says() -> None:
    # Concurrency 4 over a trace of 4 request-steps draws all of them each step (without replacement).
    trace, adaptive_plan = hand_trace(), plan()
    pricer = StepPricer(adaptive_plan.table)
    policies = policies_for(adaptive_plan, pricer.decode_time)
    results = {(r.policy, r.verify_len): r
               for r in simulate_concurrency(trace, policies, pricer, 4, steps=3, seed=1)}
    # Per request: min(raw, verify_len - 1) + 1 tokens.
    expected = {("target-only", None): (4, 4), ("static", None): (10, 16), ("fixed", 1): (4, 4),
                ("fixed", 2): (7, 8), ("fixed", 3): (9, 12),
                ("fixed", 4): (10, 16), ("oracle", None): (10, 10)}
    for key, (tokens, rows) in expected.items():
        r = results[key]
        assert (r.tokens_per_step, r.rows_per_step) == (tokens, rows), key
        assert r.tokens_per_s == pytest.approx(tokens / seconds(rows)), key
    # Confidence that is exactly right and rows far cheaper than tokens: the planner verifies exactly
    # the drafts that match, which is the oracle's plan.
    assert (results["adaptive", None].tokens_per_step, results["adaptive", None].rows_per_step) == (10, 10)
    assert results["adaptive", None].tokens_per_s == pytest.approx(results["oracle", None].tokens_per_s)


def test_the_drafts_a_planner_left_out_are_weighed_against_what_would_have_been_accepted() -> None:
    survival = np.array([[0.9, 0.5, 0.1], [0.8, 0.6, 0.2]])
    lens = StepLens(np.array([1, 3]), 4, survival)
    # Request 0 verified its root only: drafts 1-3 left out, 1 and 2 would have matched (raw 2);
    # request 1 left out draft 3, which would have matched (raw 3).
    assert dropped_drafts(lens, np.array([2, 3])) == (pytest.approx(0.9 + 0.5 + 0.1 + 0.2), 3, 4)
    assert dropped_drafts(StepLens(np.array([1, 3]), 4), np.array([2, 3])) is None
    trace, adaptive_plan = hand_trace(), plan()
    result = simulate_concurrency(trace, [AdaptivePolicy(adaptive_plan)], StepPricer(adaptive_plan.table), 4,
                                  steps=2, seed=0)[0]
    # Exactly right confidence: every draft left out has survival ~0 and would have been rejected.
    assert result.dropped is not None and result.dropped.count == 2 * (3 + 2 + 0 + 1)
    assert result.dropped.reached == 0 and result.dropped.mean_survival < 1e-9


def test_the_draft_term_and_an_sps_table_price_the_step() -> None:
    with_draft = {**LINEAR, "draft_bs_probes": [1, 8], "draft_seconds": [0.5, 0.5]}
    pricer = StepPricer(plan(with_draft).table)
    assert pricer.seconds(4, 16) == pytest.approx(seconds(16) + 0.5)
    sps = StepPricer(SpsTable(sample_batch_tokens=(1, 8, 16), sample_steps_per_sec=(10.0, 5.0, 2.0),
                              max_batch_tokens=16))
    trace = hand_trace()
    results = {(r.policy, r.verify_len): r for r in simulate_concurrency(
        trace, [StaticPolicy(N), FixedPolicy(1), FixedPolicy(2)], sps, 4, steps=2, seed=0)}
    # Looked up by floor: 16 rows -> 2 steps/s, 4 rows -> the probe at 1 (10/s), 8 rows -> 5/s.
    assert results["static", None].tokens_per_s == pytest.approx(10 * 2.0)
    assert results["fixed", 1].tokens_per_s == pytest.approx(4 * 10.0)
    assert results["fixed", 2].tokens_per_s == pytest.approx(7 * 5.0)


def test_tiers_pad_the_rows_a_step_runs() -> None:
    pricer = StepPricer(plan().table, tiers=(4, 8, 16))
    trace = hand_trace()
    oracle = simulate_concurrency(trace, [OraclePolicy(N)], pricer, 4, steps=2, seed=0)[0]
    assert oracle.rows_per_step == 16  # 10 rows replay in the 16-row tier
    assert oracle.tokens_per_s == pytest.approx(10 / seconds(16))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_beats_every_fixed_k_and_static_is_fixed_n_on_a_random_trace(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 200
    raw = rng.integers(0, GAMMA + 1, size=n)
    trace = Trace(source="random", gamma=GAMMA, policy="greedy", mode=VerifyMode.STATIC,
                  confidence=rng.normal(1.0, 2.0, size=(n, GAMMA)).astype(np.float32), raw_correct_len=raw,
                  step=np.arange(n), request=np.arange(n), offset=np.zeros(n, dtype=np.int64),
                  commit_len=raw + 1)
    # A fixed part plus rows at a falling marginal price (the condition in dspark.simulate.sweep).
    concave = {"bias_seconds": 0.004, "bs_probes": [1, 64], "alpha_seconds": [0.0, 0.002],
               "m_probes": [1, 64, 256], "theta_seconds": [0.0, 0.006, 0.015]}
    adaptive_plan = plan(concave)
    pricer = StepPricer(adaptive_plan.table)
    results = simulate(trace, policies_for(adaptive_plan, pricer.decode_time), pricer, [1, 8, 32], steps=50,
                       seed=seed)
    for c in (1, 8, 32):
        at = [r for r in results if r.concurrency == c]
        by = {(r.policy, r.verify_len): r for r in at}
        fixed = [r for r in at if r.policy == "fixed"]
        assert len(fixed) == N
        assert all(by["oracle", None].tokens_per_s >= r.tokens_per_s for r in at)
        static, full = by["static", None], by["fixed", N]
        assert (static.tokens_per_s, static.tokens_per_step, static.rows_per_step) == \
            (full.tokens_per_s, full.tokens_per_step, full.rows_per_step)
    comparisons = compare(results)
    assert [c.concurrency for c in comparisons] == [1, 8, 32]
    for comparison in comparisons:
        best = max((r for r in results if r.concurrency == comparison.concurrency and r.policy == "fixed"),
                   key=lambda r: r.tokens_per_s)
        assert comparison.best_fixed_verify_len == best.verify_len


def test_draws_are_seeded_per_concurrency() -> None:
    trace, adaptive_plan = hand_trace([0, 1, 2, 3, 3, 1, 0, 2]), plan()
    pricer, policies = StepPricer(adaptive_plan.table), [StaticPolicy(N), FixedPolicy(2)]
    alone = simulate(trace, policies, pricer, [3], steps=20, seed=5)
    together = simulate(trace, policies, pricer, [1, 3], steps=20, seed=5)
    assert alone == [r for r in together if r.concurrency == 3]
    assert simulate(trace, policies, pricer, [3], steps=20, seed=6) != alone


def test_a_lagged_plan_budgets_from_the_same_requests_earlier_step() -> None:
    trace = hand_trace(steps_per_request=2)
    source = trace.lag_source(1)
    assert source.tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
    lagged_plan = plan(lag_steps=1)
    rows = np.array([4, 1, 6])  # two requests with a step one step earlier, one without (row 1: step 0)
    batch = Batch(trace.confidence[rows], trace.raw_correct_len[rows],
                  trace.confidence[np.maximum(source[rows], 0)], source[rows] >= 0)
    got = AdaptivePolicy(lagged_plan).lens(batch)
    history = LaggedSurvival(1, GAMMA)
    known = [0, 2]
    history.record(known, [0, 0], survival_from_logits(torch.from_numpy(trace.confidence[[0, 2]])))
    want = lagged_plan.plan_step(torch.from_numpy(trace.confidence[rows]), 3, [0, 1, 2], [0, 0, 0], history)
    assert got.verify_lens.tolist() == list(want.verify_lens)
    assert got.run_rows == sum(want.run_lens)


def test_replaying_the_recorded_policy_reproduces_the_run() -> None:
    # Two steps per request; static replays them exactly, and a request stops at what it committed.
    trace = hand_trace(steps_per_request=2)
    pricer = StepPricer(plan().table)
    static = replay_run(trace, StaticPolicy(N), pricer)
    assert (static.steps, static.request_steps, static.tokens) == (2, 8, 20)
    assert static.seconds == pytest.approx(2 * seconds(16))
    one = replay_run(trace, FixedPolicy(1), pricer)
    # One token per step: each request needs as many steps as tokens; the batch drains as they finish.
    assert one.tokens == 20 and one.steps == 8 and one.request_steps == 20


def _write_recording(directory: Path, mode: VerifyMode = VerifyMode.STATIC, confidence: bool = True,
                     raw: int = 2) -> Path:
    ring = StepRing(10)
    lens = N if mode is VerifyMode.STATIC else 2
    for _ in range(2):
        correct = min(raw, lens - 1)
        req = RequestRecord(slot=0, generation=1, verify_len=lens, correct_len=correct, raw_correct_len=raw,
                            commit_len=correct + 1,
                            confidence=tuple(logits_for(raw)) if confidence else None,
                            survival=None)
        ring.append(StepRecord(num_reqs=1, lag=0, mode=mode, budget=None, aligned_budget=None,
                               decision_tau=None, planned_rows=lens, rows=lens, tier=lens, padding_rows=0,
                               tau=None, committed=correct + 1, predicted_step_seconds=None,
                               step_seconds=0.01, requests=(req,)))
    directory.mkdir(parents=True)
    ring.write(directory / "steps.jsonl")
    write_run_info(directory, RunInfo.from_json(
        {"format": RUN_FORMAT, "version": RUN_VERSION, "deployment": "hand", "verify_mode": mode.value,
         "gamma": GAMMA, "lag_steps": 0, "policy": "greedy", "tiers": [], "target_only": False,
         "recorded_steps": 2, "total_steps": 2}, "test"))
    return directory


def test_a_recording_reads_as_a_trace(tmp_path: Path) -> None:
    trace = read_trace(_write_recording(tmp_path / "rec") / "steps.jsonl")
    assert trace.size == 2 and trace.raw_correct_len.tolist() == [2, 2]
    assert trace.offset.tolist() == [0, 3] and trace.request.tolist() == [0, 0]


def test_recordings_a_replay_cannot_use_are_refused_naming_file_and_field(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"run\.json: verify_mode is compact"):
        read_trace(_write_recording(tmp_path / "compact", VerifyMode.COMPACT))
    with pytest.raises(TraceError, match=r"steps\.jsonl: step 0, requests\[0\]: confidence is null"):
        read_trace(_write_recording(tmp_path / "nohead", confidence=False))
    with pytest.raises(TraceError, match="no such recording directory"):
        read_trace(tmp_path / "missing")
    broken = _write_recording(tmp_path / "broken")
    (broken / "steps.jsonl").write_text('{"step": 0,\n')
    with pytest.raises(TraceError, match=r"steps\.jsonl:1: not valid JSON"):
        read_trace(broken)
    lying = _write_recording(tmp_path / "lying")
    lines = (lying / "steps.jsonl").read_text().splitlines()
    step = json.loads(lines[0])
    step["requests"][0]["raw_correct_len"] = GAMMA + 2
    (lying / "steps.jsonl").write_text(json.dumps(step) + "\n" + lines[1] + "\n")
    with pytest.raises(TraceError, match=r"requests\[0\]: raw_correct_len 5 is outside"):
        read_trace(lying)
    # A compact step in a run that says otherwise: the step's own mode is checked too.
    mixed = _write_recording(tmp_path / "mixed")
    compact_steps = _write_recording(tmp_path / "compact_steps", VerifyMode.COMPACT)
    (mixed / "steps.jsonl").write_text((compact_steps / "steps.jsonl").read_text())
    with pytest.raises(TraceError, match="step 0: mode is compact"):
        read_trace(mixed)
    with pytest.raises(TraceError, match="no decode steps"):
        trace_from_steps((), GAMMA, "greedy", "empty")


def test_a_table_that_does_not_fit_says_why() -> None:
    additive = StepPricer(AdditiveCostTable(**{**LINEAR, "bs_probes": (1, 4)}))
    assert additive.misfit(4, N) is None
    assert "largest batch probe 4" in (additive.misfit(8, N) or "")
    sps = StepPricer(SpsTable(sample_batch_tokens=(1, 8), sample_steps_per_sec=(10.0, 5.0),
                              max_batch_tokens=16))
    assert sps.misfit(4, N) is None and "max_batch_tokens is 16" in (sps.misfit(5, N) or "")
    assert "largest graph tier 8" in (StepPricer(plan().table, tiers=(4, 8)).misfit(4, N) or "")
    assert additive.fitting([1, 4, 8], N) == [1, 4]


def test_informed_plans_on_the_true_acceptance_probabilities() -> None:
    adaptive_plan = plan()
    raw = np.array(RAW)
    # Greedy, the probabilities are 0 or 1: the informed plan verifies exactly the oracle's rows.
    certain = (np.arange(GAMMA)[None, :] < raw[:, None]).astype(np.float32)
    batch = Batch(np.zeros((len(RAW), GAMMA), np.float32), raw, accept_prob=certain)
    informed = InformedPolicy(adaptive_plan).lens(batch)
    assert informed.verify_lens.tolist() == OraclePolicy(N).lens(batch).verify_lens.tolist()
    # Otherwise it is the plan itself, uncalibrated, on confidence whose sigmoid is the probability:
    # the calibration the package carries does not apply to the truth.
    prob = np.array([[0.9, 0.5, 0.1], [0.99, 0.95, 0.9], [0.2, 0.9, 0.9], [0.6, 0.6, 0.6]], np.float32)
    calibrated = plan(temperatures=(2.0, 0.5, 1.0))
    logits = torch.logit(torch.from_numpy(prob).double()).float().numpy()
    expected = AdaptivePolicy(plan()).lens(Batch(logits, raw)).verify_lens
    got = InformedPolicy(calibrated).lens(Batch(np.zeros_like(prob), raw, accept_prob=prob)).verify_lens
    assert got.tolist() == expected.tolist()
    with pytest.raises(ValueError, match="needs the trace's accept_prob"):
        InformedPolicy(adaptive_plan).lens(Batch(logits, raw))


def test_a_trace_with_acceptance_probabilities_adds_the_informed_bound(tmp_path: Path) -> None:
    trace = hand_trace()
    certain = (np.arange(GAMMA)[None, :] < trace.raw_correct_len[:, None]).astype(np.float32)
    trace = Trace(**{**trace.__dict__, "accept_prob": certain})
    adaptive_plan = plan()
    pricer = StepPricer(adaptive_plan.table)
    results = simulate(trace, policies_for(adaptive_plan, pricer.decode_time, informed=True), pricer, [4],
                       steps=3, seed=0)
    by = {r.policy: r for r in results if r.policy != "fixed"}
    assert by["informed"].tokens_per_s == pytest.approx(by["oracle"].tokens_per_s)
    comparison, = compare(results)
    assert comparison.adaptive_on_over_informed == pytest.approx(
        by["adaptive-on"].tokens_per_s / by["informed"].tokens_per_s)
    assert compare(simulate(hand_trace(), policies_for(adaptive_plan, pricer.decode_time), pricer, [4],
                            steps=3, seed=0))[0].adaptive_on_over_informed is None
    with pytest.raises(TraceError, match="accept_prob has shape"):
        Trace(**{**trace.__dict__, "accept_prob": certain[:, :2]})
