"""Static against compact, point by point: what does verifying fewer rows save?

Reads two directories written by `dspark profile`, one of a static (or cap-accept) build and one of
a compact build of the same deployment, and prints for every batch size B measured in both:

- the full step `M = B·N`: the static build's step against the compact build's static-sweep step
  (same rows; any difference is the packed layout and the mode's graph tiers);
- every compact grid point `M < B·N`: the compact step of M rows against the static step of the same
  B, which always runs `B·N` rows. `compact/static` below 1 is what verifying M rows saves.

    .venv/bin/dspark profile generated/tiny_cpu_static -o runs/prof_static --batch-sizes 1,8,32
    .venv/bin/dspark profile generated/tiny_cpu_compact -o runs/prof_compact --batch-sizes 1,8,32
    .venv/bin/python benchmarks/compare_profiles.py runs/prof_static runs/prof_compact [--json]

The two profiles must describe one deployment: their fingerprints (read from each directory's
sps_1d.json) may differ only in the verify mode and the graph tiers, and they must have been
measured at the same context length. The tiers are exempt because the mode sets them: a static build
captures one graph per batch size (tiers B·N), a compact build one per token tier; each step's time
includes the padding to its own build's tier, and the output names both tier sets.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.fingerprint import Fingerprint, FingerprintError
from dspark.formats.cost_tables import read_cost_table
from dspark.formats.json_io import FormatError
from dspark.formats.profile import ProfileResult
from dspark.measure.profiler import PROFILE_FILE, SPS_FILE
from dspark.modes import VerifyMode

# What the verify mode decides, so two builds of one deployment may differ in it (module docstring).
MODE_FIELDS = ("verify_mode", "tiers")
COMPARED_FIELDS = tuple(f.name for f in dataclasses.fields(Fingerprint) if f.name not in MODE_FIELDS)


class CompareError(ValueError):
    """Two profiles that cannot be compared, or a directory that holds no profile (says which)."""


@dataclass(frozen=True)
class ProfileDir:
    """One `dspark profile` output directory: its raw samples and the deployment's fingerprint."""

    directory: Path
    result: ProfileResult
    fingerprint: Fingerprint

    @property
    def mode(self) -> VerifyMode:
        return VerifyMode(self.fingerprint.verify_mode)

    @property
    def context_len(self) -> str:
        return self.result.meta.get("context_len", "")

    def medians(self) -> dict[tuple[int, int], float]:
        """Median seconds of every measured (B, M), static sweep and grid together."""
        return {(s.num_reqs, s.num_rows): s.median_seconds for s in (*self.result.static, *self.result.grid)}

    def describe(self) -> dict[str, Any]:
        plan = self.result.plan
        return {"directory": str(self.directory), "deployment": self.result.meta.get("deployment", ""),
                "verify_mode": self.mode.value, "tiers": list(self.fingerprint.tiers),
                "context_len": self.context_len, "repeats": plan.repeats, "warmup": plan.warmup,
                "num_draft_tokens": plan.num_draft_tokens}


def load_profile_dir(directory: Path) -> ProfileDir:
    """Read `profile.json` and the fingerprint of `sps_1d.json` (every profile writes both)."""
    if not directory.is_dir():
        raise CompareError(f"{directory}: not a directory; pass a directory `dspark profile -o` wrote")
    try:
        result = ProfileResult.load(directory / PROFILE_FILE)
        table = read_cost_table(directory / SPS_FILE)
    except FormatError as err:
        raise CompareError(str(err)) from None
    if table.fingerprint is None:
        raise CompareError(f"{directory / SPS_FILE} has no fingerprint, so the deployment it was measured "
                           "on is unknown; re-run `dspark profile` into that directory")
    try:
        fingerprint = Fingerprint.from_json(table.fingerprint)
    except FingerprintError as err:
        raise CompareError(f"{directory / SPS_FILE}: {err}") from None
    return ProfileDir(directory, result, fingerprint)


def check_comparable(static: ProfileDir, compact: ProfileDir) -> None:
    """Refuse profiles of different deployments, in the wrong order, or at different context lengths."""
    if static.mode.packs_rows or not compact.mode.packs_rows:
        swapped = static.mode.packs_rows and not compact.mode.packs_rows
        raise CompareError(f"expected a static (or cap-accept) profile first and a compact one second, got "
                           f"{static.mode} ({static.directory}) and {compact.mode} ({compact.directory})"
                           + ("; swap the two directories" if swapped else ""))
    pairs = {name: (getattr(static.fingerprint, name), getattr(compact.fingerprint, name))
             for name in COMPARED_FIELDS}
    lines = [f"{name}: static {mine!r}, compact {theirs!r}" for name, (mine, theirs) in pairs.items()
             if mine != theirs]
    if lines:
        raise CompareError(f"{static.directory} and {compact.directory} profile different deployments "
                           "(only the verify mode and its graph tiers may differ):\n  " + "\n  ".join(lines))
    if static.context_len != compact.context_len:
        raise CompareError(f"context_len: static measured with {static.context_len!r} cached tokens per "
                           f"request, compact with {compact.context_len!r}; profile both with the same "
                           "--context-len")


