"""What each decode step of a closed batch cost, by its shape, for two or more builds of one deployment.

Every build decodes the same held-out prompts with a step recorder on, the builds alternating over
`--rounds` (the order reversed every other round, each timed run after a short untimed one of its
own); the recorded steps are grouped by (requests, planned rows) and each group's median
`step_seconds` is printed beside its count. Where `bench_modes.py` says one build is slower than
another, this says at which step shapes: a compact step of fewer rows that costs more than static's
full step points at the verify path, not at the planner's choice of rows.

    .venv/bin/python benchmarks/step_seconds_by_shape.py generated/tiny_cpu_static \\
        generated/tiny_cpu_compact --prompts 32 --max-new-tokens 128 --rounds 6
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

from bench_static import held_out_prompts

from dspark.measure.recording import RunRecorder
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("packages", type=Path, nargs="+", help="generated packages of one deployment")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-chars", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()

    packages = [load_package(p) for p in args.packages]
    prompts = [packages[0].tokenizer.encode(p) for p in held_out_prompts(args.prompts, args.prompt_chars)]
    seconds: list[dict[tuple[int, int], list[float]]] = [defaultdict(list) for _ in packages]
    totals: list[list[float]] = [[] for _ in packages]
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            order = list(range(len(packages)))
            for i in order if round_ % 2 == 0 else order[::-1]:
                pkg = packages[i]
                recorder = RunRecorder(Path(scratch) / f"{round_}_{i}", pkg.plan.gamma, "greedy",
                                       record_steps=10**7, shard_size=10**7)
                runtime = Runtime(pkg, recorder=recorder)
                runtime.generate(prompts[:2], 8)  # untimed: the same runtime's buffers, warmed
                warm = len(list(recorder.steps.records))
                runtime.generate(prompts, args.max_new_tokens)
                steps = list(recorder.steps.records)[warm:]
                for step in steps:
                    seconds[i][(step.num_reqs, step.planned_rows)].append(step.step_seconds)
                totals[i].append(sum(step.step_seconds for step in steps))
    print(f"{len(prompts)} held-out prompts x {args.max_new_tokens} tokens, {args.rounds} alternating "
          "rounds; median step_seconds (ms) by (requests, planned rows), [steps recorded]")
    shapes = sorted({shape for per in seconds for shape in per})
    names = [pkg.deployment.name for pkg in packages]
    print(f"{'B':>4} {'rows':>5} " + " ".join(f"{name:>26}" for name in names))
    for shape in shapes:
        cells = [f"{statistics.median(per[shape]) * 1e3:>19.1f} [{len(per[shape]):>4}]" if shape in per
                 else f"{'-':>26}" for per in seconds]
        print(f"{shape[0]:>4} {shape[1]:>5} " + " ".join(cells))
    print(f"{'run total':>10} " + " ".join(
        f"{statistics.median(t) * 1e3:>19.1f} ms    " for t in totals))
    counts = [sum(len(v) for v in per.values()) / args.rounds for per in seconds]
    print("steps per run: " + ", ".join(f"{name} {n:g}" for name, n in zip(names, counts, strict=True)))


if __name__ == "__main__":
    main()
