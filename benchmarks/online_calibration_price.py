"""What online calibration costs the decode: its steps against steps without it, in one run of one runtime.

One runtime of the package with online calibration (its default settings), serving the same held-out prompts
round after round. Its decode steps take turns among three arms, one step each: "on" (online calibration
attached: every step observed, the checks and refits in their background thread, the live calibration planned
with) and two "off" arms (detached: nothing observed, the compiled calibration planned with); the steps that
prefill run attached (each prompt's surprise scored, as when serving: its price is the prefill's) and count in
no arm. Each arm's decode tokens/s is its tokens over its steps' decode seconds, pooled over the rounds; the
price is "on" over "off", and "off2" over "off" is an A/A control that shows what the same measurement makes
of no difference at all. Six rounds make a block: the turns start one arm later each round and run the other
way round every three, so that in a block every arm takes every step of a generation once, and follows each
other arm as often (what a step leaves in the caches weighs on the next). Where a check is still running as an
"on" step hands over to an "off" one, the step waits for it and the wait counts as the "on" step's (more than
it costs when it overlaps the next steps, never less). The checks' and refits' budgets (`CHECK_SHARE` and
`REFIT_SHARE` of the wall time) read a clock of the "on" steps' seconds: they bear the background work of a
server that runs it on every step. (A clock of a third of the wall time gave them two to three times that at
64 prompts, where the steps that run while prompts still prefill, attached and in no arm, took half the wall
time.)

Why steps, not runs: a machine shared with other work changes speed from one run to the next by more than
the price measured (two runtimes of one build, run after run in the same rounds, differed by 2.3 % on the
2-core CPU, the same one by 2 to 7 % from round to round); steps that alternate see the same machine, the
same batch and the same point of every generation. The interval is a bootstrap over blocks (2.5th to 97.5th
percentile of the pooled ratio). It also prints the online calibration's own time (on the step path, and its
background thread's CPU) against the "on" steps' decode seconds, each arm's verify rows and commit per
request-step, and whether every round's output equals target-only greedy decoding (it must: the arms share
requests mid-generation).

    cd benchmarks && ../.venv/bin/python online_calibration_price.py ../generated/tiny_cpu_compact \
        --prompts 64 --rounds 36
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from bench_static import held_out_prompts

from dspark.runtime.config import OnlineCalibrationSettings
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.engine.stats import RunStats
from dspark.runtime.package import load_package
from dspark.runtime.planner.online_calibration import OnlineCalibrator

ARMS = ("on", "off", "off2")
ORDERS = (ARMS, ("on", "off2", "off"))
BLOCK = 3 * len(ORDERS)  # rounds: every start, each way round
BOOTSTRAP = 4000


class OnlineToggle:
    """A runtime with online calibration, attached or detached between steps: detached, its step neither
    observes nor polls, its prefill scores no prompt, and it plans with the compiled calibration; attached
    again, it plans with the live calibration it had (and any check finished meanwhile)."""

    def __init__(self, runtime: Runtime) -> None:
        online = runtime.speculative.online
        assert online is not None
        self.runtime, self.online = runtime, online
        self.probe = runtime.extend.prompt_probe
        self.live_plan = runtime.speculative.plan
        self.attached = True
        # The checks' and refits' budgets are shares of the wall time: its clock is the "on" steps' seconds
        # (`serve_round` adds them), so that they bear the share of a server that runs it on every step.
        self.on_seconds = 0.0
        online.clock = lambda: self.on_seconds

    def attach(self, on: bool) -> None:
        step = self.runtime.speculative
        if on == self.attached:
            return
        if on:
            step.online, step.plan, self.runtime.extend.prompt_probe = self.online, self.live_plan, self.probe
        else:
            self.live_plan = step.plan  # with the swaps of its attached steps
            step.online, step.plan, self.runtime.extend.prompt_probe = None, self.runtime.plan, 0
        self.attached = on

    def count_on(self, arm: Arm, seconds: float) -> None:
        """`seconds` of the "on" arm's: its decode seconds, and its clock."""
        arm.seconds += seconds
        self.on_seconds += seconds


@dataclass
class Arm:
    """One arm's decode steps in one round."""

    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0
    request_steps: int = 0
    rows: int = 0
    committed: int = 0


@dataclass
class Round:
    arms: dict[str, Arm] = field(default_factory=lambda: {name: Arm() for name in ARMS})


