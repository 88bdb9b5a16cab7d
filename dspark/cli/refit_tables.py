"""`dspark refit-tables DIR`: fit a profile directory's cost tables again from its `profile.json`.

Nothing is measured: the samples `dspark profile` saved are fitted by this dspark's fits (monotone:
more rows or more requests never cost less), the draft and decode terms and the fingerprint are
carried over from the tables already there (their times pooled where they dipped), and the tables are
replaced. For tables written before the fits were monotone, which the table files now refuse.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dspark.cli.common import CliError


def add_refit_tables_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "refit-tables", help="fit a profile directory's cost tables again from its profile.json",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", type=Path, help="a directory `dspark profile -o` wrote (with profile.json)")
    p.set_defaults(handler=refit_tables)
    return p


TERMS = ("draft", "decode")  # the per-batch-size terms a table may carry
Carried = tuple[dict[str, Any] | None, dict[str, tuple[tuple[int, ...], tuple[float, ...]]]]


def _carried(directory: Path) -> Carried:
    """The fingerprint and the per-batch-size terms (draft, decode: probes and seconds) the directory's
    tables agree on, read as plain JSON: the tables may be the non-monotone ones this command replaces,
    which the table reader refuses."""
    from dspark.formats.json_io import FormatError, read_json_file
    from dspark.measure.profiler import ADDITIVE_FILE, SPS_FILE, TIER_FILE

    seen: dict[str, tuple[Any, ...]] = {}
    for name in (SPS_FILE, ADDITIVE_FILE, TIER_FILE):
        path = directory / name
        if not path.is_file():
            continue
        try:
            data = read_json_file(path, "cost table", "profile the deployment again")
        except FormatError as err:
            raise CliError(str(err)) from None
        if not isinstance(data, dict):
            raise CliError(f"{path}: a cost table is a JSON object; profile the deployment again")
        seen[name] = (data.get("fingerprint"), *(data.get(f"{term}_{key}", []) for term in TERMS
                                                 for key in ("bs_probes", "seconds")))
    if len({repr(v) for v in seen.values()}) > 1:
        raise CliError(f"{directory}: the tables ({', '.join(seen)}) carry different fingerprints or draft "
                       "or decode times, so they are not one profile's; profile the deployment again")
    if not seen:
        return None, {}
    fingerprint, *lists = next(iter(seen.values()))
    terms = {}
    for term, probes, seconds in zip(TERMS, lists[0::2], lists[1::2], strict=True):
        numbers = isinstance(seconds, list) and all(isinstance(s, (int, float)) for s in seconds)
        if not (isinstance(probes, list) and all(isinstance(b, int) for b in probes) and numbers
                and len(probes) == len(seconds)):
            raise CliError(f"{directory}: the tables' {term}_bs_probes and {term}_seconds are not two lists "
                           "of one number per probe; profile the deployment again")
        if probes:
            terms[term] = (tuple(probes), tuple(float(s) for s in seconds))
    return fingerprint, terms


def refit_tables(args: argparse.Namespace) -> int:
    from dspark.cli.profile import fit_tables, term_report, write_profile
    from dspark.formats.json_io import FormatError
    from dspark.formats.profile import ProfileResult
    from dspark.measure.cost_fit import fit_draft_seconds
    from dspark.measure.profiler import PROFILE_FILE

    directory: Path = args.directory
    try:
        result = ProfileResult.load(directory / PROFILE_FILE)
    except FormatError as err:
        raise CliError(str(err)) from None
    fingerprint, terms = _carried(directory)
    try:
        tables = fit_tables(result, result.tiers)
        for term, (probes, seconds) in terms.items():
            fitted = fit_draft_seconds(seconds)
            tables = tables.with_term(term, probes, fitted)
            print(term_report(f"{term} step (carried over; pooled where it dipped)", probes, seconds, fitted))
    except ValueError as err:
        raise CliError(f"{directory / PROFILE_FILE}: {err}") from None
    if tables.tier_note:
        print(f"\n{tables.tier_note}")
    return write_profile(directory, tables, result, fingerprint)
