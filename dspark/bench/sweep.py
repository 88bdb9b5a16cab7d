"""`dspark bench --sweep`: serving throughput and latency of each decoding policy at each load.

For every policy the sweep starts its own `dspark serve` process on a free loopback port, waits until it
answers `GET /health`, warms it up with one short burst, then loads it at each closed-loop concurrency
(`concurrency` requests always in flight: the client's semaphore starts the next request as one ends) and
at each Poisson request rate, and stops it (SIGINT, then terminate, then kill) before the next policy
starts. Every point sends the same prompts, greedy, with `ignore_eos`, so every request generates the same
number of tokens and throughputs are comparable across policies.

Policies, each its own server:

- `target-only`: `dspark serve --target-only`, no speculation: the lossless reference.
- `static`: the static package, as compiled (every request verifies all N = gamma + 1 rows).
- `fixed-K`: the compact (or cap-accept) package with `--fixed-verify-len K`: K rows per request per step.
- `adaptive`: the compact (or cap-accept) package as compiled: the planner picks the rows.
- `adaptive-twin` (`--twin`): a second, identical adaptive server, never a baseline. Two servers of one
  policy measure apart by the machine's noise alone, so the twin's ratio to the best baseline, printed
  beside adaptive's, says how far a ratio in this run can be trusted.

Adaptive's ratio to the best baseline at a load is paired by round: the median over rounds of adaptive's
tok/s over the baseline's in the same round, so that a machine whose speed drifts between rounds (a 2-core
cloud VM's single-thread matmul rate moved 25-60 % from one second to the next) moves both sides alike;
with 4 or more rounds it comes with a 90 % bootstrap interval over the rounds.

Speculation is lossless, so under greedy decoding every policy's text for a prompt equals target-only's;
the sweep records each request's text and says whether they do (`lossless`). The servers are
`dspark.bench.servers`; the table, `sweep.json` and `sweep.png` are written by `dspark.bench.sweep_output`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import platform
import random
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dspark.bench.client import BenchConfig, BenchResult, BenchSetupError, RequestOutcome, benchmark_outcomes
from dspark.bench.servers import ServerProcess, ServerRun, SweepError, SweepPackage, termination_as_interrupt

__all__ = [
    "DEFAULT_CONCURRENCY", "POLICIES", "Load", "LosslessCheck", "RequestRecord", "ServerProcess", "ServerRun",
    "SweepConfig", "SweepError", "SweepPackage", "SweepPoint", "SweepResult", "SweepUsageError",
    "TWIN", "machine_info", "plan_runs", "run_sweep",
]

POLICIES = ("target-only", "static", "fixed", "adaptive")
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
WARMUP_REQUESTS = 4
WARMUP_MAX_TOKENS = 16
MIN_REQUESTS_PER_SLOT = 2  # a closed-loop level sends at least this many requests per concurrent slot
TWIN = "adaptive-twin"
INTERVAL_MIN_ROUNDS = 4  # fewer rounds than this: no bootstrap interval (3 rounds give 10 distinct resamples)
BOOTSTRAP_RESAMPLES = 2000
INTERVAL_LEVEL = 0.90


class SweepUsageError(ValueError):
    """Arguments the sweep cannot run with (exit status 2); the message names the flag."""


# -- what runs --------------------------------------------------------------------------------------
def plan_runs(packages: Sequence[SweepPackage], policies: Sequence[str] | None = None,
              fixed_k: Sequence[int] | None = None, twin: bool = False) -> tuple[list[ServerRun], list[str]]:
    """(the servers to run, in table order, and notes on the policies skipped). `policies` None: every
    policy the packages allow (a missing one is a note); named policies must all be possible. `twin`: a
    second adaptive server after the first (needs adaptive)."""
    explicit = policies is not None
    wanted = set(POLICIES if policies is None else policies)
    unknown = sorted(wanted - set(POLICIES))
    if unknown:
        raise SweepUsageError(f"--policies: unknown policy {unknown[0]!r}; choose from {', '.join(POLICIES)} "
                              "(comma-separated)")
    statics = [p for p in packages if p.is_static]
    planned = [p for p in packages if not p.is_static]
    if len(statics) > 1 or len(planned) > 1:
        names = ", ".join(f"{p.name} ({p.verify_mode})" for p in packages)
        raise SweepUsageError(f"--sweep takes at most one static package and one compact or cap-accept "
                              f"package (the pair to compare), got {names}")
    static = statics[0] if statics else None
    adaptive = planned[0] if planned else None
    if fixed_k is not None and "fixed" not in wanted:
        raise SweepUsageError("--fixed-k picks the k of the fixed policy; add fixed to --policies")
    runs: list[ServerRun] = []
    notes: list[str] = []

    def missing(policy: str, kind: str) -> None:
        if explicit:
            raise SweepUsageError(f"--policies {policy} needs a {kind} package; add one to --sweep or drop "
                                  f"{policy} from --policies")
        notes.append(f"{policy}: skipped, no {kind} package given to --sweep")

    for policy in POLICIES:  # table order: the reference first, the policy under test last
        if policy not in wanted:
            continue
        if policy == "target-only":
            # Target-only decoding runs the target alone: the compact build's and the static build's are
            # the same model, so either serves it.
            base = adaptive or static
            assert base is not None  # the caller passes at least one package
            runs.append(ServerRun(policy, base, ("--target-only",)))
        elif policy == "static":
            if static is None:
                missing(policy, "static")
            else:
                runs.append(ServerRun(policy, static))
        elif adaptive is None:
            missing(policy, "compact or cap-accept")
        elif policy == "fixed":
            n = adaptive.num_draft_tokens
            ks = sorted(set(fixed_k)) if fixed_k is not None else list(range(1, n + 1))
            bad = [k for k in ks if not 1 <= k <= n]
            if bad:
                raise SweepUsageError(f"--fixed-k: k = {bad[0]} is outside 1..{n} (N = gamma + 1 of "
                                      f"{adaptive.name})")
            runs += [ServerRun(f"fixed-{k}", adaptive, ("--fixed-verify-len", str(k))) for k in ks]
        else:
            runs.append(ServerRun(policy, adaptive))
    if twin:
        if not any(run.policy == "adaptive" for run in runs):
            raise SweepUsageError("--twin runs a second adaptive server: it needs the adaptive policy (a "
                                  "compact or cap-accept package, and adaptive in --policies)")
        runs.append(ServerRun(TWIN, next(run.package for run in runs if run.policy == "adaptive")))
    return runs, notes


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
        medians = {policy: point.output_throughput for policy in self.policies
                   if (policy == "target-only" or policy.startswith("fixed-"))
                   and (point := self.point(policy, load)) is not None}
        return max(medians, key=medians.__getitem__) if medians else None

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
        ratios = self._paired(policy, load)
        if len(ratios) < INTERVAL_MIN_ROUNDS:
            return None
        rng = random.Random(0)
        medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                         for _ in range(BOOTSTRAP_RESAMPLES))
        tail = (1 - INTERVAL_LEVEL) / 2
        return medians[int(tail * BOOTSTRAP_RESAMPLES)], medians[int((1 - tail) * BOOTSTRAP_RESAMPLES) - 1]

    def lossless(self) -> list[LosslessCheck]:
        """Each policy's texts against target-only's (its first text per prompt); empty without
        target-only. Target-only is checked against itself too: batching must not change it either."""
        reference: dict[int, str] = {}
        for point in self.points:
            if point.policy == "target-only":
                for r in point.requests:
                    if r.error is None:
                        reference.setdefault(r.prompt_index, r.text)
        if not reference:
            return []
        checks = []
        for policy in self.policies:
            compared = mismatched = 0
            first = None
            for point in (p for p in self.points if p.policy == policy):
                for r in point.requests:
                    if r.error is not None or r.prompt_index not in reference:
                        continue
                    compared += 1
                    if r.text != reference[r.prompt_index]:
                        mismatched += 1
                        want = reference[r.prompt_index]
                        first = first or (f"{point.load.label}, prompt {r.prompt_index}: {r.text[:40]!r} "
                                          f"vs target-only {want[:40]!r}")
            checks.append(LosslessCheck(policy, compared, mismatched, first))
        return checks

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


# -- the sweep --------------------------------------------------------------------------------------
def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _bench(url: str, prompts: Sequence[str], config: SweepConfig, load: Load | None, num: int,
           max_tokens: int) -> tuple[BenchResult, list[RequestOutcome]]:
    bench = BenchConfig(
        url=url, num_prompts=num,
        concurrency=int(load.value) if load is not None and load.kind == "concurrency" else None,
        request_rate=load.value if load is not None and load.kind == "rate" else math.inf,
        max_tokens=max_tokens, temperature=0.0, seed=config.seed, ignore_eos=True, progress=False)
    return benchmark_outcomes(bench, prompts)


def _all_failed(what: str, result: BenchResult) -> SweepError:
    first = result.errors[0] if result.errors else "no error reported"
    return SweepError(f"{what}: all {result.failed} requests failed: {first}")


def _warm(server: ServerProcess, config: SweepConfig, prompts: Sequence[str]) -> None:
    """A warm-up burst (not kept): the first requests pay for lazy initialisation (allocator, kernels,
    thread pools)."""
    run = server.run
    try:
        result, _ = _bench(server.url, prompts, config, None, WARMUP_REQUESTS,
                           min(config.max_tokens, WARMUP_MAX_TOKENS))
    except BenchSetupError as err:
        raise SweepError(f"{run.policy}: {err}") from None
    server.check_alive()
    if not result.completed:
        raise _all_failed(f"{run.policy}, warming up", result)


def _point(server: ServerProcess, config: SweepConfig, prompts: Sequence[str], load: Load,
           round_index: int) -> SweepPoint:
    run = server.run
    try:
        result, outcomes = _bench(server.url, prompts, config, load, config.requests_at(load),
                                  config.max_tokens)
    except BenchSetupError as err:
        raise SweepError(f"{run.policy} at {load.label}: {err}") from None
    server.check_alive()  # a server that died mid-point failed its requests: say why it died instead
    if not result.completed:
        raise _all_failed(f"{run.policy} at {load.label}", result)
    return SweepPoint(run.policy, run.package.name, load, result,
                      tuple(RequestRecord.of(o, len(prompts)) for o in outcomes), round_index)


def _measure(server: ServerProcess, config: SweepConfig, prompts: Sequence[str]) -> Iterator[SweepPoint]:
    """The points of one server: a warm-up burst, then every load in turn."""
    _warm(server, config, prompts)
    for load in config.loads:
        yield _point(server, config, prompts, load, 0)


def _progress_line(point: SweepPoint, done: int, total: int) -> str:
    r = point.result
    tpot = r.tpot.p50_ms if r.tpot else math.nan
    failed = f"  {r.failed} failed" if r.failed else ""
    return (f"[{done}/{total}] {point.policy:<12} {point.load.label:<10} {r.output_throughput:8.1f} tok/s  "
            f"TPOT p50 {tpot:7.2f} ms  {r.duration_s:6.1f} s{failed}")


def run_sweep(config: SweepConfig, prompts: Sequence[str], log: Callable[[str], None] | None = None,
              python: str = sys.executable) -> SweepResult:
    """Every (policy, load) point, one server per policy. Raises `SweepError` when a server does not come
    up or dies, or when every request of a point fails."""
    say = log or (lambda _: None)
    prompts = tuple(prompts)
    if not prompts:
        raise SweepUsageError("no prompts to send")
    started = _now()
    points: list[SweepPoint] = []
    with termination_as_interrupt():
        if config.rounds == 1:
            total = len(config.runs) * len(config.loads)
            for run in config.runs:
                with _started(run, config, python, say) as server:
                    for point in _measure(server, config, prompts):
                        points.append(point)
                        say(_progress_line(point, len(points), total))
        else:
            _interleaved(config, prompts, python, say, points)
    return SweepResult(config, prompts, tuple(points), started, _now(), machine_info())


def _started(run: ServerRun, config: SweepConfig, python: str, say: Callable[[str], None]) -> ServerProcess:
    """The policy's server, not started yet (`with` starts it), its command said first."""
    server = ServerProcess(run, config.server_timeout_s, python)
    say(f"{run.policy}: starting {server.describe()}")
    return server


