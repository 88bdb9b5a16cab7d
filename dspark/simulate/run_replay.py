"""A recorded run replayed to completion under a policy: its own requests, lengths and admissions.

`sweep` answers "what does a policy do at concurrency c"; comparing a prediction with a measured run
needs the run's own load instead: requests joining as prefill admits them and the batch draining as
they finish, which a policy changes (fewer tokens per step means more, longer steps). Each recorded
request joins at the decode step it first appeared in (valid when every request got a slot at once:
admission then follows the prefill pace, not the policy) and stops once it has committed what it
committed in the recording. At each step a request reads the recorded request-step at its position
(the last one starting at or before the tokens it has committed): greedy output is the same under
every policy, so that step's drafts matched the text the request is at. Replaying the recording's
own policy reproduces its steps exactly; the cost table then says what they cost.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from dspark.simulate.policies import Policy, commit_lens
from dspark.simulate.pricing import StepPricer
from dspark.simulate.sweep import trace_batch
from dspark.simulate.trace import Trace


@dataclass(frozen=True)
class RunReplay:
    """One policy's replay of a recorded run."""

    policy: str
    verify_len: int | None
    steps: int
    request_steps: int
    tokens: int  # committed by every request, the last step's surplus over its length excluded
    rows: int  # rows run, tier padding included
    seconds: float  # predicted decode seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class _Request:
    rows: np.ndarray  # trace rows of the request, in recorded order
    offsets: np.ndarray  # tokens committed before each of them
    start: int  # the decode step it joins at
    length: int  # tokens it commits in all


def _requests(trace: Trace) -> list[_Request]:
    first = int(trace.step.min())
    out = []
    for rid in np.unique(trace.request):
        rows = np.flatnonzero(trace.request == rid)
        last = rows[-1]
        out.append(_Request(rows, trace.offset[rows], int(trace.step[rows[0]]) - first,
                            int(trace.offset[last] + trace.commit_len[last])))
    return out


def replay_run(trace: Trace, policy: Policy, pricer: StepPricer, lag_steps: int = 0,
               max_steps: int = 1_000_000) -> RunReplay:
    """Replay every request of the trace's run under `policy` until each has committed its length."""
    requests = _requests(trace)
    lag_steps = trace.budget_lag(lag_steps)
    position = np.zeros(len(requests), dtype=np.int64)
    done = np.zeros(len(requests), dtype=bool)
    recent: deque[dict[int, int]] = deque(maxlen=max(lag_steps, 1))  # request -> trace row, per step
    steps = request_steps = tokens = rows_run = 0
    seconds = 0.0
    policy.reset()
    step = 0
    while not done.all():
        if step >= max_steps:
            raise RuntimeError(f"the replay of {trace.source} did not finish within {max_steps} steps")
        running = [i for i, r in enumerate(requests) if r.start <= step and not done[i]]
        step += 1
        if not running:
            continue  # every admitted request finished before the next was admitted: no decode step
        rows = np.array([requests[i].rows[np.searchsorted(requests[i].offsets, position[i], "right") - 1]
                         for i in running])
        source = None
        if lag_steps:
            past = recent[0] if len(recent) == lag_steps else {}
            source = np.array([past.get(i, -1) for i in running])
            recent.append(dict(zip(running, rows.tolist(), strict=True)))
        batch = trace_batch(trace, rows, source)
        lens = policy.lens(batch)
        commit = commit_lens(batch.raw_correct_len, lens.verify_lens)
        for i, c in zip(running, commit.tolist(), strict=True):
            gained = min(c, requests[i].length - int(position[i]))
            tokens += gained
            position[i] += gained
            done[i] = position[i] >= requests[i].length
        steps += 1
        request_steps += len(running)
        rows_run += pricer.padded_rows(lens.run_rows) if lens.drafted else lens.run_rows
        seconds += pricer.step_seconds(len(running), lens.run_rows, lens.drafted)
    return RunReplay(policy.name, policy.verify_len, steps, request_steps, tokens, rows_run, seconds)
