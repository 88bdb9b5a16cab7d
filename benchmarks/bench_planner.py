"""The planner's host cost: one budget decision plus allocation against SGLang's torch path, and a
step's planning plus layout, timed in one run.

1. Decision + allocation at B requests and gamma drafts (default 256 and 7): one `Ranking` shared by
   `decide_budget` and `Ranking.verify_lens`, as the engine's plan does, against SGLang's DSpark torch
   algorithm (`compute_verify_token_budget` +
   `schedule_verify_lens_topk_from_survival`, SGLang 0.5.x), reimplemented below from its published
   code for this comparison only (the product never runs it). Both get the same float32 CPU survival
   and return a budget and int32 `verify_lens`; before timing, the benchmark checks that the two
   agree on every input. Tables: `additive` and `sps-1d` (both of SGLang's kinds), and a `tier` table,
   which SGLang would express as the equivalent sps-1d staircase (a step costs what its tier costs).
2. Planning + layout per step at each `--layout-batch-sizes` B: the engine's planner call
   (`AdaptiveVerifyPlan.plan_step`: confidence logits → survival → budget → verify_lens) plus
   `plan_verify`, for a compact plan with the additive table and graph tiers up to B·N, on the CPU.

Every round runs every side (both planners for every table, planning and layout at every B; the
order reversed every other round), so a busy machine slows them alike; each figure is the median
over rounds of the mean per call within a round.

    .venv/bin/python benchmarks/bench_planner.py
    .venv/bin/python benchmarks/bench_planner.py --rounds 5 --calls 5 --json
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dspark.modes import VerifyMode
from dspark.runtime.layout import StepShape, VerifyLayout, plan_verify
from dspark.runtime.planner.budget import Ranking, ScheduleConfig, decide_budget
from dspark.runtime.planner.cost_models import AdditiveCostTable, CostModel, SpsTable, TierCostTable
from dspark.runtime.planner.verify_plan import AdaptiveVerifyPlan, StepPlan

# Issue 12's targets, printed next to the measurements (at B = 256, gamma = 7 and B = 128).
SPEEDUP_TARGET = 4.0
LAYOUT_TARGET_B = 128
LAYOUT_TARGET_MS = 0.25
PAGE_SIZE = 16
PREFIX_LEN = 700  # cached positions per request: pages enough that the page-table lookups are real

# --- SGLang's torch path, reimplemented (benchmark only) ----------------------------------------------
#
# The budget: survival of drafts 1..L (every request's root always runs), candidates >= eps sorted
# descending, tau = B + prefix sums, M = B + b, and the first argmax of tau * SPS(M) (sps-1d, floor
# lookup) or tau / (bias + alpha(B) + theta(M)) (additive, theta interpolated with clamping). The
# allocation: all candidates when the budget covers them, else a global top-`budget` by survival
# (ties: earlier position, then lower request) from three stable argsorts, counted per request with
# scatter_add, then verify_len = clamp(min_verify_len + count, max(min_verify_len, 1), L).


@dataclass(frozen=True)
class SglSps:
    batch_tokens: torch.Tensor  # int64 probes
    steps_per_sec: torch.Tensor  # float64


@dataclass(frozen=True)
class SglAdditive:
    bias_seconds: float
    bs_probes: tuple[int, ...]
    alpha_seconds: tuple[float, ...]
    m_probes: tuple[int, ...]
    theta_seconds: tuple[float, ...]


def sgl_interp_clamped(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    hi = bisect.bisect_right(xs, x)
    return ys[hi - 1] + (x - xs[hi - 1]) / (xs[hi] - xs[hi - 1]) * (ys[hi] - ys[hi - 1])


def sgl_budget(survival: torch.Tensor, table: SglSps | SglAdditive, gamma: int, survival_eps: float) -> int:
    """SGLang's `compute_verify_token_budget` (min_verify_len 1, max_verify_len gamma + 1)."""
    num_reqs = survival.shape[0]
    cands = survival[:, : gamma + 1].flatten()
    cands = cands[cands >= survival_eps].to(torch.float64)
    ordered = torch.sort(cands, descending=True).values
    tau = num_reqs + torch.cat((torch.zeros(1, dtype=torch.float64), torch.cumsum(ordered, dim=0)))
    if isinstance(table, SglAdditive):
        fixed = table.bias_seconds + sgl_interp_clamped(table.bs_probes, table.alpha_seconds, float(num_reqs))
        probes = torch.tensor(table.m_probes, dtype=torch.float64)
        theta = torch.tensor(table.theta_seconds, dtype=torch.float64)
        m = (num_reqs + torch.arange(tau.numel(), dtype=torch.float64)).clamp_(
            min=float(table.m_probes[0]), max=float(table.m_probes[-1]))
        hi = torch.bucketize(m, probes, right=True).clamp_(1, probes.numel() - 1)
        lo = hi - 1
        frac = (m - probes[lo]) / (probes[hi] - probes[lo]).clamp_(min=1e-9)
        objective = tau / (fixed + theta[lo] + frac * (theta[hi] - theta[lo]))
    else:
        rows = num_reqs + torch.arange(tau.numel(), dtype=torch.int64)
        index = (torch.bucketize(rows, table.batch_tokens, right=True) - 1).clamp_(
            0, table.batch_tokens.numel() - 1)
        objective = tau * table.steps_per_sec[index]
    return int(torch.argmax(objective))


