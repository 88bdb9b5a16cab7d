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
    from dspark.cli.profile import write_profile

    tables, result, fingerprint = refitted(args.directory)
    return write_profile(args.directory, tables, result, fingerprint)


def refitted(directory: Path) -> tuple[Any, Any, dict[str, Any] | None]:
    """The directory's tables fitted again from its samples (profile.json, and each further context's
    `profile_context_L.json` where the additive table has a context term, with that context's draft and
    decode times carried over from it), its profile.json's result, and the fingerprint."""
    from dspark.cli.profile import with_context
    from dspark.formats.json_io import FormatError, read_json_file
    from dspark.formats.profile import ProfileResult
    from dspark.measure.profiler import ADDITIVE_FILE, PROFILE_FILE, context_profile_file

    try:
        result = ProfileResult.load(directory / PROFILE_FILE)
    except FormatError as err:
        raise CliError(str(err)) from None
    fingerprint, terms = _carried(directory)
    tables = _fit(result, terms, directory / PROFILE_FILE)
    try:
        additive = (read_json_file(directory / ADDITIVE_FILE, "cost table", "profile the deployment again")
                    if (directory / ADDITIVE_FILE).is_file() else {})
    except FormatError as err:
        raise CliError(str(err)) from None
    lengths = additive.get("context_lens", []) if isinstance(additive, dict) else []
    if not lengths:
        return tables, result, fingerprint
    others = []
    for j, length in enumerate(lengths):
        path = directory / context_profile_file(length)
        try:
            other = ProfileResult.load(path)
        except FormatError as err:
            raise CliError(f"{err}; the additive table prices context {length} from it") from None
        carried = {term: (probes, tuple(float(v) for v in additive[f"context_{term}_seconds"][j]))
                   for term, (probes, _) in terms.items()}
        others.append(_fit(other, carried, path))
    return with_context(tables, [additive["context_len"], *lengths], others), result, fingerprint


def _fit(result: Any, terms: dict[str, tuple[tuple[int, ...], tuple[float, ...]]], source: Path) -> Any:
    """One context's tables from its samples, with the carried draft and decode times."""
    from dspark.cli.profile import fit_tables, term_report
    from dspark.measure.cost_fit import fit_draft_seconds

    try:
        tables = fit_tables(result, result.tiers)
        for term, (probes, seconds) in terms.items():
            fitted = fit_draft_seconds(seconds)
            tables = tables.with_term(term, probes, fitted)
            print(term_report(f"{term} step (carried over; pooled where it dipped)", probes, seconds, fitted))
    except ValueError as err:
        raise CliError(f"{source}: {err}") from None
    if tables.tier_note:
        print(f"\n{tables.tier_note}")
    return tables
