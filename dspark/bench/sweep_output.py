"""The output of `dspark bench --sweep` (`dspark.bench.sweep` runs it, `dspark.bench.sweep_data` holds its
results): one table of every policy at every load with adaptive's ratio to the best baseline, `sweep.json`
with every point and request, and `sweep.png` of tokens/s against the load."""

from __future__ import annotations

import json
from pathlib import Path

from dspark.atomic import atomic_write, atomic_write_text
from dspark.bench.sweep_data import INTERVAL_LEVEL, MIN_REQUESTS_PER_SLOT, TWIN, Load, SweepPoint, SweepResult

DPI = 110
SUBCOLUMNS = (("tok/s", 7), ("TPOT50", 6), ("TPOT99", 6), ("TTFT50", 7), ("tok/st", 6))
GROUP_WIDTH = sum(w for _, w in SUBCOLUMNS) + len(SUBCOLUMNS) - 1
LOAD_WIDTH = 11
RATIO_HEADER = ("adaptive /", "best base")
TWIN_HEADER = ("twin /", "best base")


def _policy_title(policy: str) -> str:
    return f"fixed k={policy.removeprefix('fixed-')}" if policy.startswith("fixed-") else policy


def _cells(point: SweepPoint | None) -> str:
    if point is None:
        return " ".join(f"{'-':>{w}}" for _, w in SUBCOLUMNS)
    r = point.result

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}" if value >= 100 else f"{value:.2f}"

    values = (f"{r.output_throughput:.1f}", ms(r.tpot.p50_ms if r.tpot else None),
              ms(r.tpot.p99_ms if r.tpot else None), ms(r.ttft.p50_ms if r.ttft else None),
              "-" if point.tokens_per_step is None else f"{point.tokens_per_step:.2f}")
    return " ".join(f"{v:>{w}}" for v, (_, w) in zip(values, SUBCOLUMNS, strict=True))


def _ratio(result: SweepResult, load: Load, policy: str) -> str:
    ratio = result.ratio(load, policy)
    if ratio is None:
        return "-"
    interval = result.ratio_interval(load, policy)
    return f"{ratio:.2f}x" + ("" if interval is None else f" [{interval[0]:.2f}, {interval[1]:.2f}]")


def format_table(result: SweepResult) -> str:
    """The sweep as one table: a row per load, a column group per policy, and adaptive's ratio to the best
    of target-only and every fixed k."""
    c = result.config
    policies = result.policies
    ratio_of = ["adaptive", *([TWIN] if TWIN in policies else [])]
    headers = [RATIO_HEADER, *([TWIN_HEADER] if TWIN in policies else [])]
    intervals = any(result.ratio_interval(load, p) is not None for load in result.loads for p in ratio_of)
    ratio_width = 21 if intervals else 10
    packages = " + ".join(f"{p.name} ({p.verify_mode})" for p in c.packages)
    counts = sorted({c.requests_at(load) for load in result.loads})
    per_load = str(counts[0]) if len(counts) == 1 else f"{counts[0]}..{counts[-1]}"
    lines = [
        f"dspark bench --sweep: {packages}",
        f"  {per_load} requests per load (at least {MIN_REQUESTS_PER_SLOT} per concurrent slot), "
        f"{c.max_tokens} output tokens each (ignore_eos, greedy); c = requests kept in flight",
        "  tok/s = output tokens/s; TPOT50/99 = time per output token p50/p99 (ms); TTFT50 = time to first "
        "token p50 (ms); tok/st = tokens per decode step",
        *([f"  {c.rounds} rounds, every server up, the policies' order rotated each load and round; each "
           "cell is the policy's median round there (sweep.json has every round)"] if c.rounds > 1 else []),
        "",
        " | ".join([f"{'':<{LOAD_WIDTH}}", *(f"{_policy_title(p):^{GROUP_WIDTH}}" for p in policies),
                    *(f"{h[0]:<{ratio_width}}" for h in headers)]).rstrip(),
        " | ".join([f"{'load':<{LOAD_WIDTH}}", *(" ".join(f"{n:>{w}}" for n, w in SUBCOLUMNS)
                                                 for _ in policies),
                    *(f"{h[1]:<{ratio_width}}" for h in headers)]).rstrip(),
    ]
    lines.append("-" * len(lines[-1]))
    for load in result.loads:
        lines.append(" | ".join([f"{load.label:<{LOAD_WIDTH}}",
                                 *(_cells(result.point(p, load)) for p in policies),
                                 *(f"{_ratio(result, load, p):<{ratio_width}}" for p in ratio_of)]).rstrip())
    lines.append("")
    lines.append("  best base = the faster of target-only and every fixed k at that load (median round); "
                 + ("adaptive / best base = the median over rounds of the two measured in the same round"
                    if c.rounds > 1 else "adaptive / best base = their tok/s"))
    if intervals:
        lines.append(f"  [lo, hi] = {INTERVAL_LEVEL:.0%} bootstrap interval of that median over the rounds")
    if TWIN in policies:
        lines.append("  twin = a second adaptive server, never a baseline: adaptive and its twin differ by "
                     "the machine's noise alone")
    lines += [f"  note: {note}" for note in c.notes]
    checks = result.lossless()
    if checks:
        same = [ch for ch in checks if ch.identical]
        lines.append(f"  greedy outputs identical to target-only's: {len(same)} of {len(checks)} policies"
                     + ("" if len(same) == len(checks) else
                        " -- DIFFER: " + "; ".join(f"{ch.policy} {ch.mismatched}/{ch.compared} "
                                                   f"({ch.first_mismatch})"
                                                   for ch in checks if not ch.identical)))
    if result.failed_requests:
        lines.append(f"  WARNING: {result.failed_requests} requests failed; see `errors` in sweep.json")
    return "\n".join(lines)


