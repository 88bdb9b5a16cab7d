"""`dspark simulate`: adaptive verify vs every fixed verify length vs the oracle, on a recorded trace."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dspark.cli.common import CliError, load_package_or_fail, require_positive

DEFAULT_CONCURRENCIES = (1, 8, 32, 64, 128, 256)
DEFAULT_STEPS = 1000


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `simulate` to a `dspark` subparsers object; the parsed args carry their handler."""
    p = subparsers.add_parser(
        "simulate", help="replay a recorded trace under static, every fixed verify length, the "
                         "deployment's adaptive planner and the oracle",
        description="Trace-driven replay of the planner's decisions. At each concurrency c, steps of c "
                    "request-steps are drawn from a recording in which every row ran (seeded); each "
                    "policy chooses verify_lens, commits min(raw_correct_len, verify_len - 1) + 1 tokens "
                    "per request and is charged the cost model's step time (draft term included). "
                    "Policies: static (N rows), fixed k = 1..N, adaptive (PACKAGE's own planner: "
                    "calibration, lag, floor and cap, tier alignment) and oracle (raw_correct_len + 1 "
                    "rows, capped at N).")
    p.add_argument("package", type=Path,
                   help="a compact or cap-accept package: its planner and calibration are simulated")
    p.add_argument("--trace", type=Path, required=True, metavar="RECORDING",
                   help="directory written by `dspark run STATIC_PACKAGE --record DIR` (every row verified)")
    p.add_argument("--cost-model", type=Path, default=None, metavar="TABLE",
                   help="cost table file (sps-1d, additive or tier) pricing the steps and the planner's "
                        "budget (default: PACKAGE's own table)")
    p.add_argument("--concurrency", default=None, metavar="C1,C2,...",
                   help="requests per step (default: those of "
                        f"{','.join(map(str, DEFAULT_CONCURRENCIES))} that the cost table covers)")
    p.add_argument("--step-overhead-ms", type=float, default=0.0, metavar="MS",
                   help="milliseconds every step takes beyond the cost table (engine work a profile does "
                        "not time; benchmarks/simulate_fidelity.py measures it) (default: %(default)s)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help="simulated steps per concurrency (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request-step draws (default: 0)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG",
                   help="also draw tokens/s by concurrency per policy into this PNG")
    p.set_defaults(handler=run_simulate)
    return p


def parse_concurrencies(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CliError(f"--concurrency must be comma-separated positive integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise CliError(f"--concurrency must be comma-separated positive integers, got {text!r}")
    return list(dict.fromkeys(values))


def run_simulate(args: argparse.Namespace) -> int:
    require_positive("--steps", args.steps)
    if not 0.0 <= args.step_overhead_ms < float("inf"):
        raise CliError(f"--step-overhead-ms must be a finite number >= 0, got {args.step_overhead_ms}")
    requested = parse_concurrencies(args.concurrency) if args.concurrency is not None else None
    if args.plot is not None and args.plot.is_dir():
        raise CliError(f"--plot {args.plot} is a directory; pass a .png file path")
    from dspark.simulate.config import SimulationConfigError, check_trace_matches, simulation_setup
    from dspark.simulate.output import SimulationReport, format_report
    from dspark.simulate.policies import policies_for
    from dspark.simulate.sweep import simulate
    from dspark.simulate.trace import TraceError, read_run, read_trace

    pkg = load_package_or_fail(args.package)
    try:
        run = read_run(args.trace)
        check_trace_matches(pkg, run, str(args.trace))
        trace = read_trace(args.trace, run)
        setup = simulation_setup(pkg, args.cost_model, args.step_overhead_ms / 1e3)
    except (TraceError, SimulationConfigError, ValueError) as err:  # ValueError: CostTableError
        raise CliError(str(err)) from None
    n = setup.plan.num_draft_tokens
    if requested is None:
        concurrencies = setup.pricer.fitting(DEFAULT_CONCURRENCIES, n)
        if not concurrencies:
            raise CliError(f"the cost model ({setup.cost_model_source}) covers none of the default "
                           f"concurrencies {list(DEFAULT_CONCURRENCIES)}: "
                           f"{setup.pricer.misfit(DEFAULT_CONCURRENCIES[0], n)}; pass --concurrency")
    else:
        for c in requested:
            reason = setup.pricer.misfit(c, n)
            if reason is not None:
                raise CliError(f"--concurrency {c} does not fit the cost model ({setup.cost_model_source}): "
                               f"{reason}; profile larger steps or drop it")
        concurrencies = requested
    policies = policies_for(setup.plan, setup.pricer.decode_time, informed=trace.accept_prob is not None)
    results = simulate(trace, policies, setup.pricer, concurrencies, args.steps, args.seed,
                       setup.plan.lag_steps)
    report = SimulationReport(
        package=pkg.deployment.name, trace=str(args.trace), trace_policy=trace.policy,
        request_steps=trace.size, cost_model_kind=setup.pricer.table.kind,
        cost_model_source=setup.cost_model_source, step_overhead_ms=args.step_overhead_ms,
        tiers=setup.pricer.tiers, lag_steps=setup.plan.lag_steps,
        num_draft_tokens=n, steps=args.steps, seed=args.seed, results=tuple(results),
        decode_source=setup.pricer.decode_source)
    if args.plot is not None:
        from dspark.simulate.plot import plot_report

        try:
            plot_report(report, args.plot)
        except OSError as err:
            raise CliError(f"cannot write the plot {args.plot}: {err.strerror or err}") from None
    print(json.dumps(report.to_json(), indent=1) if args.json else format_report(report), end="\n" if
          args.json else "")
    return 0
