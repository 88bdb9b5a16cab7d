"""A simulation's results as a readable table and as the `--json` document."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dspark.simulate.sweep import Comparison, PolicyResult, compare


@dataclass(frozen=True)
class SimulationReport:
    package: str
    trace: str
    trace_policy: str
    request_steps: int  # in the trace
    cost_model_kind: str
    cost_model_source: str
    step_overhead_ms: float
    tiers: tuple[int, ...]
    lag_steps: int
    num_draft_tokens: int
    steps: int  # simulated steps per concurrency
    seed: int
    results: tuple[PolicyResult, ...]
    decode_source: str = "the table's decode term"  # what prices a target-only step (`StepPricer`)

    @property
    def comparisons(self) -> list[Comparison]:
        return compare(self.results)

    def to_json(self) -> dict[str, Any]:
        return {"package": self.package, "trace": self.trace, "trace_policy": self.trace_policy,
                "trace_request_steps": self.request_steps,
                "cost_model": {"kind": self.cost_model_kind, "source": self.cost_model_source,
                               "step_overhead_ms": self.step_overhead_ms,
                               "decode_priced_by": self.decode_source},
                "tiers": list(self.tiers), "lag_steps": self.lag_steps,
                "num_draft_tokens": self.num_draft_tokens, "steps_per_concurrency": self.steps,
                "seed": self.seed, "results": [r.to_json() for r in self.results],
                "comparisons": [c.to_json() for c in self.comparisons]}


def _label(result: PolicyResult) -> str:
    return f"fixed k={result.verify_len}" if result.policy == "fixed" else result.policy


def format_report(report: SimulationReport) -> str:
    """The table `dspark simulate` prints: per concurrency every policy, then adaptive's ratios."""
    tiers = ",".join(map(str, report.tiers)) or "none"
    lines = [f"{report.package} on {report.trace} ({report.request_steps} request-steps, "
             f"{report.trace_policy})",
             f"cost model: {report.cost_model_kind} ({report.cost_model_source}) + "
             f"{report.step_overhead_ms:g} ms per step; graph tiers: {tiers}; "
             f"lag {report.lag_steps}; N = {report.num_draft_tokens}; {report.steps} steps per "
             f"concurrency, seed {report.seed}"]
    comparisons = {c.concurrency: c for c in report.comparisons}
    for c, comparison in comparisons.items():
        at = [r for r in report.results if r.concurrency == c]
        static = next(r.tokens_per_s for r in at if r.policy == "static")
        head = (f"  {'policy':<12} {'tokens/s':>10} {'tokens/step':>12} {'rows/step':>10} {'vs static':>10} "
                f"{'steps off':>10}")
        lines += ["", f"concurrency {c}", head]
        for r in at:
            lines.append(f"  {_label(r):<12} {r.tokens_per_s:>10.1f} {r.tokens_per_step:>12.2f} "
                         f"{r.rows_per_step:>10.2f} {r.tokens_per_s / static:>10.3f} {r.off_share:>10.1%}")
        lines.append(f"  adaptive / best fixed (k={comparison.best_fixed_verify_len}) "
                     f"{comparison.adaptive_over_best_fixed:.3f} · adaptive / target-only "
                     f"{comparison.adaptive_over_target_only:.3f} · adaptive / oracle "
                     f"{comparison.adaptive_over_oracle:.3f} · adaptive / static "
                     f"{comparison.adaptive_over_static:.3f}")
        if comparison.adaptive_on_over_informed is not None:
            informed = next(r.tokens_per_s for r in at if r.policy == "informed")
            oracle = next(r.tokens_per_s for r in at if r.policy == "oracle")
            lines.append(f"  adaptive-on / informed {comparison.adaptive_on_over_informed:.3f} · informed / "
                         f"oracle {informed / oracle:.3f} (informed: the plan on the true acceptance "
                         "probabilities)")
        dropped = comparison.adaptive_dropped
        if dropped is not None and dropped.count:
            lines.append(f"  adaptive left out {dropped.count / report.steps:.2f} drafts per step: survival "
                         f"{dropped.mean_survival:.3f} on average, accepted {dropped.reach_rate:.3f} had "
                         "they been verified")
    lines += ["", "tokens/step and rows/step are summed over the batch; rows include tier padding; steps "
              "off: steps decoded without speculation (target-only, and adaptive's off state)",
              f"target-only steps priced by {report.decode_source}"]
    return "\n".join(lines) + "\n"

