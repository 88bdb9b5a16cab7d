"""Static, compact and the plain-torch reference, one verify step each, interleaved in one run.

Does verify cost follow rows? For every batch size B this times, round after round in one process
(so a busy machine slows all three alike):

- the static build's step: B requests x N rows;
- the compact build's step of M rows for each `--fractions` f (M = f·B·N, at least B·floor);
- with `--reference`, the plain-torch forward of the same model (benchmarks/reference_forward.py:
  dense per-request KV cache, SDPA, CUDA graphs on a GPU) at R = M/B rows per request, where M/B is
  whole, and at N rows;
- with `--anchor PACKAGE`, a second compact build of the same deployment (the same spec with
  `backend.attention: flashinfer`, say) at the same M: the compact build's kernel against it.

It prints the medians and the ratios the fast-verify targets name: compact over static at the same
B, compact over the reference at the same rows, static over the reference at B·N.

    .venv/bin/python benchmarks/bench_verify_step.py generated/llama_50m_cpu_static \\
        generated/llama_50m_cpu_compact --batch-sizes 1,8,32 --reference

The two packages must be two builds of one deployment (same model geometry, gamma and page size);
with dummy weights the reference builds the same seeded weights.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark.measure.step_timer import ProfileError, VerifyStepTimer
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_forward import (  # noqa: E402  (a sibling script, not a package)
    DenseCache,
    cuda_graph,
    package_model,
    positive_ints,
    time_steps,
    verify_step,
)


class BenchError(ValueError):
    """Two packages that cannot be compared, or a point they cannot run (says what to change)."""


@dataclass(frozen=True)
class Point:
    """One batch size and row count: the medians of the steps timed there (None: not measured)."""

    num_reqs: int
    rows: int
    static_ms: float  # the static step of this B (always B·N rows)
    compact_ms: float
    reference_ms: float | None  # the reference at `rows` rows (when rows / B is whole)
    reference_full_ms: float | None  # the reference at B·N rows
    anchor_ms: float | None = None  # the anchor build's compact step at `rows` rows

    def to_json(self) -> dict[str, Any]:
        def over(a: float, b: float | None) -> float | None:
            return None if b is None else a / b
        return {"num_reqs": self.num_reqs, "rows": self.rows, "static_ms": self.static_ms,
                "compact_ms": self.compact_ms, "reference_ms": self.reference_ms,
                "reference_full_ms": self.reference_full_ms,
                "compact_over_static": self.compact_ms / self.static_ms,
                "compact_over_reference": over(self.compact_ms, self.reference_ms),
                "static_over_reference": over(self.static_ms, self.reference_full_ms),
                "anchor_ms": self.anchor_ms, "compact_over_anchor": over(self.compact_ms, self.anchor_ms)}


def check_comparable(static: Runtime, compact: Runtime) -> None:
    s, c = static.deployment, compact.deployment
    if s.verify_mode.packs_rows or not c.verify_mode.packs_rows:
        raise BenchError(f"expected a static (or cap-accept) build then a compact one, got {s.name} "
                         f"({s.verify_mode}) and {c.name} ({c.verify_mode})")
    for what, a, b in (("model geometry", s.model.geometry, c.model.geometry),
                       ("gamma", s.draft.gamma, c.draft.gamma),
                       ("page size", s.serving.page_size, c.serving.page_size),
                       ("backend", static.device.type, compact.device.type)):
        if a != b:
            raise BenchError(f"{s.name} and {c.name} differ in {what} ({a} vs {b}): not one deployment")


def row_counts(num_reqs: int, timer: VerifyStepTimer, fractions: Sequence[float], n: int) -> list[int]:
    """The compact step's row counts at B: each fraction of B·N, within what a step can run."""
    low, high = num_reqs * timer.floor, num_reqs * timer.cap
    return sorted({min(high, max(low, round(f * num_reqs * n))) for f in fractions})


def step_timers(runtimes: Sequence[Runtime], batch_sizes: Sequence[int],
                context_len: int) -> list[VerifyStepTimer]:
    """Each build's step timer; refuses batch sizes any cannot hold, saying what to change."""
    timers = [VerifyStepTimer(rt, context_len) for rt in runtimes]
    for timer in timers:
        timer.batch_sizes(batch_sizes)
    return timers


def one_step(run: Callable[[], Any], device: torch.device) -> float:
    return time_steps(run, device, warmup=0, repeats=1)[0]


