"""What a `dspark bench --sweep` is asked (`SweepConfig`, its `Load`s) and what it measured (`SweepPoint`s
and the `SweepResult`, with adaptive's paired ratio to the best baseline and its bootstrap interval).
`dspark.bench.sweep` runs the sweep; `dspark.bench.sweep_output` writes its table, JSON and plot."""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import random
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

from dspark.bench.client import BenchResult, RequestOutcome
from dspark.bench.servers import ServerRun, SweepPackage

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
MIN_REQUESTS_PER_SLOT = 2  # a closed-loop level sends at least this many requests per concurrent slot
TWIN = "adaptive-twin"
INTERVAL_MIN_ROUNDS = 4  # fewer rounds than this: no bootstrap interval (3 rounds give 10 distinct resamples)
BOOTSTRAP_RESAMPLES = 2000
INTERVAL_LEVEL = 0.90
DEFAULT_SLICE_S = 0.5  # an engine's turn in an interleaved sweep (`dspark.bench.interleave`)


class SweepUsageError(ValueError):
    """Arguments the sweep cannot run with (exit status 2); the message names the flag."""



def median_interval(ratios: list[float]) -> tuple[float, float] | None:
    """The INTERVAL_LEVEL bootstrap interval of the median of paired ratios (one per round, resampled with
    replacement, a fixed seed so a table is reproducible from its JSON); None under INTERVAL_MIN_ROUNDS."""
    if len(ratios) < INTERVAL_MIN_ROUNDS:
        return None
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                     for _ in range(BOOTSTRAP_RESAMPLES))
    tail = (1 - INTERVAL_LEVEL) / 2
    return medians[int(tail * BOOTSTRAP_RESAMPLES)], medians[int((1 - tail) * BOOTSTRAP_RESAMPLES) - 1]


def is_baseline(policy: str) -> bool:
    """What adaptive is measured against: target-only and every fixed k (never static or the twin)."""
    return policy == "target-only" or policy.startswith("fixed-")


def best_baseline(rates: dict[str, float | None]) -> str | None:
    """The baseline with the highest tokens/s among `rates` (policies without a rate left out)."""
    known = {policy: rate for policy, rate in rates.items() if is_baseline(policy) and rate is not None}
    return max(known, key=known.__getitem__) if known else None


Output = tuple[str, int, object]  # (where, prompt index, what the policy produced for that prompt)


def lossless_checks(outputs: dict[str, list[Output]]) -> list[LosslessCheck]:
    """Each policy's outputs against target-only's first output for the same prompt; empty without
    target-only. Target-only is checked against itself too: batching must not change it either."""
    reference: dict[int, object] = {}
    for _, index, output in outputs.get("target-only", []):
        reference.setdefault(index, output)
    if not reference:
        return []
    checks = []
    for policy, produced in outputs.items():
        compared = mismatched = 0
        first = None
        for where, index, output in produced:
            if index not in reference:
                continue
            compared += 1
            if output != reference[index]:
                mismatched += 1
                want = _short(reference[index])
                first = first or f"{where}, prompt {index}: {_short(output)} vs target-only {want}"
        checks.append(LosslessCheck(policy, compared, mismatched, first))
    return checks


def _short(output: object) -> str:
    return repr(output[:40]) if isinstance(output, str | list | tuple) else repr(output)


