"""The record of one speculative decode step that a recording run keeps (`steps.jsonl`).

The record's fields and JSON are `dspark.formats.step_records`; this module only reads them off the
step the engine just ran. The ring that keeps the records numbers them (`StepRecord.step`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark.formats.step_records import RequestRecord, StepRecord
from dspark.modes import VerifyMode
from dspark.runtime.kv_cache import SlotHandle
from dspark.runtime.layout import VerifyLayout
from dspark.runtime.planner.verify_plan import StepPlan


def step_record(handles: Sequence[SlotHandle], *, step: StepPlan, layout: VerifyLayout, lens: Sequence[int],
                correct: Sequence[int], raw: Sequence[int], conf_logits: torch.Tensor | None, seconds: float,
                lag_steps: int, mode: VerifyMode, probe: bool = False, off_steps: int = 0,
                off_seconds: float = 0.0, offset_seconds: float = 0.0, offset_slope: float = 1.0,
                accept_prob: Sequence[Sequence[float]] | None = None, context_len: float | None = None,
                temperatures: Sequence[float] | None = None, cost_refit: int | None = None) -> StepRecord:
    """The step's record: `lens` the planned verify_lens, `correct` the accepted drafts, `raw` the uncapped
    match, `conf_logits` the draft's confidence logits (None without a confidence head); `probe`, `off_steps`
    and `off_seconds` the planner's off state (a drafted step while off, the target-only steps since the
    previous drafted one); `offset_seconds` the measured step offset the planner priced with, and
    `offset_slope` its fit's slope;
    `accept_prob` each draft's acceptance probability given its prefix (rows that did not run are
    recorded as they were computed, so only a fully verified request's are exact); `context_len` the
    batch's mean cached tokens a request, which the step was priced at; `temperatures` those online
    calibration swapped in before the step; `cost_refit` the number of the online cost refit swapped in
    before it."""
    decision = step.decision
    num_reqs = len(lens)
    survival = step.survival.tolist() if step.survival is not None else [None] * num_reqs
    confidence = conf_logits.float().tolist() if conf_logits is not None else [None] * num_reqs
    accepts = accept_prob if accept_prob is not None else [None] * num_reqs
    requests = tuple(
        RequestRecord(slot=h.slot, generation=h.generation, verify_len=int(vl), correct_len=int(c),
                      raw_correct_len=int(rc), commit_len=int(c) + 1,
                      confidence=None if z is None else tuple(z), survival=None if s is None else tuple(s),
                      accept_prob=None if a is None else tuple(a))
        for h, vl, c, rc, z, s, a in zip(handles, lens, correct, raw, confidence, survival, accepts,
                                         strict=True))
    return StepRecord(
        num_reqs=num_reqs, lag=lag_steps, mode=mode,
        budget=decision.budget if decision else None, aligned_budget=step.aligned_budget,
        decision_tau=decision.tau if decision else None,
        planned_rows=int(sum(lens)), rows=layout.total_rows, tier=layout.tier,
        padding_rows=layout.num_padding_rows, tau=step.tau,
        committed=int(sum(correct)) + num_reqs,
        predicted_step_seconds=step.step_seconds,  # the price of the rows that ran
        step_seconds=seconds, requests=requests, probe=probe, off_steps=off_steps, off_seconds=off_seconds,
        offset_seconds=offset_seconds, offset_slope=offset_slope, context_len=context_len,
        temperatures=None if temperatures is None else tuple(temperatures), cost_refit=cost_refit)
