"""`dspark bench --sweep PACKAGE ... --interleave`: every policy's engine in one process, taking turns.

A 2-core cloud VM's speed moves by tens of percent within seconds (one core's matmul rate 1.6x apart,
`benchmarks/machine_noise.py`), so servers measured one after another, even in rotated rounds, differ by
that much: two identical adaptive servers measured 0.79-1.42x of each other over 12-s points. Here every
policy's `Runtime` lives in one process and keeps its own closed loop of `c` requests in flight; the
engines take turns of `slice_s` seconds, in a freshly shuffled order every cycle, so drift on the scale of
seconds falls on every policy alike. A pass sends every engine the same requests (the load's first
prompts, in order, greedy, `ignore_eos`), so each engine does the same work; its tokens/s is the pass's
output tokens over the seconds of its own turns (prefill included). Passes repeat (`--rounds`), and
adaptive's ratio to the best baseline is paired by pass, with a bootstrap interval over passes.

What this measures is the engine under the sweep's closed-loop loads without HTTP: the server's HTTP,
tokenizer and streaming work is the same for every policy, and latencies (TTFT, TPOT) are not measured,
since a request waits while other engines take their turns. Policies, lossless check and the ratio are
as in `dspark.bench.sweep`.
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.atomic import atomic_write_text
from dspark.bench.servers import ServerRun
from dspark.bench.sweep_data import (
    DEFAULT_SLICE_S,
    TWIN,
    Load,
    LosslessCheck,
    SweepConfig,
    best_baseline,
    lossless_checks,
    machine_info,
    median_interval,
    now_utc,
)
from dspark.runtime.engine.requests import Request
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import GeneratedPackage, load_package

WARMUP_REQUESTS = 4
WARMUP_MAX_TOKENS = 16


# -- the engines ------------------------------------------------------------------------------------
def engine_for(run: ServerRun, packages: dict[Path, GeneratedPackage]) -> Runtime:
    """The runtime `dspark serve` would run for `run`'s policy (packages loaded once, by path)."""
    path = run.package.path
    if path not in packages:
        packages[path] = load_package(path)
    package = packages[path]
    if run.policy.startswith("fixed-"):
        return Runtime(package, fixed_verify_len=int(run.policy.removeprefix("fixed-")))
    return Runtime(package)  # target-only: the same runtime, `target_only` set for the measured passes


class ClosedLoop:
    """One engine's pass at one load: requests for prompts 0 .. num-1 in order, `concurrency` in flight
    (the next is queued as one finishes), run in turns."""

    def __init__(self, runtime: Runtime, prompts: Sequence[list[int]], num: int, concurrency: int,
                 max_tokens: int) -> None:
        self.runtime = runtime
        self.prompts = prompts
        self.num = num
        self.max_tokens = max_tokens
        self.live: dict[Request, int] = {}  # request -> prompt index
        self.outputs: dict[int, list[int]] = {}
        self.sent = 0
        self.finished_tokens = 0
        self.seconds = 0.0
        self.turns = 0
        stats = runtime.stats
        self._steps_before = (stats.request_steps, stats.committed_tokens)
        for _ in range(min(concurrency, num)):
            self._send()

    def _send(self) -> None:
        r = self.runtime.new_request(self.prompts[self.sent % len(self.prompts)], self.max_tokens,
                                     ignore_eos=True)
        self.live[r] = self.sent
        self.sent += 1
        self.runtime.enqueue(r)

    @property
    def done(self) -> bool:
        return not self.live

    @property
    def tokens(self) -> int:
        return self.finished_tokens + sum(len(r.output) for r in self.live)

    def turn(self, seconds: float) -> None:
        """Steps until `seconds` have passed (the step under way finishes) or every request is done."""
        start = time.perf_counter()
        while self.live and time.perf_counter() - start < seconds:
            for r in self.runtime.step():
                if r.done and r in self.live:
                    self.outputs[self.live.pop(r)] = list(r.output)
                    self.finished_tokens += len(r.output)
                    if self.sent < self.num:
                        self._send()
        self.seconds += time.perf_counter() - start
        self.turns += 1

    def tokens_per_step(self) -> float | None:
        """Committed tokens per request and decode step over the pass (1 for target-only)."""
        stats = self.runtime.stats
        steps = stats.request_steps - self._steps_before[0]
        return (stats.committed_tokens - self._steps_before[1]) / steps if steps else None


