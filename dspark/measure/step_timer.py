"""The measuring half of `dspark profile`: time the generated runtime's own verify forward.

A step of `B` requests and `M` rows runs exactly as in serving — the generated metadata builder,
the generated verify runner (tier padding or graph replay included), the LM head and argmax — on
the deployment's backend, against KV caches holding `context_len` tokens per request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.sampling import sample, warp


class ProfileError(ValueError):
    """A profile request this package cannot measure (says what to change)."""


def spread_rows(num_rows: int, num_reqs: int, floor: int, cap: int) -> list[int]:
    """`num_rows` split over `num_reqs` requests as evenly as possible, each in `[floor, cap]`."""
    if not num_reqs * floor <= num_rows <= num_reqs * cap:
        raise ProfileError(f"{num_rows} rows cannot be split over {num_reqs} requests with "
                           f"{floor}..{cap} rows each")
    base, extra = divmod(num_rows, num_reqs)
    return [base + 1] * extra + [base] * (num_reqs - extra)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # registered by torch_npu on the Ascend path


class VerifyStepTimer:
    """`timer(B, M)`: wall seconds of one synchronised verify step with B requests and M rows."""

    def __init__(self, runtime: Runtime, context_len: int = 128, seed: int = 0) -> None:
        dep = runtime.deployment
        if not dep.verify_mode.packs_rows:
            raise ProfileError(
                f"{dep.name} is a {dep.verify_mode} build, whose steps always run B x N rows; the "
                "cost grid needs ragged steps. Profile a compact build of the same deployment "
                "(verify.mode: compact, verify.allow_no_cost_model: true) and use its tables here")
        self.runtime = runtime
        self.context_len = context_len
        self.floor = runtime.plan.schedule.floor
        self.cap = runtime.plan.schedule.cap
        self.max_reqs = dep.serving.max_running_requests
        reserve = context_len + runtime.plan.num_draft_tokens
        if reserve > dep.serving.max_context_len:
            raise ProfileError(f"context_len {context_len} + N exceeds serving.max_context_len "
                               f"{dep.serving.max_context_len}; profile with a shorter context")
        handles = []
        for _ in range(self.max_reqs):
            if not runtime.slots.num_free_slots or runtime.slots.num_free_pages * runtime.page_size < reserve:
                break
            handle = runtime.slots.admit()
            runtime.slots.reserve(handle.slot, reserve)
            handles.append(handle)
        self.max_reqs = len(handles)
        self.page_table = runtime.slots.page_table[[h.slot for h in handles]].to(runtime.device)
        self.generator = torch.Generator().manual_seed(seed)

    def batch_sizes(self, requested: Sequence[int] | None = None) -> tuple[int, ...]:
        """The requested batch sizes, or powers of two up to the most requests the pool holds."""
        if requested:
            too_big = [b for b in requested if b > self.max_reqs]
            if too_big:
                raise ProfileError(f"batch sizes {too_big} exceed the {self.max_reqs} requests this "
                                   "deployment's KV pool and max_running_requests allow")
            return tuple(sorted(set(requested)))
        sizes = {1 << i for i in range(self.max_reqs.bit_length()) if 1 << i <= self.max_reqs}
        return tuple(sorted(sizes | {self.max_reqs}))

    def draft_seconds(self, num_reqs: int) -> float:
        """Wall seconds of one synchronised draft step (context gather + propose) for B requests:
        the draft-cost term the planner adds to the verify step time."""
        rt = self.runtime
        roots = torch.randint(rt.target.cfg.vocab_size, (num_reqs,), generator=self.generator).to(rt.device)
        prefix = torch.full((num_reqs,), self.context_len, dtype=torch.long, device=rt.device)
        _synchronize(rt.device)
        start = time.perf_counter()
        context = rt.models.draft_context(self.page_table[:num_reqs], prefix)
        rt.draft.propose(roots, prefix, context, prefix, None if rt.sampling.greedy else self._pick_token)
        _synchronize(rt.device)
        return time.perf_counter() - start

    def _pick_token(self, logits: torch.Tensor) -> torch.Tensor:
        # A sampled deployment's draft step samples under the runtime's default policy, as serving does.
        return sample(warp(logits, self.runtime.sampling), self.runtime.models.generator)

    def __call__(self, num_reqs: int, num_rows: int) -> float:
        rt = self.runtime
        lens = tuple(spread_rows(num_rows, num_reqs, self.floor, self.cap))
        vocab = rt.target.cfg.vocab_size
        ids = torch.randint(vocab, (num_rows,), generator=self.generator).to(rt.device)
        _synchronize(rt.device)
        start = time.perf_counter()
        # Laying the step out is part of every verify step, so it is timed with the forward.
        layout = rt.verify_runner.plan(lens, lens, [self.context_len] * num_reqs, self.page_table[:num_reqs])
        hidden = rt.verify_runner.run(layout, ids)
        rt.target.compute_logits(hidden).argmax(-1)
        _synchronize(rt.device)
        return time.perf_counter() - start