def _interleaved(config: SweepConfig, prompts: Sequence[str], python: str, say: Callable[[str], None],
                 points: list[SweepPoint]) -> None:
    """`config.rounds` rounds with every server up: at each load every policy runs once a round, the
    order rotated by one per load and per round, so that no policy always runs first and a machine that
    drifts during the sweep moves every policy's rounds alike; odd rounds run the cycle backwards, so a
    policy does not always follow the same one (a rotation alone keeps every predecessor)."""
    total = config.rounds * len(config.runs) * len(config.loads)
    with contextlib.ExitStack() as stack:
        servers = []
        for run in config.runs:
            servers.append(stack.enter_context(_started(run, config, python, say)))
        for round_index in range(config.rounds):
            for load_index, load in enumerate(config.loads):
                cycle = servers if round_index % 2 == 0 else servers[::-1]
                shift = (round_index + load_index) % len(cycle)
                for server in cycle[shift:] + cycle[:shift]:
                    # On 2 cores a decode run right after another runtime's measured 10-15 % slower than
                    # one right after its own (benchmarks/bench_modes.py), so every timed point follows
                    # a short burst of its own server.
                    _warm(server, config, prompts)
                    point = _point(server, config, prompts, load, round_index)
                    points.append(point)
                    say(f"round {round_index + 1}/{config.rounds} "
                        + _progress_line(point, len(points), total))
