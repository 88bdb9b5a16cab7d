"""`dspark report`: a Markdown report with plots from recorded runs, calibrations, profiles and benches."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dspark.report.inputs import load_inputs
from dspark.report.markdown import write_report


def add_report_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `report` to a `dspark` subparsers object; dispatch the parsed args to `run_report`."""
    p = subparsers.add_parser(
        "report",
        help="write a Markdown report with plots from recorded runs, calibration, profiles and benches",
        description="Summarise recorded runs (acceptance by draft position, reliability of the calibrated "
                    "survival, actual minus predicted tokens by batch size, lag, policy and tier), cost "
                    "models against measured step times, and throughput, as report.md with PNG plots.")
    p.add_argument("run_dirs", type=Path, nargs="*", metavar="RUN_DIR",
                   help="directories written by `dspark run ... --record RUN_DIR`")
    p.add_argument("-o", "--out", type=Path, required=True, metavar="REPORT_DIR",
                   help="directory for report.md and its PNG plots")
    p.add_argument("--calibration", type=Path, metavar="STS_JSON", help="STS calibration file (temperatures)")
    p.add_argument("--profile", type=Path, metavar="PROFILE_JSON", help="profile.json from `dspark profile`")
    p.add_argument("--tables", type=Path, nargs="+", default=[], metavar="TABLE_JSON",
                   help="cost-model tables to compare with the profile (sps_1d.json, additive.json, ...)")
    p.add_argument("--bench", type=Path, nargs="+", default=[], metavar="BENCH_JSON",
                   help="throughput results, the JSON that benchmarks/bench_modes.py --json writes")
    p.set_defaults(handler=run_report)
    return p


def run_report(args: argparse.Namespace) -> int:
    """`dspark report`: 0 on success, 2 when an input is missing or malformed (message on stderr)."""
    if not (args.run_dirs or args.calibration or args.profile or args.bench):
        print("dspark: error: nothing to report; give RUN_DIRs, --calibration, --profile or --bench",
              file=sys.stderr)
        return 2
    if args.tables and args.profile is None:
        print("dspark: error: --tables are compared with measured step times; also pass --profile "
              "PROFILE_JSON", file=sys.stderr)
        return 2
    try:
        inputs = load_inputs(args.run_dirs, args.calibration, args.profile, args.tables, args.bench)
        path = write_report(inputs, args.out)
    except ValueError as err:  # ReportError, and a calibration that does not fit the runs
        print(f"dspark: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"dspark: error: cannot write the report into {args.out}: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
