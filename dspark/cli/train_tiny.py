"""`dspark train-tiny`: train the small embedded target and draft pair on the Python standard library."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dspark.cli.common import CliError, require_positive


def add_train_tiny_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `train-tiny` to a `dspark` subparsers object; the parsed args carry their handler."""
    p = subparsers.add_parser(
        "train-tiny", help="train the small embedded target + draft model pair",
        description="Train the small byte-level target model and its speculative draft on this "
                    "interpreter's standard library (a held-out split is kept for evaluation), on the "
                    "CPU; print a JSON report. The budgets are step counts, so a retrain with the same "
                    "seed gives the same weights however busy the machine is.")
    p.add_argument("-o", "--out", type=Path, required=True, help="directory for the trained checkpoints")
    p.add_argument("--target-steps", type=int, default=None,
                   help="target training steps (default: 1300, about 17 minutes on two cores)")
    p.add_argument("--draft-steps", type=int, default=None,
                   help="draft training steps (default: 2000, about 10 minutes on two cores); the "
                        "draft is trained as `dspark train-draft` trains one (training.json has the command)")
    p.add_argument("--seed", type=int, default=0, help="training seed (default: 0)")
    p.set_defaults(handler=run_train_tiny)
    return p


def run_train_tiny(args: argparse.Namespace) -> int:
    require_positive("--target-steps", args.target_steps)
    require_positive("--draft-steps", args.draft_steps)
    if args.out.exists() and not args.out.is_dir():
        raise CliError(f"-o {args.out} is a file; pass a directory for the checkpoints")
    import dataclasses

    from dspark.train.tiny import TINY_DRAFT, TrainSettings, train_tiny

    steps = {} if args.draft_steps is None else {"steps": args.draft_steps}
    draft = dataclasses.replace(TINY_DRAFT, seed=args.seed, **steps)
    budgets = {} if args.target_steps is None else {"target_steps": args.target_steps}
    report = train_tiny(args.out, TrainSettings(seed=args.seed, draft=draft, **budgets))
    print(json.dumps(report, indent=2))
    return 0
