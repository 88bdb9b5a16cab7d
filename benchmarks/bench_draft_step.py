"""The draft step of a generated package, its context gathered densely against read in place through the
paged attention (`PagedDraftBlock`), and where the package captures the draft step (CUDA graphs) its graph
replay, interleaved in one process; prints each path's median step time per batch size and the paged
path's ratio to the dense one, beside the target-only decode step and the verify step of N rows per request.

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
    models = runtime.models
    paged, graphs = models.draft_attn, models.draft_graphs
    n = runtime.plan.num_draft_tokens
    paths = ("dense", "paged") + (("graph",) if graphs is not None else ())
    print(f"{args.package}: context {args.context_len}, gamma {runtime.plan.gamma}; ms per step, the "
          f"fastest of {args.rounds} interleaved rounds of {args.repeats}-step medians")
    print(" ".join([f"{'B':>4}", *(f"{p + ' draft':>12}" for p in paths), f"{'paged/dense':>12}",
                    f"{'decode':>8}", f"{'verify B*N':>11}"]))
    for b in (int(x) for x in args.batch_sizes.split(",")):
        times: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for name in (*paths, "decode", "verify"):
                models.draft_attn = None if name == "dense" else paged
                models.draft_graphs = graphs if name == "graph" else None
                steps = {"decode": lambda b=b: timer.decode_seconds(b), "verify": lambda b=b: timer(b, b * n)}
                measure = steps.get(name, lambda b=b: timer.draft_seconds(b))
                for _ in range(3):
                    measure()
                times.setdefault(name, []).append(statistics.median(measure() for _ in range(args.repeats)))
        best = {k: min(v) * 1e3 for k, v in times.items()}
        print(" ".join([f"{b:>4}", *(f"{best[p]:>12.3f}" for p in paths),
                        f"{best['paged'] / best['dense']:>12.3f}", f"{best['decode']:>8.3f}",
                        f"{best['verify']:>11.3f}"]))
    models.draft_attn, models.draft_graphs = paged, graphs


if __name__ == "__main__":
    main()
