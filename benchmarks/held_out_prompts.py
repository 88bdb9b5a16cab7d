"""Write held-out prompts (standard-library code the embedded model never trained on) as JSON.

Disjoint sets come from different `--phase` values (the benchmarks use phase 40); `--phases`
joins several (about 400 prompts each) and `--exclude` drops prompts already in other sets (the
same text occurs in several held-out files). The calibration figures in docs/results.md use:

    P=".venv/bin/python benchmarks/held_out_prompts.py"
    $P --phases 15,23,31,50,58 -o runs/prompts_fit.json
    $P --phases 2,10 --exclude runs/prompts_fit.json -o runs/prompts_cal2.json
    $P --phases 70,78,86,94 --exclude runs/prompts_fit.json runs/prompts_cal2.json -o runs/prompts_eval2.json
    $P --phases 15,23,31,37,44,50,58,64 --exclude runs/prompts_cal2.json runs/prompts_eval2.json \\
        -o runs/prompts_fit3.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark.corpus import held_out_prompts

ALL = 1 << 30  # more than any phase has


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--count", type=int, default=None, help="prompts to write (default: all)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--phase", type=int, default=None,
                       help="first line (mod 97) of the set; 40 is the benchmarks'")
    group.add_argument("--phases", default=None, help="comma-separated phases, joined in order")
    parser.add_argument("--exclude", type=Path, nargs="*", default=[],
                        help="JSON prompt files whose prompts are left out")
    parser.add_argument("--chars", type=int, default=200)
    parser.add_argument("-o", "--out", type=Path, required=True)
    args = parser.parse_args()
    phases = ([int(p) for p in args.phases.split(",")] if args.phases
              else [args.phase if args.phase is not None else 10])
    excluded: set[str] = set()
    for path in args.exclude:
        excluded |= set(json.loads(path.read_text()))
    prompts: list[str] = []
    seen: set[str] = set()
    for phase in phases:
        for prompt in held_out_prompts(ALL, args.chars, phase):
            if prompt not in excluded and prompt not in seen:
                seen.add(prompt)
                prompts.append(prompt)
    if args.count is not None:
        if len(prompts) < args.count:
            raise SystemExit(f"only {len(prompts)} held-out prompts at phases {phases}")
        prompts = prompts[:args.count]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(prompts, indent=1) + "\n")
    print(f"wrote {len(prompts)} prompts to {args.out}")


if __name__ == "__main__":
    main()
