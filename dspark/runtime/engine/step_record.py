"""The record of one speculative decode step that a recording run keeps (`steps.jsonl`)."""

from __future__ import annotations

from typing import Any

import torch

from dspark.runtime.kv_cache import SlotHandle
from dspark.runtime.layout import RaggedVerifyLayout
from dspark.runtime.planner.verify_plan import StepPlan


def step_record(handles: list[SlotHandle], step: StepPlan, layout: RaggedVerifyLayout, lens: list[int],
                correct: list[int], raw: list[int], conf_logits: torch.Tensor, seconds: float,
                lag_steps: int, mode: str) -> dict[str, Any]:
    decision = step.decision
    survival = step.survival.tolist() if step.survival is not None else [None] * len(lens)
    confidence = conf_logits.float().tolist()
    return {
        "num_reqs": len(lens), "lag": lag_steps, "mode": str(mode),
        "budget": decision.budget if decision else None, "aligned_budget": step.aligned_budget,
        "decision_tau": decision.tau if decision else None,
        "planned_rows": sum(lens), "rows": layout.total_rows, "tier": layout.graph_num_tokens,
        "padding_rows": layout.num_padding_rows, "tau": step.tau,
        "committed": sum(correct) + len(correct),
        "predicted_step_seconds": decision.predicted_step_seconds if decision else None,
        "step_seconds": seconds,
        "requests": [{"slot": h.slot, "generation": h.generation, "verify_len": vl, "correct_len": c,
                      "raw_correct_len": rc, "commit_len": c + 1, "confidence": z, "survival": s}
                     for h, vl, c, rc, z, s in zip(handles, lens, correct, raw, confidence, survival,
                                                   strict=True)],
    }
