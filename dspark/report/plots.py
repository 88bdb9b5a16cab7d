"""PNG plots of `dspark report`. Each function draws data a section module already computed and writes
one file.

Agg backend: reports are drawn on servers and in CI, where no display exists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot loads)
import numpy as np  # noqa: E402

if TYPE_CHECKING:
    from dspark.report.cost import CostPanel
    from dspark.report.reliability import Reliability

DPI = 110
COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]


def _save(fig: plt.Figure, path: Path) -> Path:
    # No Software/date metadata, so the same data gives the same bytes.
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    return path


def _grid(count: int, width: float = 3.6, height: float = 3.3) -> tuple[plt.Figure, list[plt.Axes]]:
    cols = min(count, 4)
    rows = -(-count // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False,
                             layout="constrained")
    flat = list(axes.ravel())
    for ax in flat[count:]:
        ax.set_visible(False)
    return fig, flat[:count]


def plot_reliability(series: Mapping[str, Sequence[Reliability]], title: str, path: Path) -> Path:
    """One subplot per draft position: event rate against mean confidence per bin, for each series
    ("before", "after"); point area grows with the bin's count, ECE in the legend."""
    num_positions = len(next(iter(series.values())))
    fig, axes = _grid(num_positions)
    largest = max((int(r.counts.max()) for rels in series.values() for r in rels if r.counts.size), default=1)
    for k, ax in enumerate(axes):
        ax.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=0.8)
        for color, (when, rels) in zip(COLORS, series.items(), strict=False):
            rel = rels[k]
            filled = rel.counts > 0
            sizes = 8 + 160 * rel.counts[filled] / max(largest, 1)
            ax.plot(rel.mean_confidence[filled], rel.event_rate[filled], color=color, linewidth=0.8)
            ax.scatter(rel.mean_confidence[filled], rel.event_rate[filled], s=sizes, color=color, alpha=0.7,
                       label=f"{when} (ECE {rel.ece:.3f}, n {rel.num_samples})")
        ax.set(xlim=(0, 1), ylim=(0, 1), title=f"position {k + 1}", xlabel="confidence",
               ylabel="observed rate")
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title)
    return _save(fig, path)


def plot_bias_by_batch(data: Mapping[int, Mapping[int, np.ndarray]], path: Path) -> Path:
    """Box plots of actual − tau per batch size, one coloured series per lag, offset side by side."""
    sizes = sorted({b for per_b in data.values() for b in per_b})
    position = {b: i for i, b in enumerate(sizes)}
    width = 0.8 / max(len(data), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(sizes) + 2), 4.2), layout="constrained")
    for j, (color, (lag, per_b)) in enumerate(zip(COLORS * 4, data.items(), strict=False)):
        xs = [position[b] - 0.4 + width * (j + 0.5) for b in per_b]
        box = ax.boxplot(list(per_b.values()), positions=xs, widths=width * 0.9, patch_artist=True,
                         manage_ticks=False, flierprops={"markersize": 3},
                         medianprops={"color": "black"})
        for patch in box["boxes"]:
            patch.set(facecolor=color, alpha=0.5)
        ax.plot([], [], color=color, linewidth=6, alpha=0.5, label=f"lag_steps {lag}")
    ax.axhline(0.0, color="0.4", linewidth=0.8)
    ax.set_xticks(range(len(sizes)), [str(b) for b in sizes])
    ax.set(xlabel="batch size B", ylabel="actual − tau (tokens per step)",
           title="committed tokens minus predicted tau, per step")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_cost_models(panels: Sequence[CostPanel], tiers: Sequence[int], path: Path) -> Path:
    """Per batch size: measured median step time (points) and each model's prediction (lines) over M,
    with graph tiers as vertical lines."""
    fig, axes = _grid(len(panels), width=4.2, height=3.4)
    for ax, panel in zip(axes, panels, strict=True):
        lo, hi = panel.model_rows[0], panel.model_rows[-1]
        for tier in tiers:
            if lo <= tier <= hi:
                ax.axvline(tier, color="0.8", linewidth=0.8, zorder=0)
        ax.scatter(panel.rows, panel.seconds * 1e3, s=14, color="black", label="measured median", zorder=3)
        for color, (name, seconds) in zip(COLORS, panel.predictions.items(), strict=False):
            # Evaluated at every integer M, so a floor-lookup table's cliffs show as cliffs.
            ax.plot(panel.model_rows, seconds * 1e3, color=color, linewidth=1.2, label=name)
        ax.set(title=f"B = {panel.num_reqs}", xlabel="verify rows M", ylabel="step ms")
        ax.legend(fontsize=7)
    fig.suptitle("verify step time vs M (grey lines: graph tiers)")
    return _save(fig, path)


def plot_throughput(benches: Sequence[tuple[str, Sequence[tuple[str, float]]]], path: Path) -> Path:
    """Horizontal bars of tokens/s per package (mode), one subplot per bench file."""
    fig, axes = _grid(len(benches), width=6.0, height=0.45 * max(len(r) for _, r in benches) + 1.5)
    for ax, (title, rows) in zip(axes, benches, strict=True):
        labels = [label for label, _ in rows]
        values = [value for _, value in rows]
        ax.barh(range(len(rows)), values, color=[COLORS[i % len(COLORS)] for i in range(len(rows))])
        ax.set_yticks(range(len(rows)), labels, fontsize=8)
        ax.invert_yaxis()  # first package (the baseline) on top
        ax.set(title=title, xlabel="tokens/s")
    return _save(fig, path)
