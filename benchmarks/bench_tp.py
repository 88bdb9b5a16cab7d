"""Tensor parallelism on the CPU: TP=2 (two gloo ranks under torchrun) against TP=1 (one process) decoding
the same prompts with the same build, timed in one run; with `--dp-attention`, DP attention over the two
ranks (tp 2, dp 2: each DP rank's engine serves half the requests) instead of TP=2.

The build is `specs/llama_50m_cpu_<mode>.yaml` (a 50M-parameter Llama with dummy weights), compiled once
as given and once with the two-rank parallelism into a temporary directory. Each side runs the engine in a
worker (`--worker`): a warm-up generate, then `--rounds` timed target-only and speculative generates;
rank 0 reports tokens/s (the median over rounds) and the communication time per engine step (prefill
steps included): the wall time of its layers' collectives and of its step commands (`COMM_CLOCK`), waits
for the other rank included. The machine's cores are shared out (one process runs a thread per core,
each of two ranks half of them). What this shows on a 2-core machine: each rank's compute halves, but
every step adds a broadcast of the step and two collectives per layer; it is not a model of a GPU node.

    .venv/bin/python benchmarks/bench_tp.py
    .venv/bin/python benchmarks/bench_tp.py --mode compact --new-tokens 32 --rounds 3
    .venv/bin/python benchmarks/bench_tp.py --dp-attention
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ("The quick brown fox", "Once upon a time", "def main():", "In the beginning",
           "Hello, world", "import numpy as np", "Dear reader,", "SELECT * FROM")


def compile_build(mode: str, parallelism: dict[str, int], root: Path) -> Path:
    from dspark.compiler import build

    spec_path = REPO / "specs" / f"llama_50m_cpu_{mode}.yaml"
    spec = yaml.safe_load(spec_path.read_text())
    for section in ("cost_model", "calibration"):
        if isinstance(spec.get(section), dict) and "file" in spec[section]:
            spec[section]["file"] = str(spec_path.parent / spec[section]["file"])
    suffix = "_".join(f"{key.replace('_', '')}{int(value)}" for key, value in parallelism.items())
    spec["name"] = f"llama_50m_cpu_{mode}_{suffix}"
    spec["parallelism"] = parallelism
    path = root / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return build(path, root / spec["name"], allow_stale_tables=True).package_dir


def worker(package: Path, new_tokens: int, rounds: int) -> None:
    """Run inside each rank: rank 0 times generates and prints one JSON line; the others follow."""
    from dspark.runtime.distributed.tensor_parallel import COMM_CLOCK
    from dspark.runtime.engine.runtime import Runtime, follows
    from dspark.runtime.package import load_package

    pkg = load_package(package)
    if follows(pkg):
        return
    rt = Runtime(pkg)
    try:
        prompts = [pkg.tokenizer.encode(p) for p in PROMPTS]
        rt.generate(prompts, 8)  # warm-up
        report: dict[str, object] = {"tp": rt.ranks.world.size}
        for kind, target_only in (("target_only", True), ("speculative", False)):
            rates, collective, command = [], [], []
            for _ in range(rounds):
                COMM_CLOCK.reset()
                COMM_CLOCK.enabled = rt.ranks.world.size > 1
                _, stats = rt.generate(prompts, new_tokens, target_only=target_only)
                COMM_CLOCK.enabled = False
                rates.append(stats.generated_tokens / (stats.prefill_seconds + stats.decode_seconds))
                steps = max(stats.steps, 1)
                collective.append(COMM_CLOCK.seconds.get("collective", 0.0) / steps)
                # under DP attention the engines' agreements are commands of the step too
                command.append((COMM_CLOCK.seconds.get("command", 0.0)
                                + COMM_CLOCK.seconds.get("agreement", 0.0)) / steps)
            report[kind] = {"tokens_per_s": statistics.median(rates),
                            "collective_ms_per_step": 1e3 * statistics.median(collective),
                            "command_ms_per_step": 1e3 * statistics.median(command)}
        print(json.dumps(report), flush=True)
    finally:
        rt.close()


def launch(package: Path, tp: int, new_tokens: int, rounds: int) -> dict:
    # the machine's cores shared out: one process gets all of them, each of tp ranks its share
    threads = max(1, (os.cpu_count() or 1) // tp)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
    me = [str(Path(__file__).resolve()), "--worker", str(package), "--new-tokens", str(new_tokens),
          "--rounds", str(rounds)]
    if tp == 1:
        command = [sys.executable, *me]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp),
                   "--master-addr", "127.0.0.1", "--master-port", str(port), *me]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"the {tp}-process run failed:\n{done.stderr[-3000:]}")
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("static", "compact"), default="static")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dp-attention", action="store_true",
                        help="the two ranks run DP attention (tp 2, dp 2) instead of TP=2")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.new_tokens, args.rounds)
        return 0
    two_ranks = {"tp": 2, "dp": 2, "dp_attention": True} if args.dp_attention else {"tp": 2}
    label = "DP=2" if args.dp_attention else "TP=2"
    with tempfile.TemporaryDirectory() as tmp:
        one = launch(compile_build(args.mode, {"tp": 1}, Path(tmp)), 1, args.new_tokens, args.rounds)
        two = launch(compile_build(args.mode, two_ranks, Path(tmp)), 2, args.new_tokens, args.rounds)
    cores = os.cpu_count() or 1
    print(f"llama_50m_cpu_{args.mode}: {len(PROMPTS)} prompts x {args.new_tokens} tokens, median of "
          f"{args.rounds} rounds; {cores} cores: TP=1 runs {cores} threads, each {label} rank "
          f"{max(1, cores // 2)}")
    commands = ("rank 0's step commands to the other DP rank's engine and the engines' per-step agreements"
                if args.dp_attention else "rank 0's broadcast of each forward and logits call")
    print(f"{label} per step (prefill steps included): collectives = the layers' all-reduces and "
          f"all-gathers, commands = {commands}")
    print(f"{'decode':<12} {'TP=1 tok/s':>11} {label + ' tok/s':>11} {label[:2] + '2/TP1':>8} "
          f"{'collectives ms':>15} {'commands ms':>12}")
    for kind in ("target_only", "speculative"):
        a, b = one[kind], two[kind]
        print(f"{kind:<12} {a['tokens_per_s']:>11.1f} {b['tokens_per_s']:>11.1f} "
              f"{b['tokens_per_s'] / a['tokens_per_s']:>8.2f} {b['collective_ms_per_step']:>15.2f} "
              f"{b['command_ms_per_step']:>12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
