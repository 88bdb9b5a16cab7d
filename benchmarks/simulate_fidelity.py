"""How well `dspark simulate`'s model predicts measured throughput, in one run on the CPU.

1. Records a static trace of the static build (the held-out prompts `benchmarks/bench_modes.py` uses).
2. Measures the static and compact builds' tokens/s exactly as `bench_modes.py` does (interleaved
   rounds, median, lossless check against target-only greedy decoding).
3. Predicts both from the trace alone with the compact package's own planner and cost table:
   `dspark.simulate.run_replay` replays the recorded run's requests to completion under the static
   policy and under the package's adaptive planner, and prices every step with the table ("table");
   a second prediction ("+step") adds to every step of both modes what the static build's measured
   decode steps took beyond the table, per step (engine work a profile does not time; `dspark simulate
   --step-overhead-ms` takes it): static is then calibrated to itself and compact is the prediction.

It prints predicted against measured tokens/s and the relative error end to end (the measured prefill
time added to the prediction: prefill is the same under every policy and no cost table prices it) and
for the decode steps alone, the compact/static ratio, the table's own error on the recorded static
steps (which separates the cost model from the policy model), each mode's per-step time beyond the
table on recorded runs (a recorded compact run gives compact's: what +step cannot know), and
`dspark simulate`'s steady-state figures at the run's concurrency for reference.

    .venv/bin/python benchmarks/simulate_fidelity.py --save-trace runs/tiny_static_trace
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_modes import summarize
from bench_static import held_out_prompts

from dspark.cli.run import run_info
from dspark.formats.step_records import StepRecord, read_steps
from dspark.measure.recording import STEPS_FILE, RunRecorder
from dspark.modes import VerifyMode
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.engine.stats import RunStats
from dspark.runtime.package import load_package
from dspark.simulate.config import simulation_setup
from dspark.simulate.policies import AdaptivePolicy, StaticPolicy
from dspark.simulate.pricing import StepPricer
from dspark.simulate.run_replay import RunReplay, replay_run
from dspark.simulate.sweep import simulate_concurrency
from dspark.simulate.trace import read_trace


def record_run(runtime: Runtime, prompts: list[list[int]], max_new_tokens: int, directory: Path) -> Path:
    """A recording of `prompts`, as `dspark run --record` writes it."""
    recorder = RunRecorder(directory, runtime.plan.gamma, runtime.sampling.policy, 100_000)
    runtime.recorder = recorder
    stats = None
    try:
        _, stats = runtime.generate(prompts, max_new_tokens)
    finally:
        runtime.recorder = None
        recorder.close(run_info(runtime, False, stats))
    return directory


def measure(runtimes: list[Runtime], prompts: list[list[int]], max_new_tokens: int,
            rounds: int) -> list[tuple[dict[str, Any], list[RunStats]]]:
    """bench_modes.py's measurement: target-only reference, warm-up, interleaved rounds, medians."""
    reference, _ = runtimes[0].generate(prompts, max_new_tokens, target_only=True)
    for rt in runtimes:
        rt.generate(prompts[:2], 8)
    stats: list[list[RunStats]] = [[] for _ in runtimes]
    lossless = [True] * len(runtimes)
    for _ in range(rounds):
        for i, rt in enumerate(runtimes):
            out, run = rt.generate(prompts, max_new_tokens)
            stats[i].append(run)
            lossless[i] &= out == reference
    return [(summarize(rt.deployment.name, rt.deployment.verify_mode, s, ok), s)
            for rt, s, ok in zip(runtimes, stats, lossless, strict=True)]


def excess_seconds(steps: Sequence[StepRecord], pricer: StepPricer) -> list[float]:
    """Per recorded step: measured seconds minus what the table predicts for its requests and rows."""
    return [s.step_seconds - pricer.seconds(s.num_reqs, s.rows) for s in steps]


def error(predicted: float, measured: float) -> float:
    return predicted / measured - 1.0