# -- results ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PassResult:
    """One policy's engine over one pass at one load."""

    policy: str
    load: Load
    pass_index: int
    tokens: int
    seconds: float
    turns: int
    tokens_per_step: float | None

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "load": self.load.to_json(),
                "tokens_per_second": round(self.throughput, 2)}


@dataclass(frozen=True)
class InterleaveResult:
    config: SweepConfig
    slice_s: float
    passes: tuple[PassResult, ...]
    lossless: tuple[LosslessCheck, ...]
    started: str
    finished: str
    machine: dict[str, Any]

    @property
    def policies(self) -> list[str]:
        return list(dict.fromkeys(p.policy for p in self.passes))

    @property
    def loads(self) -> list[Load]:
        return list(dict.fromkeys(p.load for p in self.passes))

    def _of(self, policy: str, load: Load) -> list[PassResult]:
        return [p for p in self.passes if p.policy == policy and p.load == load]

    def throughput(self, policy: str, load: Load) -> float | None:
        """Tokens/s over every pass: all its tokens over all its seconds."""
        runs = self._of(policy, load)
        seconds = sum(p.seconds for p in runs)
        return sum(p.tokens for p in runs) / seconds if seconds > 0 else None

    def tokens_per_step(self, policy: str, load: Load) -> float | None:
        values = [p.tokens_per_step for p in self._of(policy, load) if p.tokens_per_step is not None]
        return statistics.mean(values) if values else None

    def best_base(self, load: Load) -> str | None:
        """The baseline (target-only or a fixed k) with the highest tokens/s over every pass at `load`."""
        return best_baseline({policy: self.throughput(policy, load) for policy in self.policies})

    def paired(self, load: Load, policy: str = "adaptive") -> list[float]:
        """`policy`'s tokens/s over the best baseline's, one per pass (the same requests, the same
        minutes of the machine)."""
        base = self.best_base(load)
        if base is None:
            return []
        by_pass = {p.pass_index: p.throughput for p in self._of(base, load)}
        return [p.throughput / by_pass[p.pass_index] for p in self._of(policy, load)
                if by_pass.get(p.pass_index, 0) > 0]

    def ratio(self, load: Load, policy: str = "adaptive") -> float | None:
        ratios = self.paired(load, policy)
        return statistics.median(ratios) if ratios else None

    def to_json(self) -> dict[str, Any]:
        c = self.config
        twin = TWIN in self.policies
        return {
            "command": c.command, "started": self.started, "finished": self.finished, "machine": self.machine,
            "settings": {"concurrency": list(c.concurrency), "num_prompts": c.num_prompts,
                         "max_tokens": c.max_tokens, "passes": c.rounds, "slice_seconds": self.slice_s,
                         "temperature": 0.0, "ignore_eos": True,
                         "requests_per_load": {load.label: c.requests_at(load) for load in c.loads}},
            "policies": self.policies,
            "throughput": {load.label: {p: self.throughput(p, load) for p in self.policies}
                           for load in self.loads},
            "best_bases": {load.label: self.best_base(load) for load in self.loads},
            "ratios": {load.label: self.ratio(load) for load in self.loads},
            "ratio_intervals": {load.label: median_interval(self.paired(load)) for load in self.loads},
            **({"twin_ratios": {load.label: self.ratio(load, TWIN) for load in self.loads},
                "twin_ratio_intervals": {load.label: median_interval(self.paired(load, TWIN))
                                         for load in self.loads}} if twin else {}),
            "lossless": [check.to_json() for check in self.lossless],
            "passes": [p.to_json() for p in self.passes],
        }