@dataclass(frozen=True)
class ComparedPoint:
    """One compact step against the static step of the same batch size."""

    num_reqs: int
    num_rows: int  # M of the compact step
    full_rows: int  # B·N: the rows of the static step
    static_seconds: float
    compact_seconds: float

    @property
    def ratio(self) -> float:
        return self.compact_seconds / self.static_seconds

    def to_json(self) -> dict[str, Any]:
        return {"num_reqs": self.num_reqs, "num_rows": self.num_rows, "full_rows": self.full_rows,
                "static_seconds": self.static_seconds, "compact_seconds": self.compact_seconds,
                "compact_over_static": self.ratio}


@dataclass(frozen=True)
class Comparison:
    static: ProfileDir
    compact: ProfileDir
    points: tuple[ComparedPoint, ...]
    only_static: tuple[int, ...]  # batch sizes the compact profile did not measure
    only_compact: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        common = {name: self.static.fingerprint.to_json()[name] for name in COMPARED_FIELDS}
        return {"static": self.static.describe(), "compact": self.compact.describe(), "deployment": common,
                "points": [p.to_json() for p in self.points],
                "batch_sizes_only_in_static": list(self.only_static),
                "batch_sizes_only_in_compact": list(self.only_compact)}


def compare(static: ProfileDir, compact: ProfileDir) -> Comparison:
    """Every compact point at a batch size the static profile measured, against that static step."""
    check_comparable(static, compact)
    full = {s.num_reqs: s for s in static.result.static}
    compact_times = compact.medians()
    compact_batches = {b for b, _ in compact_times}
    points = [ComparedPoint(b, m, full[b].num_rows, full[b].median_seconds, seconds)
              for (b, m), seconds in sorted(compact_times.items())
              if b in full and m <= full[b].num_rows]
    return Comparison(static, compact, tuple(points),
                      only_static=tuple(sorted(set(full) - compact_batches)),
                      only_compact=tuple(sorted(compact_batches - set(full))))


def format_comparison(comparison: Comparison) -> str:
    lines = []
    for side in (comparison.static, comparison.compact):
        d = side.describe()
        tiers = ",".join(map(str, d["tiers"])) or "none"
        lines.append(f"{d['verify_mode']:>10}  {d['deployment']}  ({d['directory']}): context_len "
                     f"{d['context_len']}, {d['repeats']} repeats, graph tiers {tiers}")
    fp = comparison.static.fingerprint
    lines += [f"same deployment: {fp.backend}/{fp.device} {fp.dtype}, target {fp.model_geometry} weights "
              f"{fp.model_weights or '?'}, gamma {fp.gamma}, tp {fp.tp} dp {fp.dp}, {fp.policy}", "",
              "compact step of M rows against the static step of the same B (B·N rows); "
              "compact/static < 1 is what verifying fewer rows saves",
              f"{'B':>6} {'M':>7} {'of B·N':>8} {'static ms':>11} {'compact ms':>11} {'compact/static':>15}"]
    for p in comparison.points:
        lines.append(f"{p.num_reqs:>6} {p.num_rows:>7} {p.num_rows / p.full_rows:>8.1%} "
                     f"{p.static_seconds * 1e3:>11.4f} {p.compact_seconds * 1e3:>11.4f} {p.ratio:>15.3f}")
    if not comparison.points:
        lines.append("  (no batch size was measured in both profiles)")
    for name, sizes in (("static", comparison.only_static), ("compact", comparison.only_compact)):
        if sizes:
            lines.append(f"batch sizes {list(sizes)} were measured in the {name} profile only")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("static_dir", type=Path, help="`dspark profile -o` of a static or cap-accept build")
    parser.add_argument("compact_dir", type=Path, help="`dspark profile -o` of a compact build")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON instead")
    args = parser.parse_args(argv)
    try:
        comparison = compare(load_profile_dir(args.static_dir), load_profile_dir(args.compact_dir))
    except CompareError as err:
        print(f"compare_profiles: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(comparison.to_json(), indent=2))
    else:
        print(format_comparison(comparison), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
