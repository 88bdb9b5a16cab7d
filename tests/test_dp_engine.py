"""DP attention's engine half, piece by piece: the global tier and the uniform fallback, a plan refilled for
the global tier, rank 0's dispatch and its merged counters (the end-to-end runs are in
test_dp_attention_serving.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dspark.modes import VerifyMode
from dspark.runtime.distributed.dp_engine import DPDispatch, RequestSpec, merge_stats, merge_steps
from dspark.runtime.distributed.tensor_parallel import TPGroup
from dspark.runtime.engine.requests import Request
from dspark.runtime.engine.stats import RunStats, StepInfo
from dspark.runtime.engine.step_sync import GlobalVerify, LocalSync, VerifyReport, global_verify
from dspark.runtime.planner.budget import Ranking
from dspark.runtime.planner.verify_plan import AdaptiveVerifyPlan, StaticVerifyPlan

TIERS = (8, 16, 24, 32, 48, 64)


def test_the_global_tier_is_the_largest_any_dp_rank_needs() -> None:
    busy, light = VerifyReport(3, 30, 32, True), VerifyReport(1, 5, 8, True)
    idle = VerifyReport(0, 0, 0, True)
    assert global_verify([light, busy, idle], TIERS, lambda b: 8, False) == GlobalVerify(32, 30, None)
    # aligned: every DP rank fills its rows up to the tier, so the logits cover all of it
    assert global_verify([light, busy], TIERS, lambda b: 8, True) == GlobalVerify(32, 32, None)
    # without tiers the step runs the most rows of any DP rank
    assert global_verify([VerifyReport(2, 7, 7, True), VerifyReport(1, 3, 3, True)], (), lambda b: 8,
                         False) == GlobalVerify(7, 7, None)
    assert global_verify([idle, idle], TIERS, lambda b: 8, False) == GlobalVerify(0, 0, None)


def test_one_dp_rank_that_cannot_plan_makes_the_step_uniform() -> None:
    reports = [VerifyReport(3, 0, 0, False), VerifyReport(5, 17, 24, True)]
    # every request verifies the uniform rows of the largest batch: 5 x 4 = 20 rows, tier 24
    assert global_verify(reports, TIERS, lambda b: {5: 4}[b], False) == GlobalVerify(24, 20, 4)
    assert global_verify(reports, (), lambda b: 8, True) == GlobalVerify(40, 40, 8)


def _compact(**changes: object) -> AdaptiveVerifyPlan:
    return AdaptiveVerifyPlan(gamma=7, mode=VerifyMode.COMPACT, max_verify_len=8, token_tiers=TIERS,
                              **changes)


def test_alignment_fills_the_global_tier_with_the_next_best_drafts() -> None:
    plan = _compact(align_to_graph_tier=True, forced_budget_fraction=0.1)
    logits = torch.tensor([[4.0, 3, 2, -1, -2, -3, -4], [4.0, -1, -2, -3, -4, -5, -6],
                           [1.0, 0, 0, 0, 0, 0, 0]])
    step = plan.plan_step(logits, 3, [0, 1, 2], [0, 0, 0])
    assert sum(step.run_lens) == 8  # 3 roots + 2 drafts, aligned to fill the local tier of 8
    filled = plan.align_to_tier(step, 16)  # another DP rank needs 16: its padding here is paid for too
    assert sum(filled.verify_lens) == 16 and filled.run_lens == filled.verify_lens
    assert filled.aligned_budget == 13  # the next-best candidates, as the planner allocates a budget
    assert filled.verify_lens == tuple(Ranking.of(step.survival, plan.schedule).verify_lens(13).tolist())
    # never past B x cap, never below survival_eps (request 1's last two drafts)
    assert plan.align_to_tier(step, 64).verify_lens == (8, 6, 8)
    # without alignment, or in a mode that runs every row anyway, the plan stays as it was
    assert _compact().align_to_tier(step, 16) is step
    assert StaticVerifyPlan(gamma=7).align_to_tier(step, 16) is step


def test_the_uniform_step_verifies_the_same_rows_for_every_request() -> None:
    plan = _compact()
    assert plan.uniform_rows(3) == 8 and plan.uniform_rows(16) == 4  # 64 rows hold 16 requests of 4
    step = plan.uniform_step(3, 4)
    assert step.verify_lens == step.run_lens == (4, 4, 4)
    cap_accept = AdaptiveVerifyPlan(gamma=7, mode=VerifyMode.CAP_ACCEPT, max_verify_len=8)
    assert cap_accept.uniform_rows(3) == 8 and cap_accept.uniform_step(2, 8).run_lens == (8, 8)
    static = StaticVerifyPlan(gamma=3)
    assert static.uniform_rows(5) == 4 and static.uniform_step(2, 4).verify_lens == (4, 4)


class _Scheduler:
    def __init__(self) -> None:
        self.waiting: list[Request] = []
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.aborted: list[Request] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def enqueue(self, r: Request) -> None:
        self.waiting.append(r)

    def abort(self, r: Request) -> None:
        self.waiting.remove(r)
        self.aborted.append(r)


def _dispatch(size: int) -> DPDispatch:
    engines = TPGroup(0, size, object())  # type: ignore[arg-type]  # no collective runs here
    runtime = SimpleNamespace(ranks=SimpleNamespace(engines=engines), scheduler=_Scheduler())
    return DPDispatch(runtime)  # type: ignore[arg-type]


def test_requests_go_to_the_dp_rank_with_the_fewest_unfinished() -> None:
    dispatch = _dispatch(3)
    requests = [Request(i, [1, 2], 4, seed=i) for i in range(5)]
    for r in requests:
        dispatch.enqueue(r)
    assert dispatch.runtime.scheduler.waiting == [requests[0], requests[3]]  # DP rank 0, then ties to it
    assert [r.rid for r in dispatch.new[1]] == [1, 4] and [r.rid for r in dispatch.new[2]] == [2]
    assert RequestSpec.of(requests[1]) == RequestSpec(1, (1, 2), 4, requests[1].sampling, False, 1)
    assert dispatch.has_work


def test_an_abort_reaches_the_engine_that_holds_the_request() -> None:
    dispatch = _dispatch(2)
    local, remote, sent = (Request(i, [1], 4) for i in range(3))
    for r in (local, remote):
        dispatch.enqueue(r)
    dispatch.abort(local)  # rank 0's own: out of its scheduler at once
    assert dispatch.runtime.scheduler.aborted == [local]
    dispatch.abort(remote)  # never sent: dropped here
    assert remote.done and remote.finish_reason == "abort"
    assert dispatch.new[1] == [] and not dispatch.aborts[1]
    dispatch.enqueue(sent)  # DP rank 0 is empty again
    dispatch.remote[sent.rid] = (1, sent)  # as if it had been sent to DP rank 1
    dispatch.abort(sent)
    assert dispatch.aborts[1] == [sent.rid] and dispatch.unfinished(1) == 0


def test_the_dp_ranks_counters_merge_into_one_run() -> None:
    a = RunStats(gamma=2, requests=2, steps=5, request_steps=8, committed_tokens=20, decode_seconds=1.0)
    b = RunStats(gamma=2, steps=7, request_steps=7, committed_tokens=14, decode_seconds=1.5)
    a.drafts_verified, b.drafts_verified = [8, 6], [7, 7]
    merged = merge_stats([a, b])
    assert (merged.requests, merged.steps, merged.request_steps, merged.committed_tokens) == (2, 7, 15, 34)
    assert merged.decode_seconds == 1.5 and merged.drafts_verified == [15, 13]
    step = StepInfo(num_reqs=2, committed=9, rows=12, planned_rows=12, padding_rows=4, tier=16, budget=5,
                    tau=7.5, seconds=0.1)
    other = StepInfo(num_reqs=1, committed=3, rows=6, planned_rows=6, padding_rows=10, tier=16, budget=None,
                     tau=None, seconds=0.2)
    assert merge_steps([step, None, other]) == StepInfo(
        num_reqs=3, committed=12, rows=18, planned_rows=18, padding_rows=14, tier=16, budget=None, tau=None,
        seconds=0.2)
    assert merge_steps([None, None]) is None


@pytest.mark.parametrize("seed", [None, 7])
def test_a_request_spec_rebuilds_the_request(seed: int | None) -> None:
    r = Request(3, [5, 6], 9, ignore_eos=True, seed=seed)
    spec = RequestSpec.of(r)
    assert (spec.rid, spec.prompt, spec.max_new_tokens, spec.ignore_eos) == (3, (5, 6), 9, True)
    assert spec.seed == seed


def test_one_engine_alone_agrees_with_itself() -> None:
    """`LocalSync`: every agreement is the engine's own step, and a planner's refusal stays a refusal
    (there is no other engine's step to fall in with)."""
    local = LocalSync()
    assert not local.spans_ranks
    assert local.agree_extend(13, 2, 5) == (13, 2, 5)
    report = VerifyReport(3, 17, 24, True)
    assert local.agree_verify(report, TIERS, lambda b: 8, True) == GlobalVerify(24, 17, None)
    error = ValueError("the floor alone needs more rows than the largest tier")
    with pytest.raises(ValueError, match="floor alone"):
        local.unplanned(3, error)
    from dspark.runtime.planner.switch import Prediction

    prediction = Prediction(4, 12.0, 0.01, 0.004)
    assert local.agree_prediction(prediction) is prediction
    local.check("verify step", 1, 2)  # nothing to compare with


def test_a_step_filled_to_the_global_tier_is_priced_at_the_rows_it_runs() -> None:
    table = {"type": "additive", "bias_seconds": 0.01, "bs_probes": [1, 8], "alpha_seconds": [0.0, 0.004],
             "m_probes": [1, 64], "theta_seconds": [0.0, 0.0315], "draft_bs_probes": [1, 8],
             "draft_seconds": [0.002, 0.003]}
    plan = _compact(align_to_graph_tier=True, cost_model=table)
    logits = torch.tensor([[4.0, 3, 2, -1, -2, -3, -4], [4.0, -1, -2, -3, -4, -5, -6],
                           [1.0, 0, 0, 0, 0, 0, 0]])
    step = plan.plan_step(logits, 3, [0, 1, 2], [0, 0, 0], offset_seconds=0.001)
    assert step.step_seconds == pytest.approx(plan.table.step_time(3, sum(step.verify_lens))
                                              + plan.table.draft_time(3) + 0.001)
    filled = plan.align_to_tier(step, 32)
    assert sum(filled.verify_lens) > sum(step.verify_lens)
    assert filled.step_seconds == pytest.approx(plan.table.step_time(3, sum(filled.verify_lens))
                                                + plan.table.draft_time(3) + 0.001)
