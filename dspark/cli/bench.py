"""`dspark bench`: load an OpenAI-compatible server with held-out prompts; report latency and throughput."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from dspark.bench.client import BenchConfig, BenchSetupError, benchmark, format_result
from dspark.corpus import held_out_prompts, load_prompts_file


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to a `dspark` subparsers object and return its parser."""
    p = subparsers.add_parser(
        "bench", help="load an OpenAI-compatible completions server and report latency and throughput",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    p.add_argument("--num-prompts", type=int, default=64,
                   help="requests to send (prompts are reused in order when there are fewer)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="most requests in flight (default: unlimited)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--max-tokens", type=int, default=128, help="completion tokens per request")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to generate --max-tokens tokens even past EOS (a dspark extension)")
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="a JSON list of strings (.json) or one prompt per line (default: held-out "
                        "standard-library code the embedded model never trained on)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
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
        return load_prompts_file(prompts_file)
    return held_out_prompts(count)


def run_bench(args: argparse.Namespace) -> int:
    """`dspark bench`: 0 when any request succeeded, 1 when none did (or none could be sent), 2 for bad
    arguments."""
    try:
        config = config_from_args(args)
        prompts = bench_prompts(args.prompts_file, config.num_prompts)
        if not prompts:
            raise ValueError(f"{args.prompts_file or 'the held-out set'}: no prompts")
    except (OSError, ValueError) as err:
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
