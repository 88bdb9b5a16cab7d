"""The measuring half of `dspark profile`: time the generated runtime's own verify forward.

A step of `B` requests and `M` rows runs exactly as in serving — the generated metadata builder,
the generated verify runner (tier padding or graph replay included), the LM head and argmax — on
the deployment's backend, against KV caches holding `context_len` tokens per request. Every verify
mode can be timed; only a compact build has steps with fewer than `B·N` rows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.engine.step_forward import ExtendForward, LogitsForward, VerifyForward
from dspark.runtime.planner.verify_plan import AdaptiveVerifyPlan
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
    """`timer(B, M)`: wall seconds of one synchronised verify step with B requests and M rows.

    A compact build runs any M in `[B·floor, B·cap]`. A static or cap-accept build runs every request's
    N rows whatever the plan says, so its only step per batch size is `M = B·N` (`floor == cap == N`):
    profiling it gives the static sweep alone, which is what a compact build of the same deployment
    is compared against (benchmarks/compare_profiles.py).
    """

    def __init__(self, runtime: Runtime, context_len: int = 128, seed: int = 0) -> None:
        dep = runtime.deployment
        self.runtime = runtime
        self.context_len = context_len
        self.packs_rows = dep.verify_mode.packs_rows
        plan = runtime.plan
        n = plan.num_draft_tokens
        floor, cap = n, n  # a static plan has no schedule: every request verifies N rows
        if isinstance(plan, AdaptiveVerifyPlan):
            floor, cap = plan.schedule.floor, plan.schedule.cap
        # cap-accept plans verify_lens yet runs all N rows of every request: the mode says what runs.
        self.floor, self.cap = dep.verify_mode.rows_per_request(floor, cap, n)
        serving = dep.serving
        reserve = context_len + n
        if reserve > serving.max_context_len:
            raise ProfileError(f"context_len {context_len} + N exceeds serving.max_context_len "
                               f"{serving.max_context_len}; profile with a shorter context")
        self.reserve_tokens = reserve
        self.pages_per_request = -(-reserve // runtime.page_size)
        # Two limits on how many requests one step can hold, reported apart because the fixes differ.
        self.slot_limit = min(serving.max_running_requests, runtime.slots.num_free_slots)
        self.pool_limit = runtime.slots.num_free_pages // self.pages_per_request
        self.max_reqs = min(self.slot_limit, self.pool_limit)
        handles = []
        for _ in range(self.max_reqs):
            handle = runtime.slots.admit()
            runtime.slots.reserve(handle.slot, reserve)
            handles.append(handle)
        self.slots = [h.slot for h in handles]
        self.page_table = runtime.slots.page_table[self.slots].to(runtime.device)
        self.generator = torch.Generator().manual_seed(seed)

    def batch_sizes(self, requested: Sequence[int] | None = None) -> tuple[int, ...]:
        """The requested batch sizes, or powers of two up to the most requests the pool holds."""
        if requested:
            problems = []
            serving = self.runtime.deployment.serving
            over_slots = sorted(b for b in set(requested) if b > self.slot_limit)
            if over_slots:
                problems.append(f"batch sizes {over_slots} exceed serving.max_running_requests = "
                                f"{self.slot_limit} of {self.runtime.deployment.name}; compile a variant of "
                                f"its spec with serving.max_running_requests >= {over_slots[-1]}")
            over_pool = sorted(b for b in set(requested) if b > self.pool_limit)
            if over_pool:
                tokens = over_pool[-1] * self.pages_per_request * self.runtime.page_size
                problems.append(f"the KV pool (serving.max_total_tokens = {serving.max_total_tokens}) holds "
                                f"only {self.pool_limit} requests of context_len {self.context_len} + N = "
                                f"{self.reserve_tokens} tokens ({self.pages_per_request} pages of "
                                f"{self.runtime.page_size}), fewer than batch sizes {over_pool}; lower "
                                f"--context-len or raise serving.max_total_tokens to at least {tokens}")
            if problems:
                raise ProfileError("; ".join(problems))
            return tuple(sorted(set(requested)))
        if self.max_reqs < 1:
            raise ProfileError(f"the KV pool (serving.max_total_tokens = "
                               f"{self.runtime.deployment.serving.max_total_tokens}) cannot hold one request "
                               f"of context_len {self.context_len} + N tokens; lower --context-len")
        sizes = {1 << i for i in range(self.max_reqs.bit_length()) if 1 << i <= self.max_reqs}
        return tuple(sorted(sizes | {self.max_reqs}))

    def draft_seconds(self, num_reqs: int) -> float:
        """Wall seconds of one synchronised draft step (its attention's layout, then propose) for B requests:
        the draft-cost term the planner adds to the verify step time."""
        rt = self.runtime
        roots = torch.randint(rt.target.cfg.vocab_size, (num_reqs,), generator=self.generator).to(rt.device)
        _synchronize(rt.device)
        start = time.perf_counter()
        rt.models.propose(roots, (self.context_len,) * num_reqs, self.page_table[:num_reqs],
                          None if rt.sampling.greedy else self._pick_token, gamma=rt.plan.gamma)
        _synchronize(rt.device)
        return time.perf_counter() - start

    def decode_seconds(self, num_reqs: int) -> float:
        """Wall seconds of one synchronised target-only decode step for B requests, as a speculative run
        decodes with speculation off: one row per request, the draft's context appended, the next token
        picked. The decode term the planner prices a step without speculation by."""
        rt = self.runtime
        roots = torch.randint(rt.target.cfg.vocab_size, (num_reqs,), generator=self.generator).to(rt.device)
        host_pages = rt.slots.page_table[self.slots[:num_reqs]]
        step = ExtendForward((self.context_len,) * num_reqs, (1,) * num_reqs, host_pages,
                             tuple(self.slots[:num_reqs]), 0, roots, rt.models.capture)
        _synchronize(rt.device)
        start = time.perf_counter()
        _, states, layout = rt.forward.extend(step)
        assert states is not None
        rt.models.append_draft_context(states, layout.positions, layout.row_req, layout.page_table)
        logits = rt.forward.logits(LogitsForward(None))
        (logits.argmax(-1) if rt.sampling.greedy else self._pick_token(logits)).tolist()
        _synchronize(rt.device)
        return time.perf_counter() - start

    def _pick_token(self, logits: torch.Tensor) -> torch.Tensor:
        # A sampled deployment's draft step samples under the runtime's default policy, as serving does.
        return sample(warp(logits, self.runtime.sampling), self.runtime.models.generator)

    def __call__(self, num_reqs: int, num_rows: int) -> float:
        return self.time_lens(spread_rows(num_rows, num_reqs, self.floor, self.cap))

    def time_lens(self, verify_lens: Sequence[int]) -> float:
        """Wall seconds of one verify step whose requests verify `verify_lens` rows each (a ragged
        layout, as the planner makes them; `__call__` spreads the rows evenly)."""
        rt = self.runtime
        lens = tuple(verify_lens)
        num_reqs = len(lens)
        if not lens or not all(self.floor <= n <= self.cap for n in lens):
            raise ProfileError(f"verify_lens {list(lens)}: every request runs {self.floor}..{self.cap} rows")
        vocab = rt.target.cfg.vocab_size
        fixed = num_reqs * rt.plan.num_draft_tokens  # ids at the fixed stride, which the layout packs
        ids = torch.randint(vocab, (fixed,), generator=self.generator).to(rt.device)
        step = VerifyForward(lens, lens, (self.context_len,) * num_reqs, self.page_table[:num_reqs],
                             tuple(self.slots[:num_reqs]), None, ids)
        _synchronize(rt.device)
        start = time.perf_counter()
        # Laying the step out is part of every verify step, so it is timed with the forward (which returns
        # the draft's states, as serving runs it; under tensor parallelism the followers run it too).
        rt.forward.verify(step)
        rt.forward.logits(LogitsForward(None)).argmax(-1)
        _synchronize(rt.device)
        return time.perf_counter() - start