# -- the run ----------------------------------------------------------------------------------------
def run_interleaved(config: SweepConfig, prompts: Sequence[str], slice_s: float = DEFAULT_SLICE_S,
                    log: Callable[[str], None] | None = None) -> InterleaveResult:
    """Every policy at every closed-loop load, `config.rounds` passes each, the engines in turns."""
    say = log or (lambda _: None)
    started = now_utc()
    packages: dict[Path, GeneratedPackage] = {}
    engines = {run.policy: engine_for(run, packages) for run in config.runs}
    tokenizer = next(iter(packages.values())).tokenizer
    ids = [tokenizer.encode(p) for p in prompts]
    for policy, runtime in engines.items():  # the first steps pay for lazy initialisation (allocator)
        runtime.generate(ids[:WARMUP_REQUESTS], WARMUP_MAX_TOKENS, target_only=policy == "target-only")
        runtime.target_only = policy == "target-only"
    results: list[PassResult] = []
    outputs: dict[str, dict[tuple[Load, int], list[int]]] = {policy: {} for policy in engines}
    rng = random.Random(config.seed)
    for load in config.loads:
        num = config.requests_at(load)
        for pass_index in range(config.rounds):
            loops = {policy: ClosedLoop(rt, ids, num, int(load.value), config.max_tokens)
                     for policy, rt in engines.items()}
            t0 = time.perf_counter()
            while not all(loop.done for loop in loops.values()):
                order = [policy for policy, loop in loops.items() if not loop.done]
                rng.shuffle(order)
                for policy in order:
                    loops[policy].turn(slice_s)
            for policy, loop in loops.items():
                results.append(PassResult(policy, load, pass_index, loop.tokens, loop.seconds, loop.turns,
                                          loop.tokens_per_step()))
                outputs[policy].update({(load, i): out for i, out in loop.outputs.items()})
            rates = ", ".join(f"{r.policy} {r.throughput:.0f}" for r in results[-len(loops):])
            say(f"{load.label} pass {pass_index + 1}/{config.rounds} ({time.perf_counter() - t0:.0f} s): "
                f"{rates} tok/s")
    # each prompt's output of the last pass at each load, against target-only's
    checked = {policy: [(load.label, index, tokens) for (load, index), tokens in by_prompt.items()]
               for policy, by_prompt in outputs.items()}
    return InterleaveResult(config, slice_s, tuple(results), tuple(lossless_checks(checked)), started,
                            now_utc(), machine_info())


# -- output -----------------------------------------------------------------------------------------
def _ratio_text(result: InterleaveResult, load: Load, policy: str) -> str:
    ratio = result.ratio(load, policy)
    if ratio is None:
        return "-"
    interval = median_interval(result.paired(load, policy))
    return f"{ratio:.3f}x" + ("" if interval is None else f" [{interval[0]:.3f}, {interval[1]:.3f}]")


def format_interleaved(result: InterleaveResult) -> str:
    c = result.config
    policies = result.policies
    ratio_of = ["adaptive", *([TWIN] if TWIN in policies else [])]
    packages = " + ".join(f"{p.name} ({p.verify_mode})" for p in c.packages)
    width = max(12, *(len(p) + 1 for p in policies))
    lines = [
        f"dspark bench --sweep --interleave: {packages}",
        f"  every policy's engine in one process, each its own closed loop of c requests, in turns of "
        f"{result.slice_s:g} s in a shuffled order; {c.rounds} passes of the same requests per load "
        f"({c.max_tokens} output tokens each, greedy, ignore_eos)",
        "  cell = output tokens/s over every pass (prefill included) / committed tokens per request-step",
        "",
        f"{'load':<8}" + "".join(f"{p:>{width}}" for p in policies)
        + "".join(f"  {p + ' / best base':>30}" for p in ratio_of),
    ]
    for load in result.loads:
        cells = []
        for policy in policies:
            rate, per_step = result.throughput(policy, load), result.tokens_per_step(policy, load)
            cell = "-" if rate is None else f"{rate:.1f}/" + ("-" if per_step is None else f"{per_step:.2f}")
            cells.append(f"{cell:>{width}}")
        ratios = [f"  {_ratio_text(result, load, p):>30}" for p in ratio_of]
        lines.append(f"{load.label:<8}" + "".join(cells) + "".join(ratios))
    lines += ["",
              "  best base = the faster of target-only and every fixed k over every pass; a ratio is the "
              "median over passes of the two measured in the same pass [90 % bootstrap interval over passes]"]
    if TWIN in policies:
        lines.append("  twin = a second adaptive engine, never a baseline: it differs from adaptive by the "
                     "machine's noise alone")
    for check in result.lossless:
        same = check.compared - check.mismatched
        where = "" if check.identical else f" (first: {check.first_mismatch})"
        lines.append(f"  lossless {check.policy}: {same}/{check.compared} outputs equal target-only's{where}")
    return "\n".join(lines)


def write_interleaved(result: InterleaveResult, out: Path, table: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "interleave.json", out / "interleave.txt"]
    atomic_write_text(paths[0], json.dumps(result.to_json(), indent=1) + "\n")
    atomic_write_text(paths[1], table + "\n")
    return paths