def serve_round(toggle: OnlineToggle, prompts: list[list[int]], max_new: int, index: int
                ) -> tuple[Round, list[list[int]]]:
    """The prompts stepped to completion, the arms taking turns a decode step each: round `index` of a block
    (see the module docstring)."""
    order = ORDERS[index // 3 % len(ORDERS)]
    rt, online = toggle.runtime, toggle.online
    requests = [rt.new_request(p, max_new) for p in prompts]
    rt.stats = RunStats(gamma=rt.plan.gamma, requests=len(requests))
    rt.reset_switch()
    for r in requests:
        rt.enqueue(r)
    result, turn = Round(), index % 3
    while rt.has_work:
        # A step that prefills runs attached and counts in no arm: every prompt is scored, as when serving.
        prefills = bool(rt.scheduler.waiting or rt.scheduler.prefilling)
        name = "on" if prefills else order[turn % len(order)]
        arm = result.arms[name]
        if toggle.attached and name != "on":
            start = time.perf_counter()
            online.settle()  # the check under way is the "on" steps' work
            toggle.count_on(result.arms["on"], time.perf_counter() - start)
        toggle.attach(name == "on")
        decode, tokens = rt.stats.decode_seconds, sum(len(r.output) for r in requests)
        rt.step()
        if prefills or rt.stats.decode_seconds == decode:
            continue  # the turn stays
        if name == "on":
            toggle.count_on(arm, rt.stats.decode_seconds - decode)
        else:
            arm.seconds += rt.stats.decode_seconds - decode
        arm.tokens += sum(len(r.output) for r in requests) - tokens
        step = rt.last_step
        assert step is not None
        arm.steps += 1
        arm.request_steps += step.num_reqs
        arm.rows += step.rows
        arm.committed += step.committed
        turn += 1
    if toggle.attached:
        start = time.perf_counter()
        online.settle()
        toggle.count_on(result.arms["on"], time.perf_counter() - start)
    toggle.attach(False)
    return result, [r.output for r in requests]


def pooled(rounds: list[Round], a: str, b: str) -> float:
    """Arm a's decode tokens/s over arm b's, each pooled over `rounds`."""
    def rate(name: str) -> float:
        return sum(r.arms[name].tokens for r in rounds) / sum(r.arms[name].seconds for r in rounds)
    return rate(a) / rate(b)


def interval(rounds: list[Round], a: str, b: str, seed: int = 0) -> tuple[float, float]:
    """The bootstrap 95 % interval of `pooled(rounds, a, b)`, resampling blocks of `BLOCK` rounds."""
    blocks = len(rounds) // BLOCK

    def sums(name: str, what: str) -> np.ndarray:
        per_round = np.array([getattr(r.arms[name], what) for r in rounds], dtype=np.float64)
        return per_round[:blocks * BLOCK].reshape(blocks, BLOCK).sum(axis=1)

    tokens_a, seconds_a, tokens_b, seconds_b = (sums(n, w) for n in (a, b) for w in ("tokens", "seconds"))
    picks = np.random.default_rng(seed).integers(0, blocks, (BOOTSTRAP, blocks))
    ratios = ((tokens_a[picks].sum(1) / seconds_a[picks].sum(1))
              / (tokens_b[picks].sum(1) / seconds_b[picks].sum(1)))
    low, high = np.quantile(ratios, [0.025, 0.975])
    return float(low), float(high)


def report(rounds: list[Round], online: OnlineCalibrator, prompts: int, max_new: int, lossless: bool) -> None:
    print(f"{prompts} held-out prompts x {max_new} tokens, {len(rounds)} rounds in blocks of {BLOCK}; decode "
          f"steps take turns on / off / off2")
    for name in ARMS:
        arms = [r.arms[name] for r in rounds]
        steps, request_steps = sum(a.steps for a in arms), sum(a.request_steps for a in arms)
        seconds = sum(a.seconds for a in arms)
        print(f"  {name:<5} {steps:>6} steps  {sum(a.tokens for a in arms) / seconds:8.1f} decode tok/s  "
              f"{seconds / max(steps, 1) * 1e3:6.1f} ms a step  rows "
              f"{sum(a.rows for a in arms) / request_steps:.3f}  commit "
              f"{sum(a.committed for a in arms) / request_steps:.3f} a request-step")
    for a, label in (("on", "price: on / off"), ("off2", "A/A control: off2 / off")):
        low, high = interval(rounds, a, "off")
        print(f"  {label:<24} {pooled(rounds, a, 'off'):.4f}  (95 % interval {low:.4f} to {high:.4f})")
    on_seconds = sum(r.arms["on"].seconds for r in rounds)
    print(f"  online calibration's own time: {online.step_seconds / on_seconds:.2%} of the on steps' decode "
          f"seconds on the step path, {online.background_seconds / on_seconds:.2%} in CPU of its thread; "
          f"{online.refits} refits on {online.samples} labelled request-steps, drift {online.drift}")
    print(f"  lossless (every round equals target-only greedy decoding): {lossless}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("package", type=Path)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-chars", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=36, help=f"a multiple of {BLOCK}")
    args = parser.parse_args()
    if args.rounds < 2 * BLOCK or args.rounds % BLOCK:
        parser.error(f"--rounds must be a multiple of {BLOCK} (a block: every start, each way round), at "
                     f"least {2 * BLOCK}")

    package = load_package(args.package)
    runtime = Runtime(package, online_calibration=OnlineCalibrationSettings())
    prompts = [package.tokenizer.encode(p) for p in held_out_prompts(args.prompts, args.prompt_chars)]
    reference, _ = runtime.generate(prompts, args.max_new_tokens, target_only=True)
    toggle = OnlineToggle(runtime)
    runtime.generate(prompts[:2], 8)  # warm up (first graph replays, allocator growth), attached
    rounds, lossless = [], True
    for i in range(args.rounds):
        served, outputs = serve_round(toggle, prompts, args.max_new_tokens, i)
        rounds.append(served)
        lossless &= outputs == reference
    report(rounds, toggle.online, len(prompts), args.max_new_tokens, lossless)


if __name__ == "__main__":
    main()