def sgl_verify_lens(survival: torch.Tensor, budget: int, gamma: int, survival_eps: float,
                    min_verify_len: int = 1) -> torch.Tensor:
    """SGLang's `schedule_verify_lens_topk_from_survival` (its torch path; max_verify_len gamma + 1)."""
    num_reqs = survival.shape[0]
    max_len = gamma + 1
    device = survival.device
    extra = torch.zeros(num_reqs, dtype=torch.int64, device=device)
    if budget > 0:
        window = survival[:, :max_len]
        if window.numel() > 0:
            requests = torch.arange(num_reqs, device=device).view(num_reqs, 1).expand_as(window)
            positions = torch.arange(window.shape[1], device=device).view(1, -1).expand_as(window)
            valid = window >= survival_eps
            if int(budget) >= int(valid.to(torch.int32).sum().item()):
                extra = valid.to(torch.int64).sum(dim=1)
            else:
                flat_requests, flat_positions = requests.reshape(-1), positions.reshape(-1)
                flat_valid = valid.reshape(-1)
                flat = window.reshape(-1).to(torch.float64)
                masked = torch.where(flat_valid, flat, torch.full_like(flat, float("-inf")))
                order = torch.arange(masked.numel(), device=device)
                order = order[torch.argsort(flat_requests[order], stable=True)]
                order = order[torch.argsort(flat_positions[order], stable=True)]
                order = order[torch.argsort(-masked[order], stable=True)]
                chosen = order[: min(int(budget), window.numel())]
                extra.scatter_add_(0, flat_requests[chosen], flat_valid[chosen].to(torch.int64))
    lens = torch.full((num_reqs,), min_verify_len, dtype=torch.int64, device=device) + extra
    return torch.clamp(lens, min=max(min_verify_len, 1), max=max_len).to(torch.int32)


# --- the benchmark's tables and inputs -------------------------------------------------------------------


def tables(max_reqs: int, n: int) -> dict[str, tuple[CostModel, SglSps | SglAdditive]]:
    """Synthetic tables shaped like an 8B target's verify step on a large GPU (a few ms, growing with
    rows and requests), covering up to max_reqs requests and max_reqs * n rows; each with the SGLang
    table that prices every step the same."""
    max_rows = max_reqs * n
    bs = tuple(sorted({1, 8, 32, 64, 128, max_reqs}))
    alpha = tuple(2e-3 * b / max_reqs for b in bs)
    ms = tuple(sorted({1, *range(64, max_rows + 1, 64), max_rows}))
    theta = tuple(2e-6 * m + 1e-9 * m * m for m in ms)
    additive = AdditiveCostTable(5e-3, bs, alpha, ms, theta)
    tokens = tuple(sorted({1, *range(32, max_rows + 1, 32)}))
    rates = tuple(1.0 / (6e-3 + 3e-6 * m) for m in tokens)
    sps = SpsTable(tokens, rates, max_batch_tokens=max_rows)
    tiers = tuple(sorted(t for t in {8, 16, 32, 64, 128, 256, 512, 1024, 1536, max_rows} if t <= max_rows))
    seconds = tuple(tuple(5e-3 + 2e-3 * b / max_reqs + 3e-6 * t for t in tiers) for b in bs)
    tier = TierCostTable(tiers, bs, seconds)
    return {
        "additive": (additive, SglAdditive(5e-3, bs, alpha, ms, theta)),
        "sps-1d": (sps, SglSps(torch.tensor(tokens), torch.tensor(rates, dtype=torch.float64))),
        "tier": (tier, tier_staircase(tier, max_reqs)),
    }


