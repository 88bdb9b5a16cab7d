"""`dspark fit-confidence`: refit the draft's confidence head on recorded features, write a new draft."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dspark.formats.json_io import FormatError
from dspark.measure.head_fit import HeadFitSettings, format_head_fit, refit_draft
from dspark.runtime.planner.sts import CalibrationError


def add_fit_confidence_parser(subparsers: Any) -> argparse.ArgumentParser:
    defaults = HeadFitSettings()
    p = subparsers.add_parser(
        "fit-confidence", help="refit the draft's confidence head on served features (then re-record "
                               "and `dspark calibrate`)",
        description="Refit the confidence head's Linear layer so that the cumulative survival matches "
                    "the recorded prefix matches of served steps; write a copy of the draft with the "
                    "new head and a confidence_fit.json report. Record the shards with "
                    "`dspark run --record DIR --record-features` on a build that verifies every row "
                    "(static or cap-accept), under the policy the head is for.")
    p.add_argument("shards", nargs="+", type=Path, metavar="SHARDS",
                   help="shard files or directories (RUN/sts) recorded with --record-features")
    p.add_argument("--draft", type=Path, required=True,
                   help="the draft checkpoint directory the features were recorded with")
    p.add_argument("-o", "--out", type=Path, required=True,
                   help="new draft checkpoint directory to write (must not exist)")
    p.add_argument("--holdout", type=float, default=defaults.holdout_fraction,
                   help="share of request-steps held out of the fit and reported (default: %(default)s)")
    p.add_argument("--l2", type=float, default=defaults.l2,
                   help="pull of the weights towards the current head (default: %(default)s)")
    p.add_argument("--max-iter", type=int, default=defaults.max_iter,
                   help="L-BFGS iterations (default: %(default)s)")
    p.add_argument("--seed", type=int, default=defaults.seed,
                   help="seed of the held-out split (default: %(default)s)")
    return p


def run_fit_confidence(args: argparse.Namespace) -> int:
    try:
        settings = HeadFitSettings(holdout_fraction=args.holdout, l2=args.l2, max_iter=args.max_iter,
                                   seed=args.seed)
        fit, out = refit_draft(args.shards, args.draft, args.out, settings)
    except (CalibrationError, FormatError, OSError) as err:
        print(f"dspark fit-confidence: error: {err}", file=sys.stderr)
        return 2
    print(format_head_fit(fit), end="")
    print(f"wrote the draft with the refitted head: {out}\n"
          f"next: point draft.checkpoint at it, recompile, record a run and `dspark calibrate` it "
          f"(calibrations of the old head do not apply to this draft)")
    return 0