def now_utc() -> str:
    """ISO 8601, UTC, to the second: when a sweep started or finished."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# -- what is asked -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Load:
    """A load level: `concurrency` requests always in flight, or Poisson arrivals at `rate` per second."""

    kind: Literal["concurrency", "rate"]
    value: float

    @property
    def label(self) -> str:
        return f"c={int(self.value)}" if self.kind == "concurrency" else f"{self.value:g} req/s"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": int(self.value) if self.kind == "concurrency" else self.value,
                "label": self.label}


@dataclass(frozen=True)
class SweepConfig:
    packages: tuple[SweepPackage, ...]
    runs: tuple[ServerRun, ...]
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    request_rates: tuple[float, ...] = ()
    num_prompts: int = 64
    max_tokens: int = 128
    seed: int = 0
    server_timeout_s: float = 300.0
    notes: tuple[str, ...] = ()
    command: str = ""  # the command line, as recorded in sweep.json
    rounds: int = 1  # > 1: every server up at once, each load run by every policy once a round

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise SweepUsageError(f"--rounds must be >= 1, got {self.rounds}")
        if not self.runs:
            raise SweepUsageError("--policies: no policy left to run")
        if not self.concurrency and not self.request_rates:
            raise SweepUsageError("--concurrency-list: no load to run; give at least one concurrency or "
                                  "--request-rates")

    @property
    def loads(self) -> tuple[Load, ...]:
        return (*(Load("concurrency", c) for c in self.concurrency),
                *(Load("rate", r) for r in self.request_rates))

    def requests_at(self, load: Load) -> int:
        """Requests sent at a load: --num-prompts, and at least MIN_REQUESTS_PER_SLOT per concurrent slot,
        so that the last requests' tail (fewer in flight) is a small part of the run."""
        if load.kind == "concurrency":
            return max(self.num_prompts, MIN_REQUESTS_PER_SLOT * int(load.value))
        return self.num_prompts

    @property
    def pool_size(self) -> int:
        return max(self.requests_at(load) for load in self.loads)



# -- results ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestRecord:
    """One request of a point, with its output text (to compare policies: speculation is lossless)."""

    index: int
    prompt_index: int
    text: str
    completion_tokens: int
    decode_steps: int | None
    ttft_ms: float | None
    tpot_ms: float | None
    latency_ms: float
    finish_reason: str | None
    error: str | None

    @classmethod
    def of(cls, outcome: RequestOutcome, pool_size: int) -> RequestRecord:
        tpot = outcome.tpot
        return cls(index=outcome.index, prompt_index=outcome.index % pool_size, text=outcome.text,
                   completion_tokens=outcome.completion_tokens, decode_steps=outcome.decode_steps,
                   ttft_ms=None if outcome.ttft is None else outcome.ttft * 1e3,
                   tpot_ms=None if tpot is None else tpot * 1e3, latency_ms=outcome.latency * 1e3,
                   finish_reason=outcome.finish_reason, error=outcome.error)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SweepPoint:
    """One (policy, load): the client's summary and every request."""

    policy: str
    package: str
    load: Load
    result: BenchResult
    requests: tuple[RequestRecord, ...]
    round: int = 0

    @property
    def output_throughput(self) -> float:
        return self.result.output_throughput

    @property
    def tokens_per_step(self) -> float | None:
        return self.result.mean_accepted_tokens_per_step

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "package": self.package, "load": self.load.to_json(),
                "round": self.round, **self.result.to_json(),
                "requests": [r.to_json() for r in self.requests]}


@dataclass(frozen=True)
class LosslessCheck:
    """Whether a policy's greedy texts equal target-only's for the same prompts."""

    policy: str
    compared: int
    mismatched: int
    first_mismatch: str | None = None

    @property
    def identical(self) -> bool:
        return self.mismatched == 0

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "identical": self.identical}