def plot_sweep(result: SweepResult, path: Path) -> Path:
    """tok/s against concurrency (log2 axis), a line per policy, and against request rate when the sweep
    ran any; written whole."""
    import matplotlib

    matplotlib.use("Agg")  # servers and CI have no display
    import matplotlib.pyplot as plt

    kinds = [kind for kind in ("concurrency", "rate") if any(load.kind == kind for load in result.loads)]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.4), layout="constrained",
                             squeeze=False)
    policies = result.policies
    fixed = [p for p in policies if p.startswith("fixed-")]
    cmap = plt.get_cmap("viridis")
    styles = {"target-only": ("black", "-", 1.8), "static": ("tab:blue", "-", 1.8),
              "adaptive": ("tab:red", "-", 2.2), TWIN: ("tab:orange", ":", 1.6)}
    for ax, kind in zip(axes[0], kinds, strict=True):
        loads = [load for load in result.loads if load.kind == kind]
        xs = [load.value for load in loads]
        for policy in policies:
            pts = [(load.value, point.output_throughput) for load in loads
                   if (point := result.point(policy, load)) is not None]
            if policy in styles:
                color, style, width = styles[policy]
            else:  # fixed k: light to dark as k grows, thin, so that the named policies stand out
                shade = 0.15 + 0.7 * fixed.index(policy) / max(len(fixed) - 1, 1)
                color, style, width = cmap(shade), "--", 1.0
            ax.plot([x for x, _ in pts], [y for _, y in pts], color=color, ls=style, lw=width, marker="o",
                    markersize=3.5, label=_policy_title(policy))
        if kind == "concurrency":
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(int(x)) for x in xs])
            ax.set_xlabel("concurrency (requests in flight, closed loop)")
        else:
            ax.set_xscale("log")
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
            ax.set_xlabel("request rate (req/s, Poisson arrivals)")
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    names = " + ".join(p.name for p in result.config.packages)
    axes[0][0].set_title(f"{names}: {result.config.max_tokens} tokens per request, greedy", fontsize=9)
    try:
        # No Software/date metadata, so the same results give the same bytes.
        return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=DPI, metadata={"Software": None},
                                                          format="png"))
    finally:
        plt.close(fig)


def write_outputs(result: SweepResult, out_dir: Path, table: str) -> list[Path]:
    """sweep.json, sweep.txt (the table) and sweep.png in `out_dir`, each written whole."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [atomic_write_text(out_dir / "sweep.json", json.dumps(result.to_json(), indent=1) + "\n"),
            atomic_write_text(out_dir / "sweep.txt", table + "\n"),
            plot_sweep(result, out_dir / "sweep.png")]