def tier_staircase(table: TierCostTable, num_reqs: int) -> SglSps:
    """The sps-1d table pricing a step of M rows at B = num_reqs as its tier does: the rate of tier j
    from M = tier j-1 + 1 on."""
    seconds = table.step_time_many(num_reqs, np.array(table.tiers))
    starts = [1] + [t + 1 for t in table.tiers[:-1]]
    return SglSps(torch.tensor(starts), torch.tensor(1.0 / seconds, dtype=torch.float64))


def survival_pool(count: int, num_reqs: int, gamma: int, seed: int) -> list[torch.Tensor]:
    """Float32 survival as a confidence head gives it: cumprod of sigmoid(logits), mostly confident."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.cumprod(torch.sigmoid(torch.randn(num_reqs, gamma, generator=generator) * 1.5 + 2.0), dim=1)
            for _ in range(count)]


# --- timing ------------------------------------------------------------------------------------------------


def interleaved(sides: dict[str, Callable[[int], object]], rounds: int, calls: int) -> dict[str, float]:
    """Median over rounds of each side's mean seconds per call; `side(i)` runs call i of a round."""
    for side in sides.values():  # warm caches, lazy tables and allocators outside the timing
        for i in range(min(calls, 3)):
            side(i)
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            side = sides[name]
            start = time.perf_counter()
            for i in range(calls):
                side(i)
            times[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(values) for name, values in times.items()}


@dataclass(frozen=True)
class DecisionResult:
    table: str
    num_reqs: int
    gamma: int
    ours_ms: float
    sglang_ms: float
    mean_budget: float

    @property
    def speedup(self) -> float:
        return self.sglang_ms / self.ours_ms

    def to_json(self) -> dict[str, Any]:
        return {"table": self.table, "num_reqs": self.num_reqs, "gamma": self.gamma, "ours_ms": self.ours_ms,
                "sglang_ms": self.sglang_ms, "speedup": self.speedup, "mean_budget": self.mean_budget}


class Disagreement(RuntimeError):
    """The two planners decided differently on a benchmark input: the comparison would be meaningless."""


Side = Callable[[int], object]


def decision_sides(num_reqs: int, gamma: int, kinds: Sequence[str], pool: int,
                   seed: int) -> tuple[dict[str, Side], dict[str, float]]:
    """Each table's two sides ("<kind>/ours", "<kind>/sglang"), after checking that they decide alike on
    every input, and the mean budget per table."""
    cfg = ScheduleConfig(gamma=gamma)
    inputs = survival_pool(pool, num_reqs, gamma, seed)
    sides: dict[str, Side] = {}
    mean_budgets = {}
    for kind, (table, sgl_table) in tables(num_reqs, gamma + 1).items():
        if kind not in kinds:
            continue

        def ours(i: int, table: CostModel = table) -> tuple[int, torch.Tensor]:
            ranking = Ranking.of(inputs[i % len(inputs)], cfg)
            budget = decide_budget(ranking, table, cfg).budget
            return budget, torch.from_numpy(ranking.verify_lens(budget))

        def sglang(i: int, sgl_table: SglSps | SglAdditive = sgl_table) -> tuple[int, torch.Tensor]:
            survival = inputs[i % len(inputs)]
            budget = sgl_budget(survival, sgl_table, gamma, cfg.survival_eps)
            return budget, sgl_verify_lens(survival, budget, gamma, cfg.survival_eps)

        budgets = []
        for i in range(len(inputs)):
            (a, lens_a), (b, lens_b) = ours(i), sglang(i)
            if a != b or not torch.equal(lens_a, lens_b):
                raise Disagreement(f"{kind} table, input {i}: our budget {a} vs SGLang's {b}"
                                   + ("" if a != b else "; verify_lens differ"))
            budgets.append(a)
        sides[f"{kind}/ours"], sides[f"{kind}/sglang"] = ours, sglang
        mean_budgets[kind] = float(np.mean(budgets))
    return sides, mean_budgets


