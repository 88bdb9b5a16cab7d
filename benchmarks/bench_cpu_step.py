"""The embedded pair's CPU decode step at HEAD against another commit's, measured in one run.

For every batch size B this decodes B held-out prompts (`--max-new-tokens` each) with the compact
build, speculatively and target-only, and reports the mean decode step (ms: draft, plan, verify and
accept for speculative; one target row per request for target-only). Each commit runs in its own
process (a git worktree for the baseline), round after round alternately, so a busy machine slows
both alike. A process decodes each point `--repeats` times and keeps its fastest (another tenant
only ever adds time); the medians over rounds are printed, with the median of each round's ratio
(HEAD's round against the baseline's round run right after it).

    .venv/bin/python benchmarks/bench_cpu_step.py --baseline e799e25 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(package: str, batch_sizes: list[int], max_new_tokens: int, repeats: int) -> None:
    """Print `{B: {"speculative": ms, "target_only": ms}}` for the tree this process imports from."""
    import torch

    from dspark.corpus import held_out_text
    from dspark.runtime.engine.runtime import Runtime
    from dspark.runtime.package import load_package

    torch.manual_seed(0)
    pkg = load_package(Path(package))
    runtime = Runtime(pkg)
    text = "".join(held_out_text(200_000))
    results: dict[int, dict[str, float]] = {}
    for b in batch_sizes:
        prompts = [pkg.tokenizer.encode(text[401 * i:401 * i + 48]) for i in range(b)]
        point = {}
        for name, target_only in (("speculative", False), ("target_only", True)):
            runtime.generate(prompts, 8, target_only=target_only)  # warm up
            runs = [runtime.generate(prompts, max_new_tokens, target_only=target_only)[1]
                    for _ in range(repeats)]
            stats = min(runs, key=lambda s: s.decode_seconds / s.steps)
            point[name] = 1e3 * stats.decode_seconds / stats.steps
            point[f"{name}_tok_s"] = stats.generated_tokens / stats.decode_seconds
        results[b] = point
    print(json.dumps(results))


def run_tree(tree: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_cpu_step.py"), "--worker",
           "--package", str(tree / "generated" / args.package), "--batch-sizes", args.batch_sizes,
           "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{tree}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="e799e25", help="commit to compare HEAD's working tree with")
    ap.add_argument("--package", default="tiny_cpu_compact", help="a generated/ package both trees have")
    ap.add_argument("--batch-sizes", default="1,4,32")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3,
                    help="decodes of each point per process (the fastest is kept)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.worker:
        worker(args.package, sizes, args.max_new_tokens, args.repeats)
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), args.baseline],
                       check=True, capture_output=True)
        try:
            rounds: dict[str, list] = {"head": [], "baseline": []}
            for _ in range(args.rounds):
                rounds["head"].append(run_tree(REPO, args))
                rounds["baseline"].append(run_tree(base, args))
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
    print(f"{args.package}: mean decode step (ms), fastest of {args.repeats} per process, medians of "
          f"{args.rounds} interleaved rounds, {args.max_new_tokens} tokens per request; "
          f"baseline {args.baseline}")
    print("| B | mode | baseline ms | HEAD ms | HEAD / baseline | median round ratio (min-max) | HEAD tok/s "
          "| spec / target-only (HEAD) |")
    print("|---|---|---|---|---|---|---|---|")
    for b in sizes:
        for mode in ("speculative", "target_only"):
            med = {k: statistics.median(r[str(b)][mode] for r in v) for k, v in rounds.items()}
            paired = [h[str(b)][mode] / base[str(b)][mode]
                      for h, base in zip(rounds["head"], rounds["baseline"], strict=True)]
            tok = statistics.median(r[str(b)][f"{mode}_tok_s"] for r in rounds["head"])
            speed = statistics.median(r[str(b)]["speculative_tok_s"] / r[str(b)]["target_only_tok_s"]
                                      for r in rounds["head"])
            print(f"| {b} | {mode} | {med['baseline']:.2f} | {med['head']:.2f} | "
                  f"{med['head'] / med['baseline']:.2f} | {statistics.median(paired):.2f} "
                  f"({min(paired):.2f}-{max(paired):.2f}) | {tok:.0f} | {speed:.2f} |")


if __name__ == "__main__":
    main()
