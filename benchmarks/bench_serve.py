"""Serving throughput and latency of several builds under `dspark serve`, at several concurrencies.

For each package: start `dspark serve` on a free local port, run `dspark bench`'s client at each
concurrency on the same held-out prompts (greedy, `ignore_eos` so every request generates the same
number of tokens), stop the server. Prints one row per (package, concurrency) and each package's
output tokens/s relative to the first package at the same concurrency.

    .venv/bin/python benchmarks/bench_serve.py generated/tiny_cpu_static generated/tiny_cpu_compact \\
        --concurrency 1,8,32 --json benchmarks/results/cpu_tiny_serve.json
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from dspark.bench.client import BenchConfig, benchmark
from dspark.corpus import held_out_prompts

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(package: Path, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "dspark.cli.main", "serve", str(package), "--port",
                             str(port), "--log-level", "warning"], cwd=REPO)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{package}: the server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.terminate()
    raise SystemExit(f"{package}: the server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("packages", nargs="+", type=Path)
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrencies")
    parser.add_argument("--prompts-per-client", type=int, default=4,
                        help="requests per concurrent client (at least 16 requests per run)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    pool = held_out_prompts(max(levels) * args.prompts_per_client, 200, phase=40)
    rows: list[dict[str, Any]] = []
    for package in args.packages:
        port = _free_port()
        proc = start_server(package, port)
        try:
            for c in levels:
                count = max(16, c * args.prompts_per_client)
                config = BenchConfig(url=f"http://127.0.0.1:{port}", num_prompts=count, concurrency=c,
                                     max_tokens=args.max_tokens, ignore_eos=True, progress=False)
                result = benchmark(config, pool[:count]).to_json()
                rows.append({"package": package.name, "concurrency": c, **result})
                ttft, tpot = result["ttft"]["p50_ms"], result["tpot"]["p50_ms"]
                per_step = result["mean_accepted_tokens_per_step"] or float("nan")
                print(f"{package.name:<24} c={c:<3} {result['output_throughput']:8.1f} tok/s  "
                      f"TTFT p50 {ttft:7.1f} ms  TPOT p50 {tpot:6.2f} ms  tokens/step {per_step:.2f}  "
                      f"failed {result['failed']}", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    base = {r["concurrency"]: r["output_throughput"] for r in rows if r["package"] == args.packages[0].name}
    print("\noutput tokens/s relative to", args.packages[0].name)
    for r in rows:
        ratio = r["output_throughput"] / base[r["concurrency"]]
        print(f"{r['package']:<24} c={r['concurrency']:<3} {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
