"""`dspark report`: the Markdown report, with its PNG plots, of the measurements a deployment needs.

Each section appears only when its inputs exist (`dspark.report.inputs`):

- Runs: summary per run and, per draft position, accepted / verified drafts (the one measured acceptance
  figure; `tau` and `(AL-1)/gamma` are predictions or averages and are never reported as one), and what
  each recording cannot show, with the reason (`dspark.report.runs`).
- Calibration: reliability of the conditional confidence and of the cumulative survival, before and after
  STS (`dspark.report.reliability`).
- tau vs actual: bias of the planner's predicted committed tokens by batch size, lag, policy and tier
  (`dspark.report.tau_bias`).
- Cost model vs measurement: profiled step times against each table, error near graph tiers
  (`dspark.report.cost`).
- Throughput: bench results, and the fewest verify rows that would have committed the same tokens
  (`dspark.report.oracle`).

The section modules compute; this one lays the results out and has `dspark.report.plots` draw them.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from dspark.atomic import atomic_write_text
from dspark.measure.tiers import TIER_RADIUS
from dspark.report.cost import ResidualRow, cost_panels, residual_table, step_time_by_context
from dspark.report.inputs import ReportInputs, unique_labels
from dspark.report.oracle import oracle_rows
from dspark.report.reliability import NUM_BINS, calibration_groups
from dspark.report.runs import missing_figures, run_summaries
from dspark.report.tau_bias import bias_by_batch_and_lag, bias_tables

REPORT_FILE = "report.md"


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    def cell(v: Any) -> str:
        return (v if isinstance(v, str) else _fmt(v)).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return lines + [""]


def _series(values: Sequence[Any], digits: int = 2) -> str:
    return " ".join(_fmt(v, digits) for v in values)


def _ms(seconds: float | None) -> str:
    return _fmt(None if seconds is None else seconds * 1e3, 4)


def _residual_cells(row: ResidualRow) -> list[Any]:
    fit = row.fit
    if fit is None:
        return [row.model, 0, row.out_of_range, "-", "-", "- (0)", "- (0)", "-%"]
    return [row.model, fit.num_samples, row.out_of_range, _ms(fit.rms_seconds), _fmt(fit.r_squared, 4),
            f"{_ms(fit.boundary_mean_abs_error_seconds)} ({fit.num_boundary})",
            f"{_ms(fit.elsewhere_mean_abs_error_seconds)} ({fit.num_elsewhere})",
            f"{_fmt(fit.max_relative_error * 100, 1)}%"]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "policy"


TERMINOLOGY = ("The only measured acceptance figure in this report is **accepted / verified drafts**: drafts "
               "accepted at a position divided by drafts the target verified there. `tau` (the planner's "
               "predicted committed tokens of a step) and `(AL-1)/gamma` are a prediction and an average; "
               "neither is reported as a measured acceptance figure.")


class _Renderer:
    """Builds the Markdown section by section and draws each plot into `out_dir` as it goes."""

    def __init__(self, inputs: ReportInputs, out_dir: Path) -> None:
        from dspark.report import plots as report_plots  # matplotlib only when a report is actually drawn

        self.inputs = inputs
        self.out_dir = out_dir
        self.plots = report_plots
        self.labels = unique_labels([r.path for r in inputs.runs])

    def render(self) -> str:
        parts = [self.header(), self.runs(), self.calibration(), self.tau(), self.cost(), self.context(),
                 self.throughput()]
        return "\n".join(line for part in parts for line in part).rstrip() + "\n"

    def image(self, file_name: str, alt: str) -> str:
        return f"![{alt}]({file_name})"

    def header(self) -> list[str]:
        inp = self.inputs
        lines = ["# dspark report", "", "Inputs:", ""]
        lines += [f"- run: `{r.path}` ({r.deployment}, {r.mode}, {r.backend}/{r.device})" for r in inp.runs]
        if inp.calibration is not None:
            lines.append(f"- STS calibration: `{inp.calibration_path}`")
        if inp.profile is not None:
            lines.append(f"- profile: `{inp.profile_path}`")
        lines += [f"- cost table `{name}`: {type(model).__name__}" for name, model in inp.tables]
        lines += [f"- bench: `{b.path}`" for b in inp.bench]
        return lines + ["", "> " + TERMINOLOGY, ""]

    def runs(self) -> list[str]:
        if not self.inputs.runs:
            return []
        summaries = run_summaries(self.inputs.runs, self.labels)
        lines = ["## Runs", ""]
        lines += _table(
            ["run", "deployment", "mode", "policy", "lag_steps", "B range", "steps", "tokens/s",
             "mean commit_len", "steps off", "decode time off"],
            [[s.run, s.deployment, s.mode, s.policy, s.lag_steps,
              "-" if s.batch_range is None else f"{s.batch_range[0]}–{s.batch_range[1]}", s.steps,
              _fmt(s.tokens_per_second, 1), s.mean_commit_len, s.off_steps,
              "-" if s.off_share is None else f"{100 * s.off_share:.1f} %"] for s in summaries])
        lines += ["Steps off: decode steps the planner ran without speculation (its off state, "
                  "docs/planner.md); decode time off: their share of the decode seconds.", ""]
        lines += ["Per draft position 1…gamma: drafts the target verified, drafts accepted, and accepted / "
                  "verified drafts.", ""]
        lines += _table(["run", "verified drafts", "accepted drafts", "accepted / verified drafts"],
                        [[s.run, _series(s.verified), _series(s.accepted), _series(s.accepted_over_verified)]
                         for s in summaries])
        notes = missing_figures(self.inputs.runs, self.labels)
        if notes:
            lines += ["What these recordings cannot show:", ""] + [f"- {note}" for note in notes] + [""]
        return lines

    def calibration(self) -> list[str]:
        cal = self.inputs.calibration
        groups = calibration_groups(self.inputs.runs, cal, self.labels, str(self.inputs.calibration_path))
        if not groups and cal is None:
            return []
        lines = ["## Calibration", ""]
        if cal is not None:
            lines += [f"STS file `{self.inputs.calibration_path}`: dataset {cal.dataset or '?'}, "
                      f"{_fmt(cal.num_samples)} samples, temperatures {_series(cal.temperatures)}"
                      + (f", then a survival map of {len(cal.survival_map.x[0])} knots a position (\"after\" "
                         "scores both, as the planner computes its survival)" if cal.survival_map else "")
                      + ".", ""]
            if cal.ece_before is not None or cal.ece_after is not None:
                lines += ["ECE the fit reported: before " + _series(cal.ece_before or (), 4) + "; after "
                          + _series(cal.ece_after or (), 4) + ".", ""]
        if not groups:
            lines += ["No run recorded STS samples (`sts/`), so the reliability diagrams are omitted.", ""]
            return lines
        lines += [f"Reliability over {NUM_BINS} equal-width bins. *Conditional*: sigmoid(z_k/T_k) against "
                  "\"draft k accepted\", only rows whose accepted prefix reached k. *Cumulative*: survival "
                  "against prefix_mask[k] (k < correct_len), every row. Before = T 1; after = the STS file's "
                  "temperatures. AUROC ranks the survival.", ""]
        used: set[str] = set()
        for group in groups:
            slug = _slug(group.policy) + f"-g{group.gamma}"
            while slug in used:
                slug += "-x"
            used.add(slug)
            skipped = f", {group.skipped_requests} requests skipped" if group.skipped_requests else ""
            lines += [f"### policy {group.policy} (gamma {group.gamma})", "",
                      f"{group.num_samples} samples from {', '.join(group.runs)}{skipped}.", ""]
            whens = list(group.conditional)
            headers = ["position"]
            for kind in ("conditional", "cumulative"):
                headers += [f"{kind} n"] + [f"{kind} ECE {w}" for w in whens]
            headers += [f"cumulative Brier {w}" for w in whens] + [f"AUROC {w}" for w in whens]
            rows = []
            for k in range(group.gamma):
                row: list[Any] = [k + 1]
                for table in (group.conditional, group.cumulative):
                    row += [table["before"][k].num_samples] + [_fmt(table[w][k].ece, 4) for w in whens]
                row += [_fmt(group.cumulative[w][k].brier, 4) for w in whens]
                row += [group.cumulative[w][k].auroc for w in whens]
                rows.append(row)
            lines += _table(headers, rows)
            for kind, table in (("conditional", group.conditional), ("cumulative", group.cumulative)):
                name = f"calibration_{kind}_{slug}.png"
                self.plots.plot_reliability(
                    {when: table[when] for when in whens},
                    f"{kind} calibration · policy {group.policy}", self.out_dir / name)
                lines += [self.image(name, f"{kind} reliability, policy {group.policy}"), ""]
        return lines

    def tau(self) -> list[str]:
        tables = bias_tables(self.inputs.runs, self.labels)
        if not tables:
            return []
        static = sum(len(r.steps) for r in self.inputs.runs if all(s.tau is None for s in r.steps))
        lines = ["## Predicted tau vs actual committed tokens", "",
                 "Per step, bias = actual − tau, where actual is the committed tokens and tau = B + the "
                 "survival of the verified drafts. Positive bias: the planner under-predicts. relative = "
                 "mean(actual − tau) / mean(actual); std is the sample standard deviation.", ""]
        if static:
            lines += [f"{static} steps of static runs have no tau and are left out.", ""]
        for group, rows in tables.items():
            lines += ["Overall:" if group == "all" else f"By {group}:", ""]
            lines += _table([group, "steps", "mean bias", "std", "mean |bias|", "relative bias"],
                            [[r.group, r.count, r.mean_bias, r.std, r.mean_abs, r.relative_bias]
                             for r in rows])
        name = "tau_bias_by_batch.png"
        self.plots.plot_bias_by_batch(bias_by_batch_and_lag(self.inputs.runs), self.out_dir / name)
        return lines + [self.image(name, "actual - tau by batch size and lag"), ""]

    def cost(self) -> list[str]:
        profile = self.inputs.profile
        if profile is None:
            return []
        samples = profile.fit_samples()
        tiers = self.inputs.tiers
        models = list(self.inputs.tables)
        lines = ["## Cost model vs measurement", "",
                 f"{len(samples)} profiled (B, M) medians of the verify step; graph tiers: "
                 f"{', '.join(map(str, tiers)) or 'none'}.", ""]
        if models:
            lines += [f"Residual = measured − predicted. Near tier: M within ±{TIER_RADIUS} rows of a tier.",
                      ""]
            lines += _table(
                ["model", "samples", "out of range", "RMS ms", "R²", "mean abs err near tier ms (n)",
                 "mean abs err elsewhere ms (n)", "max rel err"],
                [_residual_cells(r) for r in residual_table(samples, models, tiers)])
        else:
            lines += ["No cost tables given (`--tables`): measured points only.", ""]
        name = "cost_model_vs_measured.png"
        self.plots.plot_cost_models(cost_panels(samples, models), tiers, self.out_dir / name)
        return lines + [self.image(name, "step time vs M: measured and predicted"), ""]

    def context(self) -> list[str]:
        rows = step_time_by_context([s for run in self.inputs.runs for s in run.steps])
        if not rows:
            return []
        lines = ["## Step time by context length", "",
                 "Drafted steps grouped by the batch's mean cached tokens a request (the context the "
                 "planner priced them at). table = the cost table's price (draft included), priced = with "
                 "the measured step offset the planner added; ratio = table / measured; online = the "
                 "offset's whole fit, slope x priced (measured ~ a x table + b).", ""]
        headers = ["context", "steps", "measured ms", "table ms", "ratio", "priced ms", "online ms"]
        return lines + _table(headers,
                              [[r.bucket, r.steps, _ms(r.measured_seconds), _ms(r.table_seconds),
                                f"{r.table_ratio:.3f}", _ms(r.priced_seconds), _ms(r.online_seconds)]
                               for r in rows]) + [""]

    def throughput(self) -> list[str]:
        oracle = oracle_rows(self.inputs.runs, self.labels)
        if not self.inputs.bench and not oracle:
            return []
        lines = ["## Throughput", ""]
        for bench in self.inputs.bench:
            lines += [f"`{bench.path}`: {bench.prompts} prompts × {bench.max_new_tokens} tokens, "
                      f"max_running_requests {_fmt(bench.max_running_requests)}.", ""]
            lines += _table(
                ["package", "mode", "tokens/s", "ratio to first", "mean commit_len", "rows / request-step",
                 "padding / request-step", "planned / request-step", "predicted tau / step",
                 "committed / step", "lossless"],
                [[r["package"], r["mode"], _fmt(r["tokens_per_s"], 1), r["ratio_to_first"],
                  r["mean_commit_len"], r["rows_per_request_step"], r["padding_rows_per_request_step"],
                  r["planned_rows_per_request_step"], r["predicted_tau_per_step"], r["committed_per_step"],
                  r["lossless"]] for r in bench.results])
        if self.inputs.bench:
            name = "throughput.png"
            titles = unique_labels([b.path for b in self.inputs.bench])
            self.plots.plot_throughput(
                [(title, [(f"{r['package']} ({r['mode']})", float(r["tokens_per_s"])) for r in b.results])
                 for title, b in zip(titles, self.inputs.bench, strict=True)], self.out_dir / name)
            lines += [self.image(name, "tokens/s by package and mode"), ""]
        if oracle:
            lines += ["Verify rows per step: the oracle's (sum over requests of min(raw_correct_len + 1, N), "
                      "the fewest rows that commit the same tokens had each matching prefix been known), the "
                      "planner's, those the target ran, and the tier they were padded to. No timing is "
                      "attached to the oracle.", ""]
            lines += _table(["run", "mode", "steps", "oracle rows / step", "planned rows / step",
                             "rows run / step", "tier rows / step", "planned / oracle"],
                            [[o.run, o.mode, o.steps, o.oracle_rows, o.planned_rows, o.rows, o.tier_rows,
                              o.planned_rows / o.oracle_rows if o.oracle_rows else None] for o in oracle])
        return lines


def render_report(inputs: ReportInputs, out_dir: str | os.PathLike[str]) -> str:
    """Draw the plots into `out_dir` and return the report's Markdown (not yet written)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return _Renderer(inputs, out).render()


def write_report(inputs: ReportInputs, out_dir: str | os.PathLike[str]) -> Path:
    """Render and write `out_dir/report.md`. The Markdown is renamed into place last, so a failure at any
    point leaves the previous report.md (or none), never a partial one."""
    out = Path(out_dir)
    text = render_report(inputs, out)
    return atomic_write_text(out / REPORT_FILE, text)


