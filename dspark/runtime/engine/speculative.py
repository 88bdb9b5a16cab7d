"""One speculative decode step of the running batch: draft → plan → verify → accept → commit.

The deployment-specific parts come from the generated package: the plan (`planner_config.py`)
decides each request's `verify_lens`, the verify runner (`graph_runner.py`) lays the step out once
and runs its target forward, the metadata builder (`attn_metadata.py`) feeds the attention. This
module is the same for every deployment and mode: a static or cap-accept layout is the full
`B x N` block, so packing and unpacking its rows are no-ops (docs/architecture.md, "A decode step").

The engines that run the step together agree on it between planning and laying it out (`sync`: under
DP attention `dspark.runtime.distributed.dp_sync`, alone `LocalSync`): every DP rank runs the global
tier, fills it when aligning to graph tiers, falls back to the uniform step when one could not plan, and
a DP rank without requests runs an idle layout of padding requests.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from dspark.runtime.engine.forward import EngineModels, batch_sampling
from dspark.runtime.engine.requests import Request
from dspark.runtime.engine.scheduler import commit_tokens
from dspark.runtime.engine.stats import RunStats, StepInfo
from dspark.runtime.engine.step_forward import LogitsForward, StepForwards, VerifyForward
from dspark.runtime.engine.step_record import step_record
from dspark.runtime.engine.step_sync import GlobalVerify, StepSync, VerifyReport
from dspark.runtime.kernels.accept import AcceptResult, greedy_accept
from dspark.runtime.kv_cache import SlotHandle
from dspark.runtime.layout import tier_for
from dspark.runtime.planner.cost_models import AdditiveCostTable
from dspark.runtime.planner.online_calibration import OnlineCalibrator
from dspark.runtime.planner.online_cost import OnlineCostRefit, plan_cost_model
from dspark.runtime.planner.step_offset import StepOffset
from dspark.runtime.planner.survival import LaggedSurvival
from dspark.runtime.planner.verify_plan import StepPlan, VerifyPlan
from dspark.runtime.sampling import SamplingParams, pick_rows, rejection_accept, warp_rows


class StsSink(Protocol):
    """Where a recording run's calibration samples go (`dspark.formats.sts_shards.StsShardWriter`)."""

    @property
    def features(self) -> bool: ...

    def add(self, logits: torch.Tensor, correct_len: torch.Tensor, fully_verified: torch.Tensor,
            features: torch.Tensor | None) -> None: ...


class StepSink(Protocol):
    def append(self, record: object) -> None: ...


class StepRecorder(Protocol):
    """A recording run's sinks: calibration shards and the step ring."""

    sts: StsSink
    steps: StepSink


