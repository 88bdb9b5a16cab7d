"""`dspark bench`: load an OpenAI-compatible server with prompts; report latency and throughput."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from dspark.bench.client import BenchConfig, BenchSetupError, benchmark, format_result
from dspark.cli.common import CliError, read_prompts_file
from dspark.corpus import held_out_prompts


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to a `dspark` subparsers object and return its parser."""
    p = subparsers.add_parser(
        "bench", help="load an OpenAI-compatible completions server and report latency and throughput",
        description="Send streaming POST /v1/completions requests to a running server (dspark serve, or "
                    "any OpenAI-compatible one) and report throughput, time to first token, time per "
                    "output token, end-to-end latency (mean, p50, p99) and, from a dspark server, the "
                    "mean tokens per decode step.")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
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
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
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


def run_bench(args: argparse.Namespace) -> int:
    """`dspark bench`: 0 when any request succeeded, 1 when none did (or none could be sent), 2 for bad
    arguments."""
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
