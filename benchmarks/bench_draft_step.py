"""The draft step of a generated package, its context gathered densely against read in place through the
paged attention (`PagedDraftBlock`), interleaved in one process; prints each path's median step time per
batch size and their ratio, beside the target-only decode step and the verify step of N rows per request.

    .venv/bin/python benchmarks/bench_draft_step.py generated/tiny_cpu_compact --batch-sizes 1,4,32
"""

from __future__ import annotations

import argparse
import statistics

from dspark.measure.step_timer import VerifyStepTimer
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("package")
    parser.add_argument("--batch-sizes", default="1,4,32")
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds; the fastest median is kept")
    parser.add_argument("--repeats", type=int, default=11, help="timed steps per round (median)")
    args = parser.parse_args()
    runtime = Runtime(load_package(args.package))
    timer = VerifyStepTimer(runtime, context_len=args.context_len)
    paged = runtime.models.draft_attn
    n = runtime.plan.num_draft_tokens
    print(f"{args.package}: context {args.context_len}, gamma {runtime.plan.gamma}; ms per step, the "
          f"fastest of {args.rounds} interleaved rounds of {args.repeats}-step medians")
    print(f"{'B':>4} {'dense draft':>12} {'paged draft':>12} {'paged/dense':>12} {'decode':>8} "
          f"{'verify B*N':>11}")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        times: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for name in ("dense", "paged", "decode", "verify"):
                runtime.models.draft_attn = paged if name == "paged" else None
                steps = {"decode": lambda b=b: timer.decode_seconds(b), "verify": lambda b=b: timer(b, b * n)}
                measure = steps.get(name, lambda b=b: timer.draft_seconds(b))
                for _ in range(3):
                    measure()
                times.setdefault(name, []).append(statistics.median(measure() for _ in range(args.repeats)))
        best = {k: min(v) * 1e3 for k, v in times.items()}
        print(f"{b:>4} {best['dense']:>12.3f} {best['paged']:>12.3f} {best['paged'] / best['dense']:>12.3f} "
              f"{best['decode']:>8.3f} {best['verify']:>11.3f}")
    runtime.models.draft_attn = paged


if __name__ == "__main__":
    main()
