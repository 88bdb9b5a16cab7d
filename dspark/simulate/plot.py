"""The PNG of `dspark simulate --plot`: tokens/s by concurrency per policy, and each relative to static.

Agg backend: simulations run on servers and in CI, where no display exists.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot loads)

from dspark.atomic import atomic_write  # noqa: E402
from dspark.simulate.output import SimulationReport  # noqa: E402

DPI = 110


def plot_report(report: SimulationReport, path: str | Path) -> Path:
    """Write the plot to `path` (written whole: a reader never sees half a PNG)."""
    concurrencies = sorted({r.concurrency for r in report.results})

    def series(policy: str, k: int | None = None) -> list[float]:
        return [next(r.tokens_per_s for r in report.results
                     if r.concurrency == c and r.policy == policy and (k is None or r.verify_len == k))
                for c in concurrencies]

    static = series("static")
    best = [max(r.tokens_per_s for r in report.results if r.concurrency == c and r.policy == "fixed")
            for c in concurrencies]
    fig, (ax_abs, ax_rel) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    for k in range(1, report.num_draft_tokens + 1):
        ax_abs.plot(concurrencies, series("fixed", k), color="0.75", lw=0.8, marker=".",
                    label="fixed k = 1..N" if k == 1 else None)
    # Best fixed is dashed: where it is static (k = N) the two lines coincide.
    lines = (("target-only", series("target-only"), "tab:purple", ":"), ("static", static, "tab:blue", "-"),
             ("best fixed", best, "tab:green", "--"),
             ("adaptive-on", series("adaptive-on"), "tab:orange", "-."),
             ("adaptive", series("adaptive"), "tab:red", "-"), ("oracle", series("oracle"), "black", "-"))
    for name, values, color, style in lines:
        ax_abs.plot(concurrencies, values, color=color, ls=style, marker="o", label=name)
        ax_rel.plot(concurrencies, [v / s for v, s in zip(values, static, strict=True)], color=color,
                    ls=style, marker="o", label=name)
    for ax in (ax_abs, ax_rel):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.set_xlabel("concurrency (requests per step)")
        ax.grid(alpha=0.3)
    ax_abs.set_ylabel("tokens/s (predicted)")
    ax_abs.set_title(f"{report.package}: {report.cost_model_kind} cost model")
    ax_abs.legend(fontsize=8)
    ax_rel.axhline(1.0, color="tab:blue", lw=0.8, ls="--")
    ax_rel.set_ylabel("tokens/s relative to static")
    ax_rel.set_title(f"trace: {report.trace_policy}, {report.request_steps} request-steps")
    ax_rel.legend(fontsize=8)
    try:
        # No Software/date metadata, so the same results give the same bytes.
        return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=DPI, metadata={"Software": None},
                                                          format="png"))
    finally:
        plt.close(fig)
