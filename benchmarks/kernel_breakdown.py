"""Where one verify step's time goes: the step's wall time, its device-busy time and its costliest
operators, beside the plain-torch reference forward of the same rows.

When a build's step is slower than the reference (benchmarks/bench_verify_step.py says by how
much), this says whether the gap is on the host (wall minus busy: planning, buffer copies, launch
gaps) or in which kernels. Each point (B requests, M rows) is warmed up, then `--steps` steps run
under torch.profiler; operators are ranked by their self time on the device (on the CPU: by their
self CPU time), summed over the steps and divided by `--steps`.

    python benchmarks/kernel_breakdown.py PACKAGE --points 1:8,128:128 --reference
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dspark.measure.step_timer import ProfileError, VerifyStepTimer
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_forward import DenseCache, cuda_graph, package_model, synchronize, verify_step  # noqa: E402


def points(text: str) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(int(v) for v in item.split(":")) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected B:M pairs such as 1:8,128:128, got {text!r}") from None
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected B:M pairs of positive integers, got {text!r}")
    return [(b, m) for b, m in pairs]


def breakdown(label: str, step: Callable[[], object], device: torch.device, steps: int, top: int) -> str:
    """Wall and device-busy ms per step and the `top` operators by self device time."""
    for _ in range(3):
        step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    on_device = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    stats = prof.key_averages()

    def self_us(e: object) -> float:
        return e.self_device_time_total if on_device else e.self_cpu_time_total

    ranked = sorted((e for e in stats if self_us(e) > 0), key=self_us, reverse=True)
    busy_ms = sum(self_us(e) for e in ranked) / steps / 1e3
    what = "device busy" if on_device else "CPU self time"
    lines = [f"== {label}: wall {wall_ms:.3f} ms per step (unprofiled), {what} {busy_ms:.3f} ms"]
    for e in ranked[:top]:
        share = self_us(e) / steps / 1e3 / busy_ms if busy_ms else 0.0
        calls = e.count / steps
        lines.append(f"  {self_us(e) / steps:10.1f} us {share:6.1%} {calls:7.1f} calls  {e.key[:110]}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("package", type=Path, help="a generated package (static or compact)")
    p.add_argument("--points", type=points, default=[(1, 8)], metavar="B:M,...",
                   help="batch size and verify rows of each step (default: 1:8)")
    p.add_argument("--context-len", type=int, default=128, help="cached tokens per request (default: 128)")
    p.add_argument("--steps", type=int, default=5, help="profiled steps per point (default: 5)")
    p.add_argument("--top", type=int, default=12, help="operators listed per point (default: 12)")
    p.add_argument("--reference", action="store_true",
                   help="also the reference forward at M/B rows per request (where whole)")
    args = p.parse_args(argv)
    try:
        runtime = Runtime(load_package(args.package))
        timer = VerifyStepTimer(runtime, args.context_len)
        timer.batch_sizes([b for b, _ in args.points])
    except (ProfileError, ValueError) as exc:
        print(f"kernel_breakdown: error: {exc}", file=sys.stderr)
        return 2
    device = runtime.device
    model = None
    if args.reference:
        model = package_model(args.package, runtime.target.lm_head.weight.dtype, device)[0]
    n = runtime.plan.num_draft_tokens
    with torch.inference_mode():
        for b, m in args.points:
            print(breakdown(f"{runtime.deployment.name} B={b} M={m}", functools.partial(timer, b, m), device,
                            args.steps, args.top), flush=True)
            if model is None or m % b:
                continue
            dtype = model.lm_head.weight.dtype
            cache = DenseCache.allocate(model.cfg, b, args.context_len + n, dtype, device)
            ids = torch.randint(model.cfg.vocab_size, (b, m // b), device=device)
            run: Callable[[], object] = functools.partial(verify_step, model, ids, cache, args.context_len)
            if device.type == "cuda":
                run = cuda_graph(run, 2)[0]
            print(breakdown(f"reference B={b} R={m // b}", run, device, args.steps, args.top), flush=True)
            del cache, run
    return 0


if __name__ == "__main__":
    sys.exit(main())
