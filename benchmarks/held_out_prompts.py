"""Write held-out prompts (standard-library code the embedded model never trained on) as JSON.

Disjoint sets for calibration and evaluation come from different `--phase` values (the
benchmarks use phase 40):

    .venv/bin/python benchmarks/held_out_prompts.py --count 384 --phase 10 -o runs/prompts_cal.json
    .venv/bin/python benchmarks/held_out_prompts.py --count 384 --phase 70 -o runs/prompts_eval.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_static import held_out_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--phase", type=int, default=10,
                        help="first line (mod 97) of the set; 40 is the benchmarks'")
    parser.add_argument("--chars", type=int, default=200)
    parser.add_argument("-o", "--out", type=Path, required=True)
    args = parser.parse_args()
    prompts = held_out_prompts(args.count, args.chars, args.phase)
    if len(prompts) < args.count:
        raise SystemExit(f"only {len(prompts)} held-out prompts at phase {args.phase}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(prompts, indent=1) + "\n")
    print(f"wrote {len(prompts)} prompts to {args.out}")


if __name__ == "__main__":
    main()
