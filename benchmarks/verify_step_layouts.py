"""What a compact verify step costs by its layout, not only by its row count.

The cost table prices a step of B requests by its rows M (`theta(M)`, profiled with the rows spread
evenly). The planner's steps are ragged: some requests verify every draft, some few. This times, round
after round in one process (the order rotated each round, so a drifting machine slows all alike), one
verify step for each given layout of per-request verify lengths, and prints each median beside the
evenly spread step of the same M and the table's price for it:

    .venv/bin/python benchmarks/verify_step_layouts.py generated/tiny_cpu_compact --context-len 150 \\
        --layout 16x8 --layout 16x6 --layout 16x5 --layout 8x8+8x4 --layout 12x8+4x3

A layout is `COUNTxROWS` terms joined by `+` (16x8: sixteen requests of 8 rows). On the CPU backend a
request's attention is paid in tiles of PAIR_TILE (row, query head) pairs and a step runs one attention
call per tile class (`dspark.runtime.attention.metadata.block_class`), so layouts of equal M can differ.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from dspark.measure.step_timer import ProfileError, VerifyStepTimer, spread_rows
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package


def parse_layout(text: str) -> tuple[int, ...]:
    """`8x8+8x4` -> (8,) * 8 + (4,) * 8."""
    lens: list[int] = []
    try:
        for term in text.split("+"):
            count, rows = (int(part) for part in term.split("x"))
            if count < 1 or rows < 1:
                raise ValueError
            lens += [rows] * count
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layout is COUNTxROWS terms joined by +, e.g. 8x8+8x4; got "
                                         f"{text!r}") from None
    return tuple(lens)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("package", type=Path, help="a compact generated package")
    p.add_argument("--layout", type=parse_layout, action="append", required=True,
                   help="per-request verify lengths, COUNTxROWS terms joined by + (repeatable)")
    p.add_argument("--context-len", type=int, default=128, help="cached tokens per request (default: 128)")
    p.add_argument("--repeats", type=int, default=15, help="timed rounds (default: 15)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each first (default: 2)")
    args = p.parse_args(argv)
    runtime = Runtime(load_package(args.package))
    table = runtime.plan.table if runtime.deployment.verify_mode.packs_rows else None
    try:
        if table is None:
            raise ProfileError(f"{args.package}: a compact build with a cost table is needed")
        timer = VerifyStepTimer(runtime, args.context_len)
        timer.batch_sizes(sorted({len(lens) for lens in args.layout}))
        steps: dict[str, tuple[int, ...]] = {}
        even_of: dict[str, str] = {}  # each layout's even spread of the same rows (itself when even)
        for lens in args.layout:
            even = tuple(spread_rows(sum(lens), len(lens), timer.floor, timer.cap))
            steps[layout_name(lens)] = lens
            steps.setdefault(layout_name(even), even)
            even_of[layout_name(lens)] = even_of[layout_name(even)] = layout_name(even)
        seconds: dict[str, list[float]] = {name: [] for name in steps}
        with torch.inference_mode():
            for lens in steps.values():
                for _ in range(args.warmup):
                    timer.time_lens(lens)
            order = list(steps)
            for round_ in range(args.repeats):
                shift = round_ % len(order)
                for name in order[shift:] + order[:shift]:
                    seconds[name].append(timer.time_lens(steps[name]))
    except ProfileError as err:
        print(f"verify_step_layouts: error: {err}", file=sys.stderr)
        return 2
    print(f"{runtime.deployment.name}: {runtime.device}, context {args.context_len}, median of "
          f"{args.repeats} interleaved rounds; table = the cost table's verify price of the same B and M "
          "(theta + alpha + bias, no draft)")
    print(f"{'layout':<24}{'B':>4}{'M':>6}{'ms':>9}{'even ms':>9}{'/ even':>8}{'table ms':>10}")
    for name, lens in steps.items():
        ms, even_ms = statistics.median(seconds[name]) * 1e3, statistics.median(seconds[even_of[name]]) * 1e3
        price = table.step_time(len(lens), sum(lens)) * 1e3
        print(f"{name:<24}{len(lens):>4}{sum(lens):>6}{ms:>9.2f}{even_ms:>9.2f}{ms / even_ms:>8.3f}"
              f"{price:>10.2f}")
    return 0


def layout_name(lens: Sequence[int]) -> str:
    """(8, 8, 4) -> '2x8+1x4' (terms by rows, most rows first)."""
    counts: dict[int, int] = {}
    for rows in lens:
        counts[rows] = counts.get(rows, 0) + 1
    return "+".join(f"{counts[rows]}x{rows}" for rows in sorted(counts, reverse=True))


if __name__ == "__main__":
    sys.exit(main())
