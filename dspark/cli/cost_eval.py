"""`dspark cost-eval`: how each cost model's budget choices would do against measured step times."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from dspark.formats.profile import ProfileResult
from dspark.formats.sts_shards import read_shards
from dspark.measure.cost_eval import evaluate_cost_models, fit_all_models, format_cost_eval
from dspark.runtime.planner.budget import ScheduleConfig
from dspark.runtime.planner.survival import survival_from_logits


def add_cost_eval_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `cost-eval` on an argparse subparsers object; run it with `run_cost_eval(args)`."""
    parser = subparsers.add_parser(
        "cost-eval",
        help="score the sps-1d, additive and tier tables by the budgets they make the planner choose",
        description="Fit every cost table from a profile and charge each the regret of its budgets "
                    "against the measured-optimal budget, on batches drawn from recorded STS survival.")
    parser.add_argument("profile", type=Path, help="profile.json written by `dspark profile`")
    parser.add_argument("--sts", type=Path, nargs="+", required=True, metavar="SHARD_OR_DIR",
                        help="STS shards (.pt with logits and prefix_mask) or directories of them")
    parser.add_argument("--m-bin", type=int, default=16,
                        help="M bin width of the additive fit (default: %(default)s)")
    parser.add_argument("--draws", type=int, default=64,
                        help="survival draws per profiled batch size (default: %(default)s)")
    parser.add_argument("--min-verify-len", type=int, default=1,
                        help="the planner's min_verify_len (default: %(default)s)")
    parser.add_argument("--max-verify-len", type=int, default=0,
                        help="the planner's max_verify_len (0 = N) (default: %(default)s)")
    parser.add_argument("--temperatures", default=None, metavar="T1,T2,...",
                        help="STS temperature per draft position (default 1.0 everywhere)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the survival draws (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def _temperatures(text: str | None, gamma: int) -> list[float] | None:
    if text is None:
        return None
    try:
        temps = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--temperatures must be comma-separated numbers, got {text!r}") from None
    if len(temps) != gamma:
        raise ValueError(f"--temperatures has {len(temps)} values but the shards have gamma={gamma} "
                         "positions; give one temperature per draft position")
    return temps


def run_cost_eval(args: argparse.Namespace) -> int:
    """`dspark cost-eval`: print the report (text or --json); bad input → message on stderr, exit 2."""
    try:
        result = ProfileResult.load(args.profile)
        if not result.grid:
            raise ValueError(f"{args.profile} is the profile of a static or cap-accept build: it measured "
                             "only B x N steps, so budgets of fewer rows cannot be scored against it; "
                             "profile a compact build of the deployment and pass its profile.json")
        logits = torch.tensor(read_shards(args.sts).logits, dtype=torch.float32)
        survival = survival_from_logits(logits, _temperatures(args.temperatures, logits.shape[1]))
        cfg = ScheduleConfig(gamma=logits.shape[1], min_verify_len=args.min_verify_len,
                             max_verify_len=args.max_verify_len)
        models = fit_all_models(result, args.m_bin)
        report = evaluate_cost_models(result, models, survival, cfg, draws_per_batch=args.draws,
                                      seed=args.seed)
    except (OSError, KeyError, TypeError, ValueError) as error:
        print(f"dspark: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(format_cost_eval(report), end="")
    return 0