@dataclass(frozen=True)
class LayoutResult:
    num_reqs: int
    plan_ms: float
    layout_ms: float
    total_ms: float
    mean_rows: float

    def to_json(self) -> dict[str, Any]:
        return {"num_reqs": self.num_reqs, "plan_ms": self.plan_ms, "layout_ms": self.layout_ms,
                "plan_and_layout_ms": self.total_ms, "mean_rows": self.mean_rows}


def layout_tiers(max_rows: int) -> tuple[int, ...]:
    """Graph tiers as a deployment captures them: dense for small steps, then doubling, up to B·N."""
    tiers = {8, 16, 24, 32, 48, 64, 96, 128, 192, 256}
    t = 384
    while t < max_rows:
        tiers.add(t)
        t = t * 3 // 2 if t & (t - 1) == 0 else t * 4 // 3  # 384, 512, 768, 1024, 1536, ...
    return tuple(sorted(x for x in tiers | {max_rows} if x <= max_rows))


class LayoutCase:
    """One batch size's engine-side calls: the planner's `plan_step`, then `plan_verify` of its plan."""

    def __init__(self, num_reqs: int, gamma: int, pool: int, seed: int) -> None:
        n = gamma + 1
        self.num_reqs = num_reqs
        table = tables(max(num_reqs, 2), n)["additive"][0]
        tiers = layout_tiers(num_reqs * n)
        self.plan = AdaptiveVerifyPlan(gamma=gamma, mode=VerifyMode.COMPACT, token_tiers=tiers,
                                       cost_model=table.to_format().model_dump(exclude={"fingerprint"}))
        self.shape = StepShape(page_size=PAGE_SIZE, num_draft_tokens=n, tiers=tiers, padding_request_rows=n)
        generator = torch.Generator().manual_seed(seed)
        self.logits = [torch.randn(num_reqs, gamma, generator=generator) * 1.5 + 2.0 for _ in range(pool)]
        pages = (PREFIX_LEN + n) // PAGE_SIZE + 1
        self.page_table = torch.arange(num_reqs * pages, dtype=torch.int32).view(num_reqs, pages)
        self.prefix = [PREFIX_LEN] * num_reqs
        self.slots, self.generations = list(range(num_reqs)), [1] * num_reqs
        self.device = torch.device("cpu")
        self.steps = [self.planning(i) for i in range(pool)]

    def planning(self, i: int) -> StepPlan:
        return self.plan.plan_step(self.logits[i % len(self.logits)], self.num_reqs, self.slots,
                                   self.generations)

    def layout(self, i: int, step: StepPlan | None = None) -> VerifyLayout:
        step = step or self.steps[i % len(self.steps)]
        return plan_verify(step.run_lens, step.verify_lens, self.prefix, self.page_table, self.shape,
                           self.device)

    def both(self, i: int) -> VerifyLayout:
        return self.layout(i, self.planning(i))


def layout_sides(batch_sizes: Sequence[int], gamma: int, pool: int,
                 seed: int) -> tuple[dict[str, Side], dict[int, float]]:
    """Each batch size's sides ("B<b>/plan", "B<b>/layout", "B<b>/both") and its mean rows per step."""
    sides: dict[str, Side] = {}
    mean_rows = {}
    for num_reqs in batch_sizes:
        case = LayoutCase(num_reqs, gamma, pool, seed)
        sides.update({f"B{num_reqs}/plan": case.planning, f"B{num_reqs}/layout": case.layout,
                      f"B{num_reqs}/both": case.both})
        mean_rows[num_reqs] = float(np.mean([sum(s.run_lens) for s in case.steps]))
    return sides, mean_rows