@dataclass(frozen=True)
class SweepResult:
    config: SweepConfig
    prompts: tuple[str, ...]
    points: tuple[SweepPoint, ...]
    started: str  # ISO 8601, UTC
    finished: str
    machine: dict[str, Any] = field(default_factory=dict)

    @property
    def policies(self) -> list[str]:
        return list(dict.fromkeys(p.policy for p in self.points))

    @property
    def loads(self) -> list[Load]:
        return list(dict.fromkeys(p.load for p in self.points))

    def point(self, policy: str, load: Load) -> SweepPoint | None:
        """The policy's point at `load`; over several rounds the round with the median tokens/s (the lower
        middle of an even count), so that every figure in its row comes from one measured run."""
        runs = sorted((p for p in self.points if p.policy == policy and p.load == load),
                      key=lambda p: p.output_throughput)
        return runs[(len(runs) - 1) // 2] if runs else None

    def best_base(self, load: Load) -> str | None:
        """The baseline (target-only or a fixed k) with the highest median-round tok/s at `load`."""
        return best_baseline({policy: point.output_throughput for policy in self.policies
                              if (point := self.point(policy, load)) is not None})

    def _paired(self, policy: str, load: Load) -> list[float]:
        """`policy`'s tok/s over the best baseline's, one per round both ran (paired by round)."""
        base = self.best_base(load)
        if base is None:
            return []
        by_round = {p.round: p.output_throughput for p in self.points if p.policy == base and p.load == load}
        return [p.output_throughput / by_round[p.round] for p in self.points
                if p.policy == policy and p.load == load and by_round.get(p.round, 0) > 0]

    def ratio(self, load: Load, policy: str = "adaptive") -> float | None:
        """`policy`'s tok/s over the best baseline's at `load`, the median over rounds of the two measured
        in the same round; None when a side is missing."""
        ratios = self._paired(policy, load)
        return statistics.median(ratios) if ratios else None

    def ratio_interval(self, load: Load, policy: str = "adaptive") -> tuple[float, float] | None:
        """The 90 % bootstrap interval of `ratio` (rounds resampled with replacement, a fixed seed so the
        table is reproducible from sweep.json); None under INTERVAL_MIN_ROUNDS paired rounds."""
        return median_interval(self._paired(policy, load))

    def lossless(self) -> list[LosslessCheck]:
        """Each policy's texts against target-only's (`lossless_checks`), failed requests left out."""
        outputs: dict[str, list[Output]] = {policy: [] for policy in self.policies}
        for point in self.points:
            outputs[point.policy] += [(point.load.label, r.prompt_index, r.text) for r in point.requests
                                      if r.error is None]
        return lossless_checks(outputs)

    @property
    def failed_requests(self) -> int:
        return sum(p.result.failed for p in self.points)

    def to_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "command": c.command,
            "argv": list(sys.argv),
            "started": self.started,
            "finished": self.finished,
            "machine": self.machine,
            "packages": [{"path": str(p.path), "name": p.name, "verify_mode": p.verify_mode,
                          "num_draft_tokens": p.num_draft_tokens} for p in c.packages],
            "servers": [{"policy": r.policy, "package": r.package.name, "serve_flags": list(r.flags)}
                        for r in c.runs],
            "notes": list(c.notes),
            "settings": {"concurrency": list(c.concurrency), "request_rates": list(c.request_rates),
                         "num_prompts": c.num_prompts, "max_tokens": c.max_tokens, "seed": c.seed,
                         "rounds": c.rounds,
                         "temperature": 0.0, "ignore_eos": True,
                         "requests_per_load": {load.label: c.requests_at(load) for load in c.loads}},
            "prompts": list(self.prompts),
            "ratios": {load.label: self.ratio(load) for load in self.loads},
            "ratio_intervals": {load.label: self.ratio_interval(load) for load in self.loads},
            "best_bases": {load.label: self.best_base(load) for load in self.loads},
            **({"twin_ratios": {load.label: self.ratio(load, TWIN) for load in self.loads},
                "twin_ratio_intervals": {load.label: self.ratio_interval(load, TWIN) for load in self.loads}}
               if TWIN in self.policies else {}),
            "lossless": [check.to_json() for check in self.lossless()],
            "points": [p.to_json() for p in self.points],
        }


def machine_info() -> dict[str, Any]:
    """Where the sweep ran: enough to tell two machines' numbers apart."""
    info: dict[str, Any] = {"platform": platform.platform(), "machine": platform.machine(),
                            "processor": platform.processor(), "python": platform.python_version(),
                            "cpu_count": os.cpu_count()}
    if hasattr(os, "sched_getaffinity"):  # the CPUs this process may use, under a container's limits
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    return info

