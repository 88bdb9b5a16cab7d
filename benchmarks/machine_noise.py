"""How steady is this machine? Matmuls per wall-clock second on one torch thread, per core.

A benchmark can resolve a difference between two policies only where the machine's own speed holds
still for longer than a measured point. This counts 256 x 256 fp32 matmuls in one-second windows on
each core at once (one process pinned to each CPU the process may use), with the CPU time each window
got: CPU time equal to wall time while the count moves means the cycles themselves slowed (frequency, a
busy sibling hyperthread on a shared host), which nothing inside the machine can see or undo.

    .venv/bin/python benchmarks/machine_noise.py --seconds 25
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time


def _windows(cpu: int, start: float, seconds: int, out: mp.Queue) -> None:
    import torch  # in the child: each process pins itself first

    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    while time.time() < start:  # every core starts the same second
        time.sleep(0.001)
    counts, cpu_share = [], []
    for _ in range(seconds):
        wall, used, n = time.perf_counter(), time.process_time(), 0
        while time.perf_counter() - wall < 1.0:
            for _ in range(25):
                a @ b
            n += 25
        counts.append(n)
        cpu_share.append((time.process_time() - used) / (time.perf_counter() - wall))
    out.put((cpu, counts, min(cpu_share)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=25, help="one-second windows per core (default 25)")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    out: mp.Queue = mp.get_context("spawn").Queue()
    start = time.time() + 5.0  # time for every child to import torch
    procs = [mp.get_context("spawn").Process(target=_windows, args=(cpu, start, args.seconds, out))
             for cpu in cpus]
    for p in procs:
        p.start()
    results = sorted(out.get() for _ in procs)
    for p in procs:
        p.join()
    for cpu, counts, share in results:
        print(f"cpu {cpu}: matmuls per second {counts}")
        print(f"        max/min {max(counts) / min(counts):.2f}, lowest CPU time / wall time in a window "
              f"{share:.3f}")


if __name__ == "__main__":
    main()