def run(args: argparse.Namespace) -> tuple[list[DecisionResult], list[LayoutResult]]:
    """Every side of both benchmarks interleaved in the same rounds, so that a burst of load elsewhere
    on the machine lands on all of them alike rather than on one table or batch size."""
    decisions, budgets = decision_sides(args.num_reqs, args.gamma, args.kinds, args.inputs, args.seed)
    layouts, rows = layout_sides(args.layout_batch_sizes, args.gamma, args.inputs, args.seed)
    ms = {name: 1e3 * seconds for name, seconds in
          interleaved({**decisions, **layouts}, args.rounds, args.calls).items()}
    return ([DecisionResult(kind, args.num_reqs, args.gamma, ms[f"{kind}/ours"], ms[f"{kind}/sglang"], budget)
             for kind, budget in budgets.items()],
            [LayoutResult(b, ms[f"B{b}/plan"], ms[f"B{b}/layout"], ms[f"B{b}/both"], mean)
             for b, mean in rows.items()])


# --- command line ------------------------------------------------------------------------------------------


def positive_ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers >= 1, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-reqs", type=int, default=256, help="B of the decision benchmark (default 256)")
    parser.add_argument("--gamma", type=int, default=7, help="drafts per request (default 7)")
    parser.add_argument("--tables", default="additive,sps-1d,tier",
                        help="table kinds of the decision benchmark (default additive,sps-1d,tier)")
    parser.add_argument("--layout-batch-sizes", type=positive_ints, default=[1, 8, 32, 128, 256],
                        help="B values of the planning + layout benchmark (default 1,8,32,128,256)")
    parser.add_argument("--rounds", type=int, default=201, help="interleaved rounds (default 201)")
    parser.add_argument("--calls", type=int, default=10, help="calls per side per round (default 10)")
    parser.add_argument("--inputs", type=int, default=16, help="distinct seeded inputs cycled (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = parser.parse_args(argv)
    kinds = [k for k in args.tables.split(",") if k]
    unknown = sorted(set(kinds) - {"additive", "sps-1d", "tier"})
    if unknown or not kinds:
        parser.error(f"--tables takes additive, sps-1d and tier, got {args.tables!r}")
    for name in ("num_reqs", "gamma", "rounds", "calls", "inputs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    args.kinds = kinds
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        decisions, layouts = run(args)
    except Disagreement as exc:
        print(f"bench_planner: error: {exc}", file=sys.stderr)
        return 1
    context = {"torch": torch.__version__, "numpy": np.__version__, "cpu_threads": torch.get_num_threads(),
               "rounds": args.rounds, "calls": args.calls, "inputs": args.inputs}
    if args.json:
        print(json.dumps({**context, "decisions": [d.to_json() for d in decisions],
                          "layouts": [r.to_json() for r in layouts]}, indent=2))
        return 0
    print(f"torch {context['torch']}, numpy {context['numpy']}, {context['cpu_threads']} CPU threads; median "
          f"of {args.rounds} interleaved rounds x {args.calls} calls over {args.inputs} seeded inputs")
    print()
    print(f"decision + allocation, B={args.num_reqs}, gamma={args.gamma} (both sides agree on every input)")
    print(f"{'table':>10}{'ours ms':>12}{'SGLang ms':>12}{'speedup':>10}{'mean budget':>14}")
    for d in decisions:
        print(f"{d.table:>10}{d.ours_ms:>12.4f}{d.sglang_ms:>12.4f}{d.speedup:>9.2f}x{d.mean_budget:>14.1f}")
    print()
    print(f"planning + layout per step (compact, additive table, tiers up to B*N), gamma={args.gamma}")
    print(f"{'B':>6}{'plan ms':>12}{'layout ms':>12}{'plan+layout ms':>16}{'mean rows':>12}")
    for r in layouts:
        print(f"{r.num_reqs:>6}{r.plan_ms:>12.4f}{r.layout_ms:>12.4f}{r.total_ms:>16.4f}{r.mean_rows:>12.1f}")
    print()
    additive = [d for d in decisions if d.table == "additive"]
    if additive:
        d = additive[0]
        print(f"target: additive decision + allocation >= {SPEEDUP_TARGET:g}x SGLang's torch path: "
              f"{d.speedup:.2f}x at B={d.num_reqs}, gamma={d.gamma}")
    for r in layouts:
        if r.num_reqs == LAYOUT_TARGET_B:
            print(f"target: planning + layout <= {LAYOUT_TARGET_MS:g} ms at B={LAYOUT_TARGET_B}: "
                  f"{r.total_ms:.4f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
