"""`dspark calibrate`: fit STS temperatures from recorder shards and write the calibration JSON."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dspark.formats.json_io import FormatError
from dspark.formats.sts_shards import StsMeta, read_shards, read_sts_meta
from dspark.measure.calibration import (
    fit_sts,
    format_fit_report,
    save_calibration,
)
from dspark.runtime.planner.calibration_metrics import DEFAULT_NUM_BINS
from dspark.runtime.planner.sts import (
    DEFAULT_GRID_POINTS,
    DEFAULT_T_MAX,
    DEFAULT_T_MIN,
    CalibrationError,
    default_grid,
)


def add_calibrate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `calibrate` subcommand to a `dspark` subparsers object and return its parser."""
    p = subparsers.add_parser(
        "calibrate", help="fit per-position STS temperatures from recorded (logits, prefix_mask) shards",
        description="Fit one temperature per draft position so that the cumulative survival "
                    "cumprod(sigmoid(z / T)) matches how often the greedy accepted prefix reaches each "
                    "draft; print before/after calibration metrics and write the calibration JSON.")
    p.add_argument("shards", nargs="+", type=Path, metavar="SHARDS",
                   help=".pt shard files, or directories whose .pt files are read (other files ignored)")
    p.add_argument("-o", "--out", type=Path, required=True, help="calibration JSON to write, e.g. sts.json")
    p.add_argument("--dataset", default=None,
                   help="name of the recorded load (default: the shard directory names)")
    p.add_argument("--bins", type=int, default=DEFAULT_NUM_BINS,
                   help="equal-width ECE bins over [0, 1] (default: %(default)s)")
    p.add_argument("--grid-points", type=int, default=DEFAULT_GRID_POINTS,
                   help="temperatures tried per position, log-spaced from --t-min to --t-max "
                        "(default: %(default)s)")
    p.add_argument("--t-min", type=float, default=DEFAULT_T_MIN,
                   help="smallest temperature tried (default: %(default)s)")
    p.add_argument("--t-max", type=float, default=DEFAULT_T_MAX,
                   help="largest temperature tried (default: %(default)s)")
    p.add_argument("--survival-map", type=int, default=0, metavar="BINS",
                   help="also fit a monotone map per position on the survival after the temperatures, from "
                        "BINS quantile groups cut again at multiples of 1/15 (isotonic; 10 is online "
                        "calibration's), written as the file's survival_map; for curves no temperature fits "
                        "(default: 0, none)")
    return p


def default_dataset_name(shards: list[Path]) -> str:
    """The directories the shards live in (a directory argument names itself), comma-joined, in order."""
    names: list[str] = []
    for shard in shards:
        directory = shard if shard.is_dir() else shard.parent
        resolved = directory.resolve()
        # `dspark run --record RUN` writes RUN/sts/: the run directory names the load.
        name = resolved.parent.name if resolved.name == "sts" else resolved.name
        if name not in names:
            names.append(name)
    return ",".join(names)


def recorded_under(shards: list[Path]) -> dict[str, Any]:
    """The policy and fingerprint the recorder wrote beside the shards (`meta.json`), which the
    calibration file carries so the compiler can refuse it for another deployment or policy."""
    seen: dict[Path, StsMeta] = {}
    for shard in shards:
        directory = shard if shard.is_dir() else shard.parent
        if directory not in seen and (meta := read_sts_meta(directory)) is not None:
            seen[directory] = meta
    values = [{k: v for k, v in (("policy", m.policy), ("fingerprint", m.fingerprint)) if v is not None}
              for m in seen.values()]
    if any(v != values[0] for v in values[1:]):
        raise CalibrationError("the shards were recorded under different policies or deployments ("
                               + "; ".join(f"{directory / 'meta.json'}: {v}"
                                           for directory, v in zip(seen, values, strict=True))
                               + "); calibrate each policy and deployment separately")
    return values[0] if values else {}


def run_calibrate(args: argparse.Namespace) -> int:
    """Fit, print the report, write `args.out`; on bad input print why on stderr, write nothing, return 2."""
    try:
        if args.bins < 1:
            raise CalibrationError(f"--bins must be >= 1, got {args.bins}")
        grid = default_grid(args.grid_points, args.t_min, args.t_max)
        data = read_shards(args.shards)
        fit = fit_sts(data, grid=grid, num_bins=args.bins, map_bins=args.survival_map)
        dataset = args.dataset if args.dataset is not None else default_dataset_name(args.shards)
        recorded = recorded_under(args.shards)
        print(format_fit_report(fit, recorded.get("policy")), end="")
        path = save_calibration(args.out, fit, dataset, extra=recorded)
    except (CalibrationError, FormatError, OSError) as err:
        print(f"dspark calibrate: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote STS calibration ({fit.num_samples} rows from {len(data.sources)} shard(s), "
          f"dataset {dataset!r}): {path}")
    return 0