class SpeculativeStep:
    def __init__(self, models: EngineModels, plan: VerifyPlan, forward: StepForwards,
                 eos_ids: frozenset[int], policy: SamplingParams, sync: StepSync) -> None:
        self.models = models
        self.sync = sync
        self.plan = plan
        self.forward = forward
        self.eos_ids = eos_ids
        self.policy = policy  # the run's default policy: the one recorded labels describe
        # The lagged-confidence history belongs to the runtime; a plan is shared, immutable config.
        lag = plan.history_lag()
        self.history = LaggedSurvival(lag, plan.gamma) if lag else None
        # What a step costs here beyond its table price, measured over the last steps and added to every
        # price the planner weighs (the off state's included).
        self.offset = StepOffset(plan.step_offset_window)
        self.recorder: StepRecorder | None = None
        # Online calibration (`planner.online_calibration`): the labels of every drafted step, and the
        # temperatures it refits, swapped into this step's plan between steps.
        self.online: OnlineCalibrator | None = None
        # Online cost refit (`planner.online_cost`): every step's measured seconds, and the refitted table the
        # runtime swaps in between steps (`use_cost_table`); the next record carries the swap's number.
        self.cost_refit: OnlineCostRefit | None = None
        self._cost_swap: int | None = None
        # the planner's off state, for the next step's record: is it a probe, and the steps without
        # speculation since the last drafted one (`note_off_step`)
        self.probe = False
        self._off_steps, self._off_seconds = 0, 0.0

    def __call__(self, running: list[Request], stats: RunStats) -> StepInfo | None:
        """One step of `running`; None when no request ran (a DP rank without requests, padding the step
        of the others)."""
        if not running:
            self._idle()
            return None
        start = time.perf_counter()
        swapped = self.online.poll() if self.online is not None else None
        if swapped is not None:  # a refit finished: it plans from this step on
            self.plan = self.plan.with_overrides(  # type: ignore[attr-defined]
                temperatures=swapped.temperatures, survival_map=swapped.survival_map)
        m, n, num_reqs = self.models, self.plan.num_draft_tokens, len(running)
        prefix_host = [r.seq_len for r in running]
        page_table = m.host_page_table(running).to(m.device)
        roots = m.tensor([r.root for r in running])
        batch = batch_sampling(running)
        generator = m.generators(running)

        # 1. Draft: gamma tokens and a confidence logit per position, from the cached draft context.
        proposal = m.propose(
            roots, prefix_host, page_table,
            None if batch.all_greedy else lambda logits: pick_rows(logits, batch, generator),
            gamma=self.plan.gamma, keep_conf_inputs=self.recorder is not None and self.recorder.sts.features)
        drafts = proposal.drafts
        assert drafts is not None

        # 2. Plan: the planner's verify_lens, then the step's layout, once.
        handles = [r.handle for r in running]
        offset = self.offset.seconds
        context_len = sum(prefix_host) / num_reqs
        plan, tier, logit_rows = self._plan(proposal.conf_logits, handles, offset,
                                            [not r.sampling.greedy for r in running], context_len)
        self._check(tier, logit_rows)

        # 3. Verify: the step's layout, once, and the target's forward of its rows (packed when some
        #    request runs fewer than N).
        fixed_ids = torch.cat((roots[:, None], drafts), dim=1).reshape(-1)
        layout, _, states = self.forward.verify(VerifyForward(
            plan.run_lens, plan.verify_lens, tuple(prefix_host), page_table,
            tuple(h.slot for h in handles), tier, fixed_ids))
        assert states is not None
        logits = self.forward.logits(LogitsForward(None, logit_rows))

        # 4. Accept, back at the fixed stride; rows that did not run are never read.
        raw_correct: torch.Tensor | None = None
        accept_prob: torch.Tensor | None = None
        if batch.all_greedy:
            pred = layout.unpack(logits.argmax(-1), fill=-1).view(num_reqs, n)
            acc: AcceptResult = greedy_accept(drafts, pred, layout.verify_lens)
            if self.recorder is not None or self.online is not None:
                # the uncapped match over the rows that ran (one that did not reads -1, which no draft is):
                # exact labels wherever a draft was verified
                match = drafts == pred[:, :-1]
                raw_correct = match.cumprod(dim=1).sum(dim=1)
                if self.recorder is not None:
                    accept_prob = match.float()
        else:
            p_probs = warp_rows(layout.unpack(logits).view(num_reqs, n, -1), batch)
            verdict = rejection_accept(drafts, warp_rows(proposal.logits, batch), p_probs, layout.verify_lens,
                                       generator)
            acc, raw_correct, accept_prob = verdict.result, verdict.raw_correct_len, verdict.accept_prob

        # 5. Commit: the root and the accepted drafts become draft context; the bonus token is the next root.
        real = slice(0, layout.total_rows)
        row_req, positions = layout.row_req[real], layout.positions[real]
        keep = positions - layout.prefix_lens[row_req] <= acc.correct_len[row_req]
        m.append_draft_context(states[keep], positions[keep], row_req[keep], page_table)
        correct, bonus = acc.correct_len.tolist(), acc.bonus.tolist()
        for r, c, b, d in zip(running, correct, bonus, drafts.tolist(), strict=True):
            r.seq_len += c + 1
            r.root = b
            commit_tokens(r, d[:c] + [b], self.eos_ids)
        stats.record_step(correct, list(plan.verify_lens), layout, plan)
        seconds = time.perf_counter() - start  # the step's wall time, before any recording work
        decision = plan.decision
        if plan.step_seconds is not None:  # the price of the rows that ran, against what they took
            self.offset.observe(plan.step_seconds - offset, seconds)

        # 6. Learn and record: the step's seconds for the cost refit, online calibration's labels; with
        #    `dspark run --record`, the calibration shards' labels and the step's record.
        if self.cost_refit is not None:
            self.cost_refit.observe_drafted(num_reqs, sum(plan.verify_lens), context_len, seconds)
        if self.online is not None and proposal.conf_logits is not None and raw_correct is not None:
            self.online.observe(proposal.conf_logits, raw_correct.tolist(), plan.run_lens,
                                [r.rid for r in running], [len(r.output) for r in running],
                                [r.sampling == self.policy for r in running])
        if self.recorder is not None and proposal.conf_logits is not None and raw_correct is not None:
            # Labels are the acceptance event of the recorded policy, and exact only where every row ran.
            same_policy = torch.tensor([r.sampling == self.policy for r in running], device=m.device)
            fully_verified = torch.tensor([rows == n for rows in plan.run_lens], device=m.device)
            self.recorder.sts.add(proposal.conf_logits, raw_correct, fully_verified & same_policy,
                                  proposal.conf_inputs)
            self.recorder.steps.append(step_record(
                handles, step=plan, layout=layout, lens=list(plan.verify_lens), correct=correct,
                raw=raw_correct.tolist(), conf_logits=proposal.conf_logits, seconds=seconds,
                accept_prob=None if accept_prob is None else accept_prob.tolist(),
                lag_steps=self.plan.lag_steps, mode=self.plan.mode, probe=self.probe,
                off_steps=self._off_steps, off_seconds=self._off_seconds, offset_seconds=offset,
                offset_slope=self.offset.slope,
                context_len=context_len, temperatures=None if swapped is None else swapped.temperatures,
                cost_refit=self._cost_swap))
        self._off_steps, self._off_seconds, self._cost_swap = 0, 0.0, None
        return StepInfo(num_reqs=num_reqs, committed=sum(correct) + num_reqs, rows=layout.total_rows,
                        planned_rows=sum(plan.verify_lens), padding_rows=layout.num_padding_rows,
                        tier=layout.tier, budget=decision.budget if decision else None, tau=plan.tau,
                        seconds=seconds)

    def use_cost_table(self, table: AdditiveCostTable, refit: int) -> None:
        """Between steps: plan with the online cost refit's table `refit` (its number) from the next step on.
        The step offset starts afresh: its fit measured the excess over the old table, most of which the
        refit has moved into the table itself, and what it holds would be counted twice."""
        self.plan = self.plan.with_overrides(cost_model=plan_cost_model(table))  # type: ignore[attr-defined]
        self.offset = StepOffset(self.plan.step_offset_window)
        self._cost_swap = refit

    def note_off_step(self, seconds: float) -> None:
        """A decode step without speculation ran (the planner's off state): the next record counts it."""
        self._off_steps += 1
        self._off_seconds += seconds

    def _plan(self, conf_logits: torch.Tensor | None, handles: list[SlotHandle], offset: float,
              sampled: list[bool], context_len: float) -> tuple[StepPlan, int, int]:
        """The step's plan (priced at the batch's mean `context_len`), and the tier and logit rows every
        engine that runs it runs."""
        num_reqs = len(handles)
        slots, generations = [h.slot for h in handles], [h.generation for h in handles]
        own: StepPlan | None
        try:
            own = self.plan.plan_step(conf_logits, num_reqs, slots, generations, self.history, offset,
                                      sampled, context_len)
            if self.online is not None and self.online.explores():
                own = self.plan.uniform_step(num_reqs, self.plan.num_draft_tokens)  # labels for low scores
            rows = sum(own.run_lens)
            report = VerifyReport(num_reqs, rows, self._tier_of(rows), True)
        except ValueError as error:  # the planner's refusals, and a step past the largest tier
            own, report = None, self.sync.unplanned(num_reqs, error)
        agreed = self._agree(report)
        if agreed.uniform_rows is not None:
            return self.plan.uniform_step(num_reqs, agreed.uniform_rows), agreed.tier, agreed.logit_rows
        assert own is not None  # every engine planned
        return self.plan.align_to_tier(own, agreed.tier, context_len), agreed.tier, agreed.logit_rows

    def _tier_of(self, rows: int) -> int:
        tiers = self.forward.runner.shape.tiers
        return tier_for(rows, tiers) if tiers else rows

    def _agree(self, report: VerifyReport) -> GlobalVerify:
        return self.sync.agree_verify(report, self.forward.runner.shape.tiers, self.plan.uniform_rows,
                                      self.plan.fills_tier)

    def _check(self, tier: int, logit_rows: int) -> None:
        """In the check mode, every engine is about to run the same tier and logit rows (or fails loudly)."""
        self.sync.check("verify step (tier, logit rows)", tier, logit_rows)

    def _idle(self) -> None:
        """A DP rank without requests: run the others' verify step on padding requests alone."""
        agreed = self._agree(VerifyReport(0, 0, 0, True))
        if not agreed.tier:
            return
        m = self.models
        self._check(agreed.tier, agreed.logit_rows)
        self.forward.verify(VerifyForward((), (), (), m.host_page_table([]), (), agreed.tier, m.tensor([])))
        self.forward.logits(LogitsForward(None, agreed.logit_rows))
