"""Whether the next decode step speculates: the planner's off state (docs/planner.md, "Speculation off").

Drafted steps say what speculating earns: the tokens each request committed per drafted step (its own
mean, shrunk towards the batch's; not the confidence's `tau`: where the calibration is off for the
requests at hand, say one slow-accepting request left decoding alone, the two differ, and what was
committed is what speculating earned) at the rows the last plan ran, priced by the cost table (verify
plus draft). The table's decode term says what a target-only decode step of the same requests costs
(one token each). Speculation pays while `tokens / on_seconds` beats `B / off_seconds`.

The draft runs before its own step's plan, so the choice is for the steps after: the drafted steps'
figures of the coming step's requests predict both rates. To keep it from flapping the switch changes
state only after `patience` consecutive predictions favour the other state by `margin`. While off no
draft runs, so nothing refreshes the prediction but the batch; every `probe_every` steps one drafted
step (a probe) measures it again.

Under DP attention every DP rank's forward runs the same kind of step, so the decision is global: each DP
rank predicts for its own requests, the predictions are combined (tokens summed, seconds the slowest DP
rank's) and every DP rank runs the same state machine on the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dspark.runtime.planner.cost_models import CostModel


@dataclass(frozen=True)
class SwitchConfig:
    """The hysteresis of the off state (the spec's `verify.off_margin`, `off_patience`, `probe_every`)."""

    margin: float = 0.05  # the other state must be predicted this share faster
    patience: int = 3  # ... at this many consecutive steps
    probe_every: int = 16  # while off: one drafted step every this many steps

    def __post_init__(self) -> None:
        if not 0 <= self.margin < 1:
            raise ValueError(f"the off state's margin must be in [0, 1), got {self.margin}")
        if self.patience < 1 or self.probe_every < 1:
            raise ValueError(f"patience and probe_every must be >= 1, got {self.patience} and "
                             f"{self.probe_every}")


@dataclass(frozen=True)
class Prediction:
    """One step's two prices for a set of requests (one DP rank's, or all of them combined)."""

    num_reqs: int
    tau: float  # predicted committed tokens of a drafted step
    on_seconds: float  # its predicted seconds, draft included
    off_seconds: float  # predicted seconds of a target-only decode step

    @property
    def on_rate(self) -> float:
        return self.tau / self.on_seconds if self.on_seconds > 0 else 0.0

    @property
    def off_rate(self) -> float:
        return self.num_reqs / self.off_seconds if self.off_seconds > 0 else 0.0


NO_PREDICTION = Prediction(0, 0.0, 0.0, 0.0)


def combine(predictions: list[Prediction]) -> Prediction:
    """The DP ranks' predictions as one step's: every DP rank runs each step, so tokens add up and the
    step takes the slowest DP rank's time."""
    return Prediction(sum(p.num_reqs for p in predictions), sum(p.tau for p in predictions),
                      max((p.on_seconds for p in predictions), default=0.0),
                      max((p.off_seconds for p in predictions), default=0.0))


# Pseudo-steps of the batch-wide mean that a request's own mean of committed tokens is shrunk towards: a
# request with a few drafted steps is mostly the batch's, one with many mostly its own.
PRIOR_STEPS = 2.0

RequestKey = tuple[int, int]  # (slot, slot generation): one request's history, never a reused slot's


class SpeculationSwitch:
    """The off state of one engine: `speculates(prediction)` before each decode step, `observe(...)`
    after each drafted one. `prediction` is `predict(requests)` of this engine, or under DP attention
    every DP rank's, combined."""

    def __init__(self, table: CostModel, config: SwitchConfig, cap: int, max_rows: int | None,
                 decode_time: Callable[[int], float]) -> None:
        """`table` prices drafted steps, `decode_time(B)` a target-only decode step (the table's decode
        term when serving; a simulation may price it otherwise, `dspark.simulate.pricing`)."""
        self.table = table
        self.decode_time = decode_time
        self.config = config
        self.cap = cap  # most rows a request verifies
        self.max_rows = max_rows  # most rows a step may run (the largest tier, the table's range)
        self.speculating = True
        self._favour_other = 0  # consecutive predictions for the other state
        self._since_probe = 0
        # Per request of the last drafted step: (committed tokens, drafted steps) summed over its drafted
        # steps; the batch-wide committed tokens and request-steps; rows per request of the last one.
        self._requests: dict[RequestKey, tuple[float, int]] = {}
        self._tokens, self._request_steps = 0.0, 0
        self._rows: float | None = None
        self.probing = False  # the coming step is a probe (drafted while off)

    def use_table(self, table: CostModel) -> None:
        """Price both states by `table` from now on (an online cost refit's), keeping what was observed: the
        committed tokens are the traffic's, not the table's."""
        self.table = table
        self.decode_time = table.decode_time

    def observe(self, requests: Sequence[RequestKey], committed: Sequence[int], rows: int) -> None:
        """A drafted step: its requests, the tokens each committed, and the rows its plan ran."""
        if not requests:
            return
        before = self._requests
        self._requests = {}
        for key, tokens in zip(requests, committed, strict=True):
            total, steps = before.get(key, (0.0, 0))
            self._requests[key] = (total + tokens, steps + 1)
        self._tokens += sum(committed)
        self._request_steps += len(requests)
        self._rows = rows / len(requests)

    def _expected_tokens(self, key: RequestKey) -> float:
        """A request's committed tokens per drafted step: its own mean, shrunk towards the batch's."""
        prior = self._tokens / self._request_steps
        total, steps = self._requests.get(key, (0.0, 0))
        return (total + PRIOR_STEPS * prior) / (steps + PRIOR_STEPS)

    def decode_seconds(self, num_reqs: int, context_len: float | None = None) -> float:
        """A target-only decode step's price: `decode_time`, or at the batch's mean `context_len` where the
        table has a context term."""
        if context_len is None:
            return self.decode_time(num_reqs)
        return float(self.table.at_context(context_len).decode_time(num_reqs))

    def predict(self, requests: Sequence[RequestKey], offset_seconds: float = 0.0,
                context_len: float | None = None) -> Prediction:
        """Both prices for a step of `requests`, from their drafted steps (the batch's for one not drafted
        yet) at the last drafted step's rows per request and the batch's mean `context_len` (None: the
        table's own); `offset_seconds` (the engine's measured `StepOffset`) is added to both."""
        num_reqs = len(requests)
        if not num_reqs:
            return NO_PREDICTION
        off = self.decode_seconds(num_reqs, context_len) + offset_seconds
        if self._rows is None:  # nothing drafted yet: speculating is all there is to go by
            return Prediction(num_reqs, float("inf"), 1.0, off)
        rows = min(max(round(self._rows * num_reqs), num_reqs), num_reqs * self.cap)
        if self.max_rows is not None:
            rows = min(rows, self.max_rows)
        tokens = sum(self._expected_tokens(key) for key in requests)
        table = self.table if context_len is None else self.table.at_context(context_len)
        on = table.step_time(num_reqs, rows) + table.draft_time(num_reqs) + offset_seconds
        return Prediction(num_reqs, tokens, on, off)

    def speculates(self, prediction: Prediction) -> bool:
        """Whether the coming step drafts; moves the state machine one step."""
        cfg = self.config
        if prediction.num_reqs == 0:
            return self.speculating
        on, off = prediction.on_rate, prediction.off_rate
        other_wins = off > on * (1 + cfg.margin) if self.speculating else on > off * (1 + cfg.margin)
        self._favour_other = self._favour_other + 1 if other_wins else 0
        if self._favour_other >= cfg.patience:
            self.speculating = not self.speculating
            self._favour_other = 0
            self._since_probe = 0
        self.probing = False
        if self.speculating:
            return True
        self._since_probe += 1
        if self._since_probe >= cfg.probe_every:
            self._since_probe = 0
            self.probing = True
        return self.probing