def predict(measured: list[tuple[dict[str, Any], list[RunStats]]], replays: dict[str, dict[str, RunReplay]],
            steady: dict[str, float]) -> list[dict[str, Any]]:
    """One row per mode: measured and predicted tokens/s end to end and for the decode steps alone."""
    rows = []
    for (summary, runs), mode in zip(measured, ("static", "compact"), strict=True):
        generated = runs[-1].generated_tokens  # the same under every policy: greedy decoding is lossless
        prefill = statistics.median(r.prefill_seconds for r in runs)
        decode = statistics.median(r.decode_seconds for r in runs)
        row: dict[str, Any] = {
            "package": summary["package"], "mode": summary["mode"], "lossless": summary["lossless"],
            "generated_tokens": generated, "measured_prefill_seconds": prefill,
            "measured_decode_seconds": decode, "measured_tokens_per_s": summary["tokens_per_s"],
            "measured_decode_tokens_per_s": generated / decode,
            "measured_rows_per_request_step": summary["rows_per_request_step"],
            "measured_steps": runs[-1].steps, "steady_state_tokens_per_s": steady[mode]}
        for model, replay in replays[mode].items():
            row[model] = {"decode_seconds": replay.seconds, "steps": replay.steps,
                          "rows_per_request_step": replay.rows / replay.request_steps,
                          "tokens_per_s": generated / (prefill + replay.seconds),
                          "decode_tokens_per_s": generated / replay.seconds}
            row[model]["error"] = error(row[model]["tokens_per_s"], row["measured_tokens_per_s"])
            row[model]["decode_error"] = error(row[model]["decode_tokens_per_s"],
                                               row["measured_decode_tokens_per_s"])
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--static", type=Path, default=Path("generated/tiny_cpu_static"))
    parser.add_argument("--compact", type=Path, default=Path("generated/tiny_cpu_compact"))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-chars", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=9,
                        help="interleaved measured rounds (default: 9: with 3, one slow round of a "
                        "shared machine moved compact's measurement by 10%%)")
    parser.add_argument("--steps", type=int, default=1000, help="steady-state steps per policy")
    parser.add_argument("--cost-model", type=Path, default=None, metavar="TABLE",
                        help="price the steps with this table instead of the compact package's own (e.g. "
                             "one profiled at the workload's context length)")
    parser.add_argument("--save-trace", type=Path, default=None, metavar="DIR",
                        help="keep the recorded static trace here (default: a temporary directory)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]  # a shared machine's other work shows up in every measured figure
    static_rt, compact_rt = Runtime(load_package(args.static)), Runtime(load_package(args.compact))
    if static_rt.deployment.verify_mode is not VerifyMode.STATIC:
        parser.error(f"--static {args.static} is a {static_rt.deployment.verify_mode} build")
    tokenizer = static_rt.package.tokenizer
    prompts = [tokenizer.encode(p) for p in held_out_prompts(args.prompts, args.prompt_chars)]
    for rt in (static_rt, compact_rt):
        rt.generate(prompts[:2], 8)  # warm up before the recorded runs, like the measured ones
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = record_run(static_rt, prompts, args.max_new_tokens,
                               args.save_trace or Path(tmp) / "trace")
        trace = read_trace(trace_dir)
        static_steps = read_steps(trace_dir / STEPS_FILE, trace.gamma)
        compact_dir = record_run(compact_rt, prompts, args.max_new_tokens, Path(tmp) / "compact")
        compact_steps = read_steps(compact_dir / STEPS_FILE, trace.gamma)
    measured = measure([static_rt, compact_rt], prompts, args.max_new_tokens, args.rounds)

    setup = simulation_setup(compact_rt.package, args.cost_model)
    plan, pricer = setup.plan, setup.pricer
    policies = {"static": StaticPolicy(plan.num_draft_tokens), "compact": AdaptivePolicy(plan)}
    static_table = replay_run(trace, policies["static"], pricer)
    # "+step": the static build's measured decode time spread over its steps beyond what the table says
    # (the replay runs exactly its steps), added to every step of both modes. It calibrates static to
    # itself; compact, with its own number of steps and rows, is then the prediction.
    static_decode = statistics.median(r.decode_seconds for r in measured[0][1])
    overhead = max(static_decode - static_table.seconds, 0.0) / static_table.steps
    with_overhead = dataclasses.replace(pricer, step_overhead=overhead)
    replays = {mode: {model: replay_run(trace, policy, model_pricer, plan.lag_steps)
                      for model, model_pricer in (("table", pricer), ("table_plus_step", with_overhead))}
               for mode, policy in policies.items()}
    concurrency = min(args.prompts, static_rt.deployment.serving.max_running_requests)
    steady = {mode: r.tokens_per_s for mode, r in zip(policies, simulate_concurrency(
        trace, list(policies.values()), pricer, concurrency, args.steps, 0, plan.lag_steps), strict=True)}
    rows = predict(measured, replays, steady)
    static, compact = rows
    ratio: dict[str, float] = {"measured": compact["measured_tokens_per_s"] / static["measured_tokens_per_s"]}
    for model in ("table", "table_plus_step"):
        ratio[model] = compact[model]["tokens_per_s"] / static[model]["tokens_per_s"]
        ratio[f"{model}_error"] = error(ratio[model], ratio["measured"])
    recorded = sum(s.step_seconds for s in static_steps)
    table_seconds = replays["static"]["table"].seconds  # the recorded steps exactly: the table's own error
    result = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
              "cost_model": f"{pricer.table.kind} ({setup.cost_model_source})",
              "trace_request_steps": trace.size, "results": rows, "compact_over_static": ratio,
              "table_on_recorded_static_steps": {"measured_seconds": recorded,
                                                 "predicted_seconds": table_seconds,
                                                 "error": error(table_seconds, recorded)},
              "step_overhead_seconds": overhead,
              "step_seconds_beyond_table": {
                  "static_median": statistics.median(excess_seconds(static_steps, pricer)),
                  "compact_median": statistics.median(excess_seconds(compact_steps, pricer))},
              "steady_state_concurrency": concurrency,
              "load_average": {"start": load_before, "end": os.getloadavg()[0], "cpus": os.cpu_count()}}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print_result(result)


