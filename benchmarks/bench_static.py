"""Acceptance and speed of a generated CPU runtime on held-out standard-library code.

Runs the same held-out prompts speculatively and target-only in one process and prints the mean
accepted drafts per request-step, acceptance by draft position, tokens/s of both and their
ratio, and whether the outputs were identical (they must be).

    .venv/bin/python benchmarks/bench_static.py generated/tiny_cpu_static --prompts 32 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark.corpus import held_out_prompts
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package

# `held_out_prompts` lives in dspark.corpus (`dspark bench` uses it without torch);
# bench_modes.py and held_out_prompts.py still import it from here.
__all__ = ["held_out_prompts", "main"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("package", type=Path)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-chars", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    pkg = load_package(args.package)
    runtime = Runtime(pkg)
    prompts = [pkg.tokenizer.encode(p) for p in held_out_prompts(args.prompts, args.prompt_chars)]
    runtime.generate(prompts[:2], 8)  # warm up
    spec_out, spec = runtime.generate(prompts, args.max_new_tokens)
    ref_out, ref = runtime.generate(prompts, args.max_new_tokens, target_only=True)
    s, r = spec.to_json(), ref.to_json()
    result = {
        "deployment": pkg.deployment.name,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "lossless": spec_out == ref_out,
        "mean_accepted_drafts_per_step": s["mean_accepted_drafts"],
        "mean_commit_len": s["mean_commit_len"],
        "acceptance_by_position": s["acceptance_by_position"],
        "speculative_tokens_per_s": s["tokens_per_second"],
        "target_only_tokens_per_s": r["tokens_per_second"],
        "speedup": round(s["tokens_per_second"] / r["tokens_per_second"], 3),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['deployment']}: {len(prompts)} held-out prompts x {args.max_new_tokens} tokens, "
          f"max_running_requests {pkg.deployment.serving.max_running_requests}")
    print(f"  lossless (speculative == target-only): {result['lossless']}")
    print(f"  mean accepted drafts per request-step: {result['mean_accepted_drafts_per_step']:.2f} "
          f"of {pkg.plan.gamma} (mean commit_len {result['mean_commit_len']:.2f})")
    print("  acceptance by position: " + " ".join(f"{a:.2f}" for a in result["acceptance_by_position"]))
    print(f"  tokens/s: speculative {result['speculative_tokens_per_s']:.1f}, target-only "
          f"{result['target_only_tokens_per_s']:.1f}, ratio {result['speedup']:.2f}x")


if __name__ == "__main__":
    main()