def measure(st: VerifyStepTimer, ct: VerifyStepTimer, batch_sizes: Sequence[int], fractions: Sequence[float],
            repeats: int, warmup: int, reference: bool, progress: Callable[[str], None] | None = None,
            anchor: VerifyStepTimer | None = None) -> list[Point]:
    static, context_len = st.runtime, st.context_len
    n = static.plan.num_draft_tokens
    device = static.device
    model = None
    if reference:
        dtype = static.target.lm_head.weight.dtype
        model = package_model(static.package.directory, dtype, device)[0]
    points = []
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for b in batch_sizes:
            rows = row_counts(b, ct, fractions, n)
            steps: dict[tuple[str, int], Callable[[], float]] = {}
            steps["static", b * n] = functools.partial(st, b, b * n)
            steps.update({("compact", m): functools.partial(ct, b, m) for m in rows})
            if anchor is not None:
                steps.update({("anchor", m): functools.partial(anchor, b, m) for m in rows})
            cache = None
            if model is not None:
                cache = DenseCache.allocate(model.cfg, b, context_len + n, dtype, device,
                                            torch.Generator(device=device).manual_seed(0))
                for r in sorted({m // b for m in rows if m % b == 0} | {n}):
                    ids = torch.randint(model.cfg.vocab_size, (b, r), generator=generator).to(device)
                    run: Callable[[], Any] = functools.partial(verify_step, model, ids, cache, context_len)
                    if device.type == "cuda":
                        run = cuda_graph(run, warmup)[0]
                    steps["reference", b * r] = functools.partial(one_step, run, device)
            for step in steps.values():
                for _ in range(warmup):
                    step()
            seconds: dict[tuple[str, int], list[float]] = {key: [] for key in steps}
            order = list(steps)
            for round_ in range(repeats):
                # One of each per round, each round starting one further along: a step right after
                # another model's step finds colder caches, and every kind takes that place in turn.
                shift = round_ % len(order)
                for key in order[shift:] + order[:shift]:
                    seconds[key].append(steps[key]())
            ms = {key: statistics.median(v) * 1e3 for key, v in seconds.items()}
            for m in rows:
                points.append(Point(b, m, ms["static", b * n], ms["compact", m], ms.get(("reference", m)),
                                    ms.get(("reference", b * n)), ms.get(("anchor", m))))
                if progress is not None:
                    progress(format_point(points[-1], anchor is not None))
            del steps, cache
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return points


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.3f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


HEADER = ("B", "M", "static B·N ms", "compact ms", "compact/static", "reference ms", "compact/ref",
          "static/ref B·N")
ANCHOR_HEADER = ("anchor ms", "compact/anchor")


def format_point(p: Point, anchor: bool = False) -> str:
    cells = (p.num_reqs, p.rows, _ms(p.static_ms), _ms(p.compact_ms), _ratio(p.compact_ms, p.static_ms),
             _ms(p.reference_ms), _ratio(p.compact_ms, p.reference_ms),
             _ratio(p.static_ms, p.reference_full_ms))
    if anchor:
        cells += (_ms(p.anchor_ms), _ratio(p.compact_ms, p.anchor_ms))
    return "".join(f"{c:>16}" for c in cells)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("static", type=Path, help="a static (or cap-accept) generated package")
    p.add_argument("compact", type=Path, help="a compact generated package of the same deployment")
    p.add_argument("--batch-sizes", type=positive_ints, default=[1, 8, 32], metavar="B1,B2,...")
    p.add_argument("--fractions", default="0.25,0.5,1", metavar="F1,F2,...",
                   help="compact rows as fractions of B·N (default: 0.25,0.5,1)")
    p.add_argument("--context-len", type=int, default=128, help="cached tokens per request (default: 128)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds (default: 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each kind first (default: 2)")
    p.add_argument("--reference", action="store_true", help="also time the plain-torch reference forward")
    p.add_argument("--anchor", type=Path, default=None, metavar="PACKAGE",
                   help="also time this compact build of the same deployment (another attention backend)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead")
    args = p.parse_args(argv)
    try:
        args.fractions = sorted({float(x) for x in args.fractions.split(",") if x.strip()})
    except ValueError:
        p.error(f"--fractions: expected comma-separated numbers, got {args.fractions!r}")
    if not args.fractions or not all(0 < f <= 1 for f in args.fractions):
        p.error("--fractions: each must be in (0, 1]")
    if args.context_len < 1 or args.repeats < 1 or args.warmup < 0:
        p.error("--context-len and --repeats must be positive, --warmup 0 or more")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        packages = [args.static, args.compact] + ([args.anchor] if args.anchor else [])
        runtimes = [Runtime(load_package(d)) for d in packages]
        static, compact = runtimes[:2]
        for other in runtimes[1:]:
            check_comparable(static, other)
        st, ct, *at = step_timers(runtimes, args.batch_sizes, args.context_len)
        anchor = f" (anchor {runtimes[2].deployment.name})" if at else ""
        print(f"{static.deployment.name} vs {compact.deployment.name}{anchor}: {static.device.type}, context "
              f"{args.context_len}, median of {args.repeats} interleaved rounds", file=sys.stderr)
        if not args.json:
            print("".join(f"{h:>16}" for h in HEADER + (ANCHOR_HEADER if at else ())))
        report = None if args.json else print
        points = measure(st, ct, args.batch_sizes, args.fractions, args.repeats, args.warmup, args.reference,
                         report, at[0] if at else None)
    except (BenchError, ProfileError, ValueError) as exc:
        print(f"bench_verify_step: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"static": str(args.static), "compact": str(args.compact),
                          "anchor": str(args.anchor) if args.anchor else None,
                          "context_len": args.context_len, "repeats": args.repeats,
                          "device": static.device.type, "cpu_threads": torch.get_num_threads(),
                          "points": [p.to_json() for p in points]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