def print_result(result: dict[str, Any]) -> None:
    table, excess = result["table_on_recorded_static_steps"], result["step_seconds_beyond_table"]
    print(f"{result['prompts']} held-out prompts x {result['max_new_tokens']} tokens; measured: median of "
          f"{result['rounds']} interleaved rounds (bench_modes.py); predicted: the recorded static trace "
          f"({result['trace_request_steps']} request-steps) replayed with {result['cost_model']}")
    load = result["load_average"]
    print(f"1-minute load average {load['start']:.2f} at the start, {load['end']:.2f} at the end, on "
          f"{load['cpus']} CPUs")
    print(f"{'':<26} {'end to end (prefill measured + decode)':^38}   {'decode steps only':^38}")
    columns = f"{'measured':>8} {'table':>7} {'error':>7} {'+step':>7} {'error':>7}"
    print(f"{'package':<17} {'mode':<8} {columns}   {columns}")
    for r in result["results"]:
        t, p = r["table"], r["table_plus_step"]
        print(f"{r['package']:<17} {r['mode']:<8} {r['measured_tokens_per_s']:>8.1f} "
              f"{t['tokens_per_s']:>7.1f} {t['error']:>+7.1%} "
              f"{p['tokens_per_s']:>7.1f} {p['error']:>+7.1%}   "
              f"{r['measured_decode_tokens_per_s']:>8.1f} {t['decode_tokens_per_s']:>7.1f} "
              f"{t['decode_error']:>+7.1%} {p['decode_tokens_per_s']:>7.1f} {p['decode_error']:>+7.1%}")
    for r in result["results"]:
        print(f"{r['package']}: verify rows per request-step measured "
              f"{r['measured_rows_per_request_step']:.2f}, predicted "
              f"{r['table']['rows_per_request_step']:.2f}; decode steps measured "
              f"{r['measured_steps']}, predicted {r['table']['steps']}; lossless {r['lossless']}")
    ratio = result["compact_over_static"]
    print(f"compact / static tokens/s: measured {ratio['measured']:.3f}, table {ratio['table']:.3f} "
          f"({ratio['table_error']:+.1%}), +step {ratio['table_plus_step']:.3f} "
          f"({ratio['table_plus_step_error']:+.1%})")
    print(f"the table on the recorded static steps: {table['predicted_seconds']:.3f} s predicted vs "
          f"{table['measured_seconds']:.3f} s measured ({table['error']:+.1%})")
    print(f"+step adds {result['step_overhead_seconds'] * 1e3:.2f} ms to every step (static's measured "
          "decode time beyond the table, per step: static matches itself by construction)")
    print(f"per-step time beyond the table, median over the recorded runs' steps: static "
          f"{excess['static_median'] * 1e3:.2f} ms, compact {excess['compact_median'] * 1e3:.2f} ms")
    steady = {r["mode"]: r["steady_state_tokens_per_s"] for r in result["results"]}
    print(f"dspark simulate's steady state at concurrency {result['steady_state_concurrency']} (table): "
          f"static {steady['static']:.1f}, adaptive {steady['compact']:.1f} tokens/s (no ramp-up, drain or "
          "prefill)")


if __name__ == "__main__":
    main()
