"""What a simulation takes from the deployment: its plan, the cost table, and the graph tiers.

PACKAGE's `AdaptiveVerifyPlan` is the adaptive policy as it serves (temperatures, lag, floor, cap,
survival_eps, alignment). A `--cost-model` table replaces the package's own in both places it acts:
the planner's budget and the price of every policy's step. A `tier` table describes a deployment that
replays graphs at its tiers, so the plan packs into, and (when the package aligns) fills, those tiers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dspark.fingerprint import (
    WEIGHT_FIELDS,
    Fingerprint,
    FingerprintError,
    fingerprint_of_deployment,
    sampling_policy,
)
from dspark.formats.cost_tables import cost_table_json, read_cost_table
from dspark.formats.run_info import RunInfo
from dspark.modes import SpeculationOff
from dspark.runtime.package import GeneratedPackage
from dspark.runtime.planner.cost_models import TierCostTable
from dspark.runtime.planner.verify_plan import AdaptiveVerifyPlan
from dspark.simulate.pricing import StepPricer

# What the trace's confidence and labels depend on (dspark.fingerprint: a calibration's fields, the
# policy compared on its own so the message can say how to re-record).
TRACE_FIELDS = ("model_geometry", "model_weights", "draft", "draft_weights", "gamma")


class SimulationConfigError(ValueError):
    """PACKAGE, the trace and the cost table do not describe one deployment."""


@dataclass(frozen=True)
class SimulationSetup:
    plan: AdaptiveVerifyPlan
    pricer: StepPricer
    cost_model_source: str  # the table file, or "<deployment>'s own table"


def adaptive_plan(package: GeneratedPackage) -> AdaptiveVerifyPlan:
    plan = package.plan
    if not isinstance(plan, AdaptiveVerifyPlan):
        raise SimulationConfigError(f"{package.directory} is a {plan.mode} build: it has no planner to "
                                    "simulate; pass its compact (or cap-accept) build")
    return plan


def simulation_setup(package: GeneratedPackage, cost_model: str | os.PathLike[str] | None,
                     step_overhead: float = 0.0) -> SimulationSetup:
    """The plan and step prices of PACKAGE, with `cost_model` (a table file) in place of its own and
    `step_overhead` seconds added to every step's price (not to the planner's: it plans as it serves)."""
    plan = adaptive_plan(package)
    if cost_model is None:
        if plan.table is None:
            raise SimulationConfigError(f"{package.directory} was compiled without a cost model "
                                        "(verify.allow_no_cost_model), so no step can be priced; pass "
                                        "--cost-model TABLE")
        source = f"{package.deployment.name}'s own table"
    else:
        # A malformed file raises CostTableError naming the file and the field.
        table = read_cost_table(cost_model)
        # the simulation prices steps without speculation itself where the table has no decode term
        off = plan.speculation_off if table.decode_bs_probes else SpeculationOff.NEVER
        plan = plan.with_overrides(cost_model=cost_table_json(table), speculation_off=off)
        source = str(cost_model)
    runtime_table = plan.table
    assert runtime_table is not None
    tiers = plan.token_tiers if plan.mode.packs_rows else ()
    if isinstance(runtime_table, TierCostTable):
        tiers = runtime_table.tiers
        # The table's tiers bound the plan's step (its largest tier) and are what alignment fills when
        # the package aligns; whether it aligns stays the package's setting.
        plan = plan.with_overrides(token_tiers=tiers)
    return SimulationSetup(plan, StepPricer(runtime_table, tiers, step_overhead), source)


def check_trace_matches(package: GeneratedPackage, run: RunInfo, where: str) -> None:
    """Refuse a trace whose confidence or labels are not what PACKAGE's planner would see."""
    plan = adaptive_plan(package)
    if run.gamma != plan.gamma:
        raise SimulationConfigError(f"{where}: gamma is {run.gamma} but {package.directory} drafts "
                                    f"gamma = {plan.gamma}; record the trace with a build of the same draft")
    serving = package.deployment.serving
    policy = sampling_policy(serving.temperature, serving.top_p, serving.top_k)
    if run.policy != policy:
        raise SimulationConfigError(
            f"{where}: policy is {run.policy} but {package.directory} serves {policy}; acceptance depends "
            f"on the policy, so record the trace with the package's (dspark run --temperature "
            f"{serving.temperature} --top-p {serving.top_p} --top-k {serving.top_k})")
    if run.fingerprint is None:
        return
    try:
        recorded = Fingerprint.from_json(run.fingerprint)
    except FingerprintError as err:
        raise SimulationConfigError(f"{where}: fingerprint: {err}") from None
    mine = fingerprint_of_deployment(package.deployment, package.deployment.token_tiers)
    # A weights digest is "" where the checkpoint was absent when compiled: nothing to compare then.
    differ = [f"{name} {getattr(recorded, name)!r} vs {getattr(mine, name)!r}" for name in TRACE_FIELDS
              if getattr(recorded, name) != getattr(mine, name)
              and (name not in WEIGHT_FIELDS or (getattr(recorded, name) and getattr(mine, name)))]
    if differ:
        raise SimulationConfigError(f"{where}: fingerprint: the trace was recorded with another model or "
                                    f"draft than {package.directory} ({'; '.join(differ)}); record it with "
                                    "a build of the same checkpoints")
