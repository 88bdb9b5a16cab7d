"""`dspark bench`: load an OpenAI-compatible server with prompts; report latency and throughput.

`--url` loads one running server; `--sweep PACKAGE ...` starts a server per decoding policy itself and
measures each at every load (dspark/bench/sweep.py). This module parses and maps errors to exit statuses.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dspark.bench.client import BenchConfig, BenchSetupError, benchmark, format_result
from dspark.bench.sweep import (
    DEFAULT_CONCURRENCY,
    POLICIES,
    SweepConfig,
    SweepError,
    SweepPackage,
    SweepUsageError,
    plan_runs,
    run_sweep,
)
from dspark.bench.sweep_data import DEFAULT_SLICE_S
from dspark.bench.sweep_output import format_table, write_outputs
from dspark.cli.common import CliError, load_package_or_fail, read_prompts_file
from dspark.corpus import held_out_prompts


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to a `dspark` subparsers object and return its parser."""
    p = subparsers.add_parser(
        "bench", help="load an OpenAI-compatible completions server and report latency and throughput",
        description="Send streaming POST /v1/completions requests to a running server (dspark serve, or "
                    "any OpenAI-compatible one) and report throughput, time to first token, time per "
                    "output token, end-to-end latency (mean, p50, p99) and, from a dspark server, the "
                    "mean tokens per decode step. With --sweep it starts dspark serve itself, once per "
                    "decoding policy (target-only, static, fixed k, adaptive), loads each server at "
                    "every concurrency (and request rate) with the same greedy prompts, and prints one "
                    "table of tokens/s, TPOT, TTFT and tokens per step by load and policy.")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000")
    target.add_argument("--sweep", nargs="+", type=Path, default=None, metavar="PACKAGE",
                        help="instead of loading a running server, start one per decoding policy on the "
                             "given generated packages (a compact or cap-accept build, and optionally the "
                             "static build of the same models), load each at every concurrency and rate, "
                             "and print one table; e.g. --sweep generated/tiny_cpu_compact "
                             "generated/tiny_cpu_static")
    p.add_argument("--model", default=None,
                   help="model name to request (default: the first the server lists at /v1/models)")
    p.add_argument("--num-prompts", type=int, default=64,
                   help="requests to send; prompts are reused in order when there are fewer (default: 64)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="most requests in flight at once (default: unlimited)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="completion tokens per request (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature, 0 = greedy (default: 0)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to generate --max-tokens tokens even past the end of text (a "
                        "dspark extension; other servers may refuse it)")
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="a JSON list of strings (.json) or one prompt per line (default: held-out "
                        "Python standard-library code the embedded model was not trained on)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times (default: 0)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (with --sweep: no progress lines)")
    sweep = p.add_argument_group("sweep options (with --sweep)")
    sweep.add_argument("--concurrency-list", default=None, metavar="C1,C2,...",
                       help="closed-loop concurrencies: each keeps this many requests in flight, sending "
                            "--num-prompts requests and at least 2 per slot (default: "
                            f"{','.join(map(str, DEFAULT_CONCURRENCY))})")
    sweep.add_argument("--request-rates", default=None, metavar="R1,R2,...",
                       help="also load each server with Poisson arrivals at these mean requests per "
                            "second, --num-prompts requests each (default: none)")
    sweep.add_argument("--policies", default=None, metavar="P1,P2,...",
                       help="decoding policies, each its own server: target-only (no speculation), static "
                            "(the static package), fixed (every k = 1..gamma+1 rows verified per request, "
                            "see --fixed-k), adaptive (the compact package as compiled) (default: all "
                            "that the packages allow)")
    sweep.add_argument("--fixed-k", default=None, metavar="K1,K2,...",
                       help="the k of the fixed policy (default: every k from 1 to gamma+1)")
    sweep.add_argument("--out", type=Path, default=None, metavar="DIR",
                       help="write sweep.json (every point and request), sweep.txt (the table) and "
                            "sweep.png (tokens/s against concurrency) here")
    sweep.add_argument("--rounds", type=int, default=None, metavar="R",
                       help="run every load R times by every policy, with every server up at once and the "
                            "order rotated each time; the table shows each point's median round "
                            "(default: 1, one server after another)")
    sweep.add_argument("--twin", action="store_const", const=True, default=None,
                       help="also run a second, identical adaptive server (adaptive-twin, never a "
                            "baseline): its ratio to the best baseline, printed beside adaptive's, is how "
                            "far apart two servers of one policy measure on this machine in this run")
    sweep.add_argument("--interleave", action="store_const", const=True, default=None,
                       help="instead of servers, run every policy's engine in this process, each its own "
                            "closed loop at the concurrency, taking turns of --slice-seconds in a shuffled "
                            "order, so that a machine whose speed drifts within seconds slows every policy "
                            "alike; --rounds passes of the same requests per load (default 4); prints "
                            "tokens/s and tokens per step, no latencies (closed-loop loads only)")
    sweep.add_argument("--slice-seconds", type=float, default=None, metavar="SECONDS",
                       help="with --interleave: the length of an engine's turn (default: "
                            f"{DEFAULT_SLICE_S:g})")
    sweep.add_argument("--server-timeout", type=float, default=None, metavar="SECONDS",
                       help=f"how long a server may take to start answering (default: {SERVER_TIMEOUT_S:g})")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(url=args.url, model=args.model, num_prompts=args.num_prompts,
                       concurrency=args.concurrency, request_rate=args.request_rate,
                       max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                       ignore_eos=args.ignore_eos, progress=not args.no_progress)


