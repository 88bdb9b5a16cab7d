"""`dspark profile`: time a generated package's verify step and write the planner's cost tables."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark.cli.common import CliError, load_package_or_fail, require_non_negative, require_positive

if TYPE_CHECKING:
    from dspark.formats.profile import ProfileResult
    from dspark.runtime.planner.cost_models import AdditiveCostTable, SpsTable, TierCostTable


def add_profile_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `profile` to a `dspark` subparsers object; the parsed args carry their handler."""
    p = subparsers.add_parser(
        "profile", help="measure verify step times and fit the planner's cost tables",
        description="Time the deployment's own verify step on its backend over batch sizes B and verify "
                    "row counts M, fit the cost tables the planner reads (sps_1d.json, additive.json and, "
                    "with graph tiers, tier.json) and write them with the raw samples (profile.json). "
                    "Name a table in a spec with `cost_model: {type: additive, file: ...}`. A static or "
                    "cap-accept build runs B x N rows in every step: its profile is the static sweep "
                    "alone (sps_1d.json and profile.json), to compare with a compact build's.")
    p.add_argument("package", type=Path,
                   help="a generated package, e.g. generated/tiny_cpu_compact (every verify mode; only a "
                        "compact build has the (B, M) grid the additive and tier tables need)")
    p.add_argument("-o", "--out", type=Path, required=True,
                   help="directory for the tables and profile.json (created if missing)")
    p.add_argument("--batch-sizes", type=int_list, default=None, metavar="B1,B2,...",
                   help="comma-separated batch sizes, e.g. 1,8,32,64,128 (default: powers of two up to "
                        "the deployment's serving.max_running_requests); each must fit "
                        "max_running_requests and the KV pool at --context-len")
    p.add_argument("--grid-density", type=int, default=8,
                   help="row counts measured per batch size in the (B, M) grid (default: 8)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed steps per point; the median is kept (default: 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each point (default: 2)")
    p.add_argument("--m-bin", type=int, default=64,
                   help="row-count bin width of the additive fit (default: 64)")
    p.add_argument("--context-len", type=int_list, default=[128], metavar="L1,L2,...",
                   help="tokens already cached per request while timing (default: 128); several, "
                        "increasing, profile each and give the additive table a context term the planner "
                        "prices each step's mean context with (e.g. 128,512,900)")
    p.add_argument("--no-draft-time", action="store_true",
                   help="leave the draft's step time out of the tables (by default it is measured per "
                        "batch size and the planner adds it to the verify time)")
    p.add_argument("--no-decode-time", action="store_true",
                   help="leave the target-only decode step's time out of the tables (by default it is "
                        "measured per batch size, so the planner can switch speculation off where it "
                        "does not pay)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=profile_package)
    return p


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def check_profile_args(args: argparse.Namespace) -> None:
    for flag, value in (("--grid-density", args.grid_density), ("--repeats", args.repeats),
                        ("--m-bin", args.m_bin)):
        require_positive(flag, value)
    if not args.context_len:
        raise CliError("--context-len is empty; give one or more increasing lengths, e.g. 128,512,900")
    for length in args.context_len:
        require_positive("every --context-len value", length)
    if any(a >= b for a, b in zip(args.context_len, args.context_len[1:], strict=False)):
        raise CliError(f"--context-len values must increase, got {','.join(map(str, args.context_len))}")
    require_non_negative("--warmup", args.warmup)
    if args.batch_sizes is not None:
        if not args.batch_sizes:
            raise CliError("--batch-sizes is empty; give comma-separated batch sizes, e.g. 1,2,4")
        for b in args.batch_sizes:
            require_positive("every --batch-sizes value", b)
    if args.out.exists() and not args.out.is_dir():
        raise CliError(f"-o {args.out} is a file; pass a directory for the tables")


def median_seconds(measure: Callable[[], float], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        measure()
    return statistics.median(measure() for _ in range(repeats))


def profile_package(args: argparse.Namespace) -> int:
    """Profile at every `--context-len`, print the fit reports, write the tables (the additive table with a
    context term when several contexts were profiled). Raises `CliError` for anything the user can fix."""
    check_profile_args(args)
    pkg = load_package_or_fail(args.package)
    from dspark.fingerprint import fingerprint_of_deployment
    from dspark.runtime.engine.runtime import follows

    if follows(pkg):  # another rank of a torchrun launch ran rank 0's steps
        return 0
    lengths = args.context_len
    profiles = []
    for length in lengths:
        if len(lengths) > 1:
            print(f"\n=== context {length} tokens a request")
        profiles.append(profile_at(pkg, args, length))
    (tables, result, tiers), others = profiles[0], profiles[1:]
    if others:
        from dspark.measure.profiler import context_profile_file

        tables = with_context(tables, lengths, [p[0] for p in others])
        print(f"\nadditive table: priced at contexts {', '.join(map(str, lengths))} (interpolated between "
              f"them); the sps-1d and tier tables price context {lengths[0]}")
        args.out.mkdir(parents=True, exist_ok=True)
        for length, (_, other, _) in zip(lengths[1:], others, strict=True):
            path = other.save(args.out / context_profile_file(length))
            print(f"wrote the context {length} samples: {path}")
    fingerprint = fingerprint_of_deployment(pkg.deployment, tiers).to_json()
    return write_profile(args.out, tables, result, fingerprint)


def profile_at(pkg: Any, args: argparse.Namespace, context_len: int) -> tuple[FittedTables, ProfileResult,
                                                                               tuple[int, ...]]:
    """One context's profile, on a runtime of its own: the fitted tables with their draft and decode terms,
    the raw result and the graph tiers."""
    from dspark.measure.cost_fit import fit_draft_seconds
    from dspark.measure.profiler import ProfilePlan, rows_around, run_profile
    from dspark.measure.step_timer import ProfileError, VerifyStepTimer
    from dspark.runtime.distributed.dp_engine import MirroredForward
    from dspark.runtime.distributed.launch import LaunchError
    from dspark.runtime.engine.requests import RequestError
    from dspark.runtime.engine.runtime import Runtime

    try:
        runtime = Runtime(pkg)
    except (RequestError, LaunchError, ValueError) as err:
        raise CliError(str(err)) from None
    try:
        if runtime.dispatch is not None:  # DP attention: every DP rank runs each timed step alongside
            runtime.forward = MirroredForward(runtime.forward, runtime.dispatch)
        try:
            timer = VerifyStepTimer(runtime, context_len=context_len)
            tiers = runtime.tiers
            # Rows around the tiers are grid points; a build without a grid measures none of them.
            plan = ProfilePlan(batch_sizes=timer.batch_sizes(args.batch_sizes),
                               num_draft_tokens=timer.cap, min_verify_len=timer.floor,
                               grid_density=args.grid_density, repeats=args.repeats, warmup=args.warmup,
                               m_bin=args.m_bin, max_rows=tiers[-1] if tiers else None,
                               extra_rows=rows_around(tiers) if timer.packs_rows else ())
        except (RequestError, ProfileError, ValueError) as err:
            raise CliError(str(err)) from None
        dep = pkg.deployment
        meta = {"deployment": dep.name, "backend": dep.backend, "device": dep.device,
                "dtype": dep.model.dtype, "verify_mode": dep.verify_mode, "tiers": ",".join(map(str, tiers)),
                "context_len": str(context_len)}
        result = run_profile(timer, plan, progress=not args.no_progress, meta=meta)
        tables = fit_tables(result, tiers)
        probes = plan.batch_sizes
        if not args.no_draft_time:
            draft = tuple(median_seconds(lambda b=b: timer.draft_seconds(b), args.warmup, args.repeats)
                          for b in probes)
            tables = tables.with_term("draft", probes, fit_draft_seconds(draft))
            print(term_report("draft step (added to the verify time by the planner; measured→fitted where "
                              "it dipped)", probes, draft, tables.sps.draft_seconds))
        if not args.no_decode_time:
            decode = tuple(median_seconds(lambda b=b: timer.decode_seconds(b), args.warmup, args.repeats)
                           for b in probes)
            tables = tables.with_term("decode", probes, fit_draft_seconds(decode))
            print(term_report("target-only decode step (the planner's price of a step without "
                              "speculation; measured→fitted where it dipped)", probes, decode,
                              tables.sps.decode_seconds))
        if tables.tier_note:
            print(f"\n{tables.tier_note}")
        return tables, result, tiers
    finally:
        runtime.close()  # release the follower ranks of a torchrun launch


def with_context(base: FittedTables, lengths: list[int], others: list[FittedTables]) -> FittedTables:
    """`base` (profiled at lengths[0]) with the additive table's context term from the tables profiled at
    the other lengths, each read at the base table's probes (kept monotone)."""
    import numpy as np

    table = base.additive
    if table is None:  # a static or cap-accept build: no (B, M) grid, no additive table
        raise CliError("several --context-len values need the additive table, which only a compact build's "
                       "(B, M) grid fits; profile one context")

    def on(probes: tuple[int, ...], source_probes: tuple[int, ...], seconds: tuple[float, ...]
           ) -> tuple[float, ...]:
        values = np.maximum.accumulate(np.interp(probes, source_probes, seconds))
        return tuple(float(v) for v in values)

    rows: dict[str, list[Any]] = {key: [] for key in ("bias", "alpha", "theta", "draft", "decode")}
    for other in others:
        t = other.additive
        assert t is not None
        rows["bias"].append(t.bias_seconds)
        rows["alpha"].append(on(table.bs_probes, t.bs_probes, t.alpha_seconds))
        rows["theta"].append(on(table.m_probes, t.m_probes, t.theta_seconds))
        if table.draft_seconds:
            rows["draft"].append(on(table.draft_bs_probes, t.draft_bs_probes, t.draft_seconds))
        if table.decode_seconds:
            rows["decode"].append(on(table.decode_bs_probes, t.decode_bs_probes, t.decode_seconds))
    additive = dataclasses.replace(
        table, context_len=lengths[0], context_lens=tuple(lengths[1:]),
        context_bias_seconds=tuple(rows["bias"]),
        context_alpha_seconds=tuple(rows["alpha"]), context_theta_seconds=tuple(rows["theta"]),
        context_draft_seconds=tuple(rows["draft"]), context_decode_seconds=tuple(rows["decode"]))
    return dataclasses.replace(base, additive=additive)


@dataclasses.dataclass(frozen=True)
class FittedTables:
    """What one profile fits: the 1D table always, the additive and tier tables where there is a grid."""

    sps: SpsTable
    additive: AdditiveCostTable | None = None
    tier: TierCostTable | None = None
    tier_note: str = ""  # the tier fit's quality, or why no tier table was written

    def with_term(self, term: str, probes: tuple[int, ...], seconds: tuple[float, ...]) -> FittedTables:
        """Every table with the per-batch-size `term` ("draft" or "decode") measured at `probes`."""
        def add(table: Any) -> Any:
            return None if table is None else dataclasses.replace(
                table, **{f"{term}_bs_probes": probes, f"{term}_seconds": seconds})
        return dataclasses.replace(self, sps=add(self.sps), additive=add(self.additive), tier=add(self.tier))


def term_report(title: str, probes: tuple[int, ...], measured: tuple[float, ...],
                fitted: tuple[float, ...]) -> str:
    """A per-batch-size term's line: each probe's time, `measured→fitted` where the fit changed it."""
    return f"\n{title}\n" + "  ".join(f"B={b}:{s * 1e3:.4f}" + ("" if f == s else f"→{f * 1e3:.4f}")
                                     for b, s, f in zip(probes, measured, fitted, strict=True)) + "  (ms)"


def fit_tables(result: ProfileResult, tiers: tuple[int, ...]) -> FittedTables:
    """Fit and print the report: every table for a compact profile, the 1D table alone without a grid."""
    from dspark.measure.cost_fit import fit_sps_table, fit_tier_table
    from dspark.measure.profiler import fit_profile, format_fit_report, format_sweep_report

    if not result.grid:  # a static or cap-accept build: the static sweep is all there is
        sps = fit_sps_table(result.static_samples(), result.max_batch_tokens)
        print(format_sweep_report(result, sps), end="")
        return FittedTables(sps)
    sps, fit = fit_profile(result)
    print(format_fit_report(result, sps, fit), end="")
    if not tiers:
        return FittedTables(sps, fit.table)
    try:  # graph replay: a step costs its tier, which the tier table keeps exact
        tier_fit = fit_tier_table(result, tiers)
    except ValueError as err:  # e.g. batch sizes too small to reach the largest tier
        return FittedTables(sps, fit.table, tier_note=f"tier table not written: {err}")
    note = (f"tier table: RMS {tier_fit.rms_seconds * 1e3:.4f} ms   R² {tier_fit.r_squared:.5f}"
            + "".join(f"\n  note: {note}" for note in tier_fit.notes))
    return FittedTables(sps, fit.table, tier_fit.table, note)


def write_profile(out: Path, tables: FittedTables, result: ProfileResult,
                  fingerprint: dict[str, Any]) -> int:
    from dspark.measure.profiler import leftover_tables, write_tables

    try:
        written = write_tables(out, tables.sps, tables.additive, result, tables.tier, fingerprint)
    except OSError as err:
        raise CliError(f"cannot write the tables into {out}: {err.strerror or err}") from None
    for name, path in written.items():
        print(f"wrote {name}: {path}")
    for path in leftover_tables(out, written):
        print(f"note: {path} is from an earlier profile, not this one (its samples are not in "
              f"{out / 'profile.json'}); delete it or profile into another directory")
    return 0
