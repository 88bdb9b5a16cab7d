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
`dspark.bench.servers`, the configuration and results `dspark.bench.sweep_data`; the table, `sweep.json`
and `sweep.png` are written by `dspark.bench.sweep_output`.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator, Sequence

from dspark.bench.client import BenchConfig, BenchResult, BenchSetupError, RequestOutcome, benchmark_outcomes
from dspark.bench.servers import ServerProcess, ServerRun, SweepError, SweepPackage, termination_as_interrupt
from dspark.bench.sweep_data import (
    DEFAULT_CONCURRENCY,
    TWIN,
    Load,
    LosslessCheck,
    RequestRecord,
    SweepConfig,
    SweepPoint,
    SweepResult,
    SweepUsageError,
    machine_info,
    now_utc,
)

__all__ = [
    "DEFAULT_CONCURRENCY", "POLICIES", "Load", "LosslessCheck", "RequestRecord", "ServerProcess", "ServerRun",
    "SweepConfig", "SweepError", "SweepPackage", "SweepPoint", "SweepResult", "SweepUsageError",
    "TWIN", "machine_info", "plan_runs", "run_sweep",
]

POLICIES = ("target-only", "static", "fixed", "adaptive")
WARMUP_REQUESTS = 4
WARMUP_MAX_TOKENS = 16


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



# -- the sweep --------------------------------------------------------------------------------------
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
    started = now_utc()
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
    return SweepResult(config, prompts, tuple(points), started, now_utc(), machine_info())


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
