"""static vs cap-accept vs compact (and any other builds of one deployment) on the same load.

Every package runs the same held-out prompts in one process, and so does target-only decoding
(the first package's runtime with speculation off); the runs are interleaved over `--rounds`, the
order rotated every round, so that drift of a shared machine hits every run alike, and each tokens/s
is the median over rounds.
Prints, per package: tokens/s (wall, prefill included) and its ratio to the first package, decode
tokens/s (`generated_tokens / decode_seconds`, as `dspark run --json` reports it) and its ratio to
target-only, mean commit_len, verify rows run per request-step (padding rows separately), the
planner's predicted tau against the committed tokens of the same steps, and whether the output
equals target-only greedy decoding (it must).

    .venv/bin/python benchmarks/bench_modes.py generated/tiny_cpu_static generated/tiny_cpu_cap_accept \\
        generated/tiny_cpu_compact --prompts 32 --max-new-tokens 128

`--fixed-k 4,8` adds the last package run with every request verifying exactly k rows per step (as
`dspark serve --fixed-verify-len k`), one runtime per k, to compare adaptive with every fixed length in
the same interleaved rounds; "paired" then reads against the first of them.
Online calibration's price is `online_calibration_price.py`'s (its steps against steps without it, on one
runtime: two runtimes of one build differ by more than that price on a small machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from bench_static import held_out_prompts

from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.engine.stats import RunStats
from dspark.runtime.package import load_package


def decode_rate(run: RunStats) -> float:
    """Decode tokens/s as `dspark run --json` reports it: generated tokens over decode seconds."""
    return run.generated_tokens / max(run.decode_seconds, 1e-9)


def summarize(name: str, mode: str, runs: list[RunStats], lossless: bool) -> dict[str, Any]:
    last = runs[-1].to_json()
    steps = runs[-1].request_steps or 1
    tau = last["mean_predicted_tau_per_step"]
    committed = last["mean_committed_per_planned_step"]
    return {
        "package": name,
        "mode": mode,
        "tokens_per_s": statistics.median(r.to_json()["tokens_per_second"] for r in runs),
        "decode_tokens_per_s": round(statistics.median(decode_rate(r) for r in runs), 2),
        "mean_commit_len": last["mean_commit_len"],
        "rows_per_request_step": round(runs[-1].verify_rows / steps, 3),
        "padding_rows_per_request_step": round(runs[-1].padding_rows / steps, 3),
        "planned_rows_per_request_step": round(runs[-1].planned_rows / steps, 3),
        "predicted_tau_per_step": tau,
        "committed_per_step": committed,
        "lossless": lossless,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("packages", type=Path, nargs="+",
                        help="generated packages; the first is the baseline")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-chars", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fixed-k", default=None, metavar="K1,K2,...",
                        help="also the last package at each fixed verify length k, listed first")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    fixed = [] if args.fixed_k is None else [int(k) for k in args.fixed_k.split(",")]
    last = load_package(args.packages[-1])
    runtimes = [*(Runtime(last, fixed_verify_len=k) for k in fixed),
                *(Runtime(load_package(p)) for p in args.packages)]
    names = [*(f"fixed-{k}" for k in fixed), *(rt.deployment.name for rt in runtimes[len(fixed):])]
    tokenizer = runtimes[0].package.tokenizer
    prompts = [tokenizer.encode(p) for p in held_out_prompts(args.prompts, args.prompt_chars)]
    reference, _ = runtimes[0].generate(prompts, args.max_new_tokens, target_only=True)
    for rt in runtimes:
        rt.generate(prompts[:2], 8)  # warm up (first graph replays, allocator growth)
    stats: list[list[RunStats]] = [[] for _ in runtimes]
    target_only: list[RunStats] = []
    lossless = [True] * len(runtimes)
    warm = prompts[:2]
    for round_ in range(args.rounds):
        # Each round starts one run later in the order (target-only counted), and every timed run follows
        # a short untimed run of its own: a run right after another runtime's (its weights, caches and
        # buffers elsewhere in memory) measured 10-15 % slower on a 2-core machine than one right after
        # its own, which with a fixed order favoured the first package (target-only runs on its runtime).
        runs = [-1, *range(len(runtimes))]
        for i in runs[round_ % len(runs):] + runs[:round_ % len(runs)]:
            if i < 0:
                runtimes[0].generate(warm, 8, target_only=True)
                target_only.append(runtimes[0].generate(prompts, args.max_new_tokens, target_only=True)[1])
                continue
            runtimes[i].generate(warm, 8)
            out, run = runtimes[i].generate(prompts, args.max_new_tokens)
            stats[i].append(run)
            lossless[i] &= out == reference
    rows = [summarize(name, rt.deployment.verify_mode, s, ok)
            for name, rt, s, ok in zip(names, runtimes, stats, lossless, strict=True)]
    base = rows[0]["tokens_per_s"]
    reference_decode = round(statistics.median(decode_rate(r) for r in target_only), 2)
    for row in rows:
        row["ratio_to_first"] = round(row["tokens_per_s"] / base, 3)
        row["decode_ratio_to_target_only"] = round(row["decode_tokens_per_s"] / reference_decode, 3)
    for row, runs_of in zip(rows, stats, strict=True):
        # Paired: each round's decode tokens/s over the first package's in the same round, the median.
        row["paired_decode_ratio_to_first"] = round(statistics.median(
            decode_rate(r) / decode_rate(f) for r, f in zip(runs_of, stats[0], strict=True)), 3)
    if args.json:
        print(json.dumps({"prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                          "target_only_decode_tokens_per_s": reference_decode,
                          "max_running_requests": runtimes[0].deployment.serving.max_running_requests,
                          "results": rows}, indent=2))
        return
    print(f"{len(prompts)} held-out prompts x {args.max_new_tokens} tokens, median of {args.rounds} "
          f"interleaved rounds, device {runtimes[0].device}; target-only decode {reference_decode:.1f} tok/s")
    head = (f"{'package':<28} {'mode':<10} {'tok/s':>8} {'ratio':>6} {'decode':>8} {'vs t-o':>6} "
            f"{'paired':>6} {'commit':>7} {'rows':>6} {'pad':>5} {'tau':>7} {'actual':>7} lossless")
    print(head)
    for r in rows:
        tau = "-" if r["predicted_tau_per_step"] is None else f"{r['predicted_tau_per_step']:.2f}"
        act = "-" if r["committed_per_step"] is None else f"{r['committed_per_step']:.2f}"
        print(f"{r['package']:<28} {r['mode']:<10} {r['tokens_per_s']:>8.1f} {r['ratio_to_first']:>6.2f} "
              f"{r['decode_tokens_per_s']:>8.1f} {r['decode_ratio_to_target_only']:>6.2f} "
              f"{r['paired_decode_ratio_to_first']:>6.3f} "
              f"{r['mean_commit_len']:>7.2f} {r['rows_per_request_step']:>6.2f} "
              f"{r['padding_rows_per_request_step']:>5.2f} {tau:>7} {act:>7} {r['lossless']}")
    print("decode = generated tokens / decode seconds; vs t-o = its ratio to target-only decoding; paired = "
          "median over rounds of decode tokens/s over the first package's in the same round")
    print("rows = verify rows run per request-step (compact: planned rows only); pad = tier padding "
          "rows per request-step; tau / actual = predicted vs committed tokens per step (B summed)")


if __name__ == "__main__":
    main()
