"""DP attention's step agreements (`StepSync`): an all-gather of a few numbers over the DP ranks' engines.

Under DP attention (`dp_attention`, the model half) a forward's world-parallel modules gather the rows of
every DP rank, so every DP rank must make the same forward calls with the same number of rows. Each DP
rank's engine (its attention rank 0; the others follow it, `lockstep`) runs the usual scheduler, draft and
planner over its own requests and KV pool, and at these points of a step the engines agree:

1. Extend (a prefill chunk, a target-only decode): every engine runs the largest row count of any; one
   with fewer rows appends a padding request, one with none runs the padding request alone.
2. Verify: each engine drafts and plans its requests and reports a `VerifyReport` (requests, planned
   rows, the tier those rows need, whether it could plan). The step's tier is the maximum of the needed
   tiers (`global_verify`); graph-tier alignment fills each engine's rows up to that global tier; an
   engine without requests runs an idle layout of that tier (padding requests only). If an engine could
   not plan, every engine lays out the uniform step instead: every request of every DP rank verifies
   the same rows (`VerifyPlan.uniform_rows`), whatever its confidence.
3. Logits: every engine projects the same number of rows (its real rows, padded).
4. Where the planner may switch speculation off, whether a decode step speculates (`agree_prediction`):
   every engine's forward must be a verify step or every one an extend.

With `DSPARK_TP_CHECK=1` (the check mode) the engines also compare the tier they are about to run, and
fail the step on every rank, naming them, when it differs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from dspark.runtime.distributed.lockstep import check_agreement, checking
from dspark.runtime.distributed.tensor_parallel import COMM_CLOCK, TPGroup
from dspark.runtime.engine.step_sync import GlobalVerify, VerifyReport, global_verify
from dspark.runtime.planner.switch import Prediction, combine


class DPStepSync:
    """The agreements of a step among the DP ranks' engines (`engines`: one rank per DP rank, in order)."""

    spans_ranks = True

    def __init__(self, engines: TPGroup, device: torch.device) -> None:
        self.engines = engines
        self.device = device  # NCCL and HCCL gather the device's tensors, gloo the host's

    def gather(self, *values: int) -> list[tuple[int, ...]]:
        """Every engine's `values`, in DP rank order."""
        mine = torch.tensor(values, dtype=torch.long, device=self.device)
        parts = [torch.empty_like(mine) for _ in range(self.engines.size)]
        with COMM_CLOCK.timed("agreement"):
            dist.all_gather(parts, mine, group=self.engines.group)
        return [tuple(int(v) for v in p.tolist()) for p in parts]

    def agree_extend(self, rows: int, logit_rows: int, probe_rows: int) -> tuple[int, int, int]:
        """The rows, logit rows and prompt-probe rows every engine runs in an extend step: the most of any."""
        gathered = self.gather(rows, logit_rows, probe_rows)
        return max(g[0] for g in gathered), max(g[1] for g in gathered), max(g[2] for g in gathered)

    def agree_verify(self, report: VerifyReport, tiers: tuple[int, ...], uniform_rows: Callable[[int], int],
                     fills_tier: bool) -> GlobalVerify:
        gathered = self.gather(report.num_requests, report.rows, report.tier, int(report.planned))
        reports = [VerifyReport(n, rows, tier, bool(planned)) for n, rows, tier, planned in gathered]
        return global_verify(reports, tiers, uniform_rows, fills_tier)

    def unplanned(self, num_requests: int, error: ValueError) -> VerifyReport:
        # the planner's refusals, and a step past the largest tier: every DP rank runs the uniform step
        return VerifyReport(num_requests, 0, 0, False)

    def agree_prediction(self, prediction: Prediction) -> Prediction:
        """The step's prediction from every engine's (`switch.combine`): whether it speculates is one
        decision for every DP rank."""
        mine = torch.tensor((prediction.num_reqs, prediction.tau, prediction.on_seconds,
                             prediction.off_seconds), dtype=torch.float64, device=self.device)
        parts = [torch.empty_like(mine) for _ in range(self.engines.size)]
        with COMM_CLOCK.timed("agreement"):
            dist.all_gather(parts, mine, group=self.engines.group)
        return combine([Prediction(int(n), tau, on, off) for n, tau, on, off in (p.tolist() for p in parts)])

    def check(self, what: str, *values: int) -> None:
        """In the check mode, fail every engine loudly unless all are about to run the same `values`."""
        if checking():
            check_agreement(self.engines, what, torch.tensor(values, dtype=torch.long), ranks="DP ranks")