def bench_prompts(prompts_file: Path | None, count: int) -> list[str]:
    """The prompt pool: the file's prompts, or `count` held-out ones."""
    if prompts_file is not None:
        return read_prompts_file(prompts_file)
    return held_out_prompts(count)


def _fail(message: str, status: int) -> int:
    print(f"dspark bench: error: {message}", file=sys.stderr)
    return status


def run_bench(args: argparse.Namespace) -> int:
    """`dspark bench`: 0 when any request succeeded, 1 when none did (or none could be sent), 2 for bad
    arguments. With --sweep: `run_sweep_command`."""
    if getattr(args, "sweep", None) is not None:
        return run_sweep_command(args)
    given = [flag for flag, dest in SWEEP_ONLY if getattr(args, dest, None) is not None]
    if given:
        return _fail(f"{given[0]} belongs to a sweep: add --sweep PACKAGE ... (which starts its own "
                     "servers) instead of --url", 2)
    try:
        config = config_from_args(args)
        prompts = bench_prompts(args.prompts_file, config.num_prompts)
        if not prompts:
            raise ValueError(f"{args.prompts_file or 'the held-out set'}: no prompts")
    except (CliError, ValueError) as err:
        print(f"dspark bench: error: {err}", file=sys.stderr)
        return 2
    try:
        result = benchmark(config, prompts)
    except BenchSetupError as err:
        print(f"dspark bench: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(result.to_json(), indent=2) if args.json else format_result(result))
    if not result.completed:
        print(f"dspark bench: error: all {result.failed} requests failed", file=sys.stderr)
        return 1
    return 0


# -- --sweep ----------------------------------------------------------------------------------------
SWEEP_ONLY = (("--concurrency-list", "concurrency_list"), ("--request-rates", "request_rates"),
              ("--policies", "policies"), ("--fixed-k", "fixed_k"), ("--out", "out"),
              ("--server-timeout", "server_timeout"), ("--rounds", "rounds"),
              ("--twin", "twin"), ("--interleave", "interleave"), ("--slice-seconds", "slice_seconds"))
INTERLEAVE_ROUNDS = 4  # passes per load by default: the fewest that give a bootstrap interval
SERVER_TIMEOUT_S = 300.0


def parse_counts(flag: str, text: str, example: str) -> tuple[int, ...]:
    """Comma-separated positive integers, sorted, each once."""
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SweepUsageError(f"{flag} must be comma-separated positive integers such as {example}, "
                              f"got {text!r}")
    return tuple(sorted(set(values)))


def parse_rates(flag: str, text: str) -> tuple[float, ...]:
    try:
        values = [float(item) for item in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 < v < math.inf for v in values):  # also refuses NaN
        raise SweepUsageError(f"{flag} must be comma-separated positive request rates (per second) such "
                              f"as 1,4,16, got {text!r}")
    return tuple(sorted(set(values)))


def parse_policies(text: str) -> tuple[str, ...]:
    names = [item.strip() for item in text.split(",") if item.strip()]
    if not names:
        raise SweepUsageError(f"--policies needs at least one of {', '.join(POLICIES)}, got {text!r}")
    return tuple(names)


def sweep_package(path: Path) -> SweepPackage:
    """The generated package at `path`, as the sweep needs it (its verify mode and N)."""
    try:
        pkg = load_package_or_fail(path)
    except CliError as err:
        raise SweepUsageError(f"--sweep: {err}") from None
    dep = pkg.deployment
    return SweepPackage(path, dep.name, str(dep.verify_mode), pkg.plan.num_draft_tokens)


def _refuse_single_server_flags(args: argparse.Namespace) -> None:
    """Flags of one run against --url that a sweep sets itself."""
    if args.concurrency is not None:
        raise SweepUsageError("--concurrency is for --url; a sweep takes --concurrency-list")
    if not math.isinf(args.request_rate):
        raise SweepUsageError("--request-rate is for --url; a sweep takes --request-rates")
    if args.model is not None:
        raise SweepUsageError("--model is for --url; a sweep requests the model its own servers serve")
    if args.temperature != 0:
        raise SweepUsageError("--temperature: a sweep decodes greedily (so that every policy's outputs can "
                              "be compared with target-only's); leave --temperature out")


def sweep_config_from_args(args: argparse.Namespace) -> SweepConfig:
    """The sweep's config; a `SweepUsageError` naming the flag for anything wrong, before any server."""
    _refuse_single_server_flags(args)
    BenchConfig(url="http://127.0.0.1", num_prompts=args.num_prompts, max_tokens=args.max_tokens)  # checks
    concurrency = (DEFAULT_CONCURRENCY if args.concurrency_list is None
                   else parse_counts("--concurrency-list", args.concurrency_list, "1,2,4,8"))
    rates = () if args.request_rates is None else parse_rates("--request-rates", args.request_rates)
    policies = None if args.policies is None else parse_policies(args.policies)
    fixed_k = None if args.fixed_k is None else parse_counts("--fixed-k", args.fixed_k, "1,4,8")
    timeout = SERVER_TIMEOUT_S if args.server_timeout is None else args.server_timeout
    if not 0 < timeout < math.inf:
        raise SweepUsageError(f"--server-timeout must be a positive number of seconds, got {timeout:g}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise SweepUsageError(f"--out {args.out} is a file; pass a directory (it is created if missing)")
    packages = tuple(sweep_package(path) for path in args.sweep)
    runs, notes = plan_runs(packages, policies, fixed_k, twin=bool(args.twin))
    command = ["dspark", "bench", "--sweep", *map(str, args.sweep),
               "--concurrency-list", ",".join(map(str, concurrency)),
               "--policies", ",".join(policies or POLICIES), "--num-prompts", str(args.num_prompts),
               "--max-tokens", str(args.max_tokens), "--seed", str(args.seed)]
    if rates:
        command += ["--request-rates", ",".join(f"{r:g}" for r in rates)]
    if fixed_k is not None:
        command += ["--fixed-k", ",".join(map(str, fixed_k))]
    rounds = (INTERLEAVE_ROUNDS if args.interleave else 1) if args.rounds is None else args.rounds
    if rounds > 1 or args.interleave:
        command += ["--rounds", str(rounds)]
    if args.twin:
        command += ["--twin"]
    if args.interleave:
        if rates:
            raise SweepUsageError("--request-rates: an interleaved sweep runs closed-loop loads only (a "
                                  "Poisson stream cannot pause while other engines take their turns); drop "
                                  "--request-rates or --interleave")
        if args.server_timeout is not None:
            raise SweepUsageError("--server-timeout: an interleaved sweep starts no server; drop it")
        command += ["--interleave", "--slice-seconds", f"{slice_seconds(args):g}"]
    elif args.slice_seconds is not None:
        raise SweepUsageError("--slice-seconds is the turn of an interleaved sweep; add --interleave")
    if args.prompts_file is not None:
        command += ["--prompts-file", str(args.prompts_file)]
    return SweepConfig(packages=packages, runs=tuple(runs), concurrency=concurrency, request_rates=rates,
                       num_prompts=args.num_prompts, max_tokens=args.max_tokens, seed=args.seed,
                       server_timeout_s=timeout, notes=tuple(notes), command=shlex.join(command),
                       rounds=rounds)


def slice_seconds(args: argparse.Namespace) -> float:
    value = DEFAULT_SLICE_S if args.slice_seconds is None else args.slice_seconds
    if not 0 < value < math.inf:
        raise SweepUsageError(f"--slice-seconds must be a positive number of seconds, got {value:g}")
    return value


def run_interleave_command(args: argparse.Namespace, config: SweepConfig, prompts: list[str],
                           log: Callable[[str], None]) -> int:
    """`dspark bench --sweep ... --interleave`: 1 when a policy's output differs from target-only's."""
    from dspark.bench.interleave import format_interleaved, run_interleaved, write_interleaved

    result = run_interleaved(config, prompts, slice_seconds(args), log)
    table = format_interleaved(result)
    print(json.dumps(result.to_json(), indent=1) if args.json else table)
    if args.out is not None:
        written = write_interleaved(result, args.out, table)
        log(f"wrote {', '.join(map(str, written))}")
    differing = [check.policy for check in result.lossless if not check.identical]
    if differing:
        return _fail(f"greedy outputs of {', '.join(differing)} differ from target-only's (speculation must "
                     "be lossless)", 1)
    return 0


def run_sweep_command(args: argparse.Namespace) -> int:
    """`dspark bench --sweep`: 0 when every request succeeded, 1 when a server failed or requests did, 2
    for bad arguments."""
    try:
        config = sweep_config_from_args(args)
        prompts = bench_prompts(args.prompts_file, config.pool_size)
        if not prompts:
            raise ValueError(f"{args.prompts_file or 'the held-out set'}: no prompts")
    except (SweepUsageError, CliError, ValueError) as err:
        return _fail(str(err), 2)

    def log(line: str) -> None:
        if not args.no_progress:
            print(f"dspark bench: {line}", file=sys.stderr, flush=True)

    if args.interleave:
        return run_interleave_command(args, config, prompts, log)
    try:
        result = run_sweep(config, prompts, log)
    except SweepError as err:
        return _fail(str(err), 1)
    table = format_table(result)
    print(json.dumps(result.to_json(), indent=1) if args.json else table)
    if args.out is not None:
        written = write_outputs(result, args.out, table)
        log(f"wrote {', '.join(map(str, written))}")
    if result.failed_requests:
        return _fail(f"{result.failed_requests} requests failed (their errors are in the table's points"
                     f"{' and in sweep.json' if args.out is not None else ''})", 1)
    return 0
