"""`dspark-compile`: compile deployment specs into generated packages and inspect the result."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dspark import __version__
from dspark.compiler.api import build, compile_spec
from dspark.compiler.check import check_generated
from dspark.compiler.diff import diff_files
from dspark.compiler.errors import CompileError
from dspark.compiler.explain import explain_file
from dspark.compiler.graph import render_dot, render_text
from dspark.compiler.sglang import sglang_launch
from dspark.spec import SpecError, load_spec, spec_json_schema

EXIT_OK, EXIT_DIFFERENT, EXIT_SPEC_ERROR = 0, 1, 2
DESCRIPTION = ("Compile a DSpark deployment spec (YAML) into a generated Python package, and inspect "
               "what a spec compiles to. A spec with problems is reported as FILE:LINE:COL: FIELD: "
               "message, with a hint, and nothing is written (exit status 2).")
EPILOG = ("exit status: 0 success; 1 differences found (check, diff) or a package that cannot be "
          "written; 2 invalid spec")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark-compile", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _command(commands, "build", "compile a spec into its generated package",
                 "Compile SPEC and write its package (default generated/<name>). Hand-edited files "
                 "in an existing package are not overwritten unless --force is given.")
    _spec(p)
    p.add_argument("-o", "--output", type=Path, metavar="DIR",
                   help="package directory (default generated/<name>)")
    p.add_argument("--force", action="store_true", help="overwrite hand-edited generated files")
    _allow_stale(p)

    p = _command(commands, "check", "verify that generated/ matches what specs/ compile to",
                 "Compile every *.yaml in the specs directory and compare with the generated "
                 "directory; prints a unified diff for each package that differs.")
    p.add_argument("--specs", type=Path, default=Path("specs"), metavar="DIR",
                   help="directory of specs (default specs)")
    p.add_argument("--generated", type=Path, default=Path("generated"), metavar="DIR",
                   help="directory of generated packages (default generated)")
    _allow_stale(p)

    p = _command(commands, "diff", "diff the packages two specs generate",
                 "Print the unified diff between the packages SPEC_A and SPEC_B compile to.")
    p.add_argument("spec_a", type=Path, metavar="SPEC_A", help="first spec file")
    p.add_argument("spec_b", type=Path, metavar="SPEC_B", help="second spec file")
    p.add_argument("--code-only", action="store_true",
                   help="compare code only: leave out manifest.json, the generated header "
                        "docstrings and the spec path/sha256 lines")
    _allow_stale(p)

    p = _command(commands, "export-sglang", "print the SGLang launch flags and environment for a spec",
                 "Print the SGLang launch command serving the same deployment, with a comment for "
                 "every spec field: the flag it became, or why SGLang has no equivalent.")
    _spec(p)
    _allow_stale(p)

    p = _command(commands, "graph", "print the compile graph",
                 "Print the compile graph of SPEC: spec sections, derived values and generated files.")
    _spec(p)
    p.add_argument("--dot", action="store_true", help="print Graphviz DOT")
    _allow_stale(p)

    p = _command(commands, "explain", "list the spec fields a generated file depends on",
                 "List the spec fields that FILE of SPEC's package depends on, with their lines.")
    _spec(p)
    p.add_argument("file", metavar="FILE", help="generated file name, e.g. attn_metadata.py")
    _allow_stale(p)

    _command(commands, "schema", "print the spec's JSON schema",
             "Print the JSON schema of the spec format (for editor completion and validation).")
    return parser


def _command(commands: Any, name: str, summary: str,
             description: str) -> argparse.ArgumentParser:
    return commands.add_parser(name, help=summary, description=description)


def _spec(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", type=Path, metavar="SPEC", help="deployment spec file (YAML)")


def _allow_stale(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-stale-tables", action="store_true",
                        help="compile with cost tables or calibrations whose fingerprint says they were "
                             "measured on a different deployment (the generated header warns)")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except SpecError as exc:
        print(exc.report(), file=sys.stderr)
        return EXIT_SPEC_ERROR
    except CompileError as exc:
        print(f"dspark-compile: {exc}", file=sys.stderr)
        return EXIT_DIFFERENT


def _run(args: argparse.Namespace) -> int:
    if args.command == "build":
        package = build(args.spec, args.output, force=args.force,
                        allow_stale_tables=args.allow_stale_tables)
        print(f"wrote {package.package_dir} ({len(package.files)} files)")
        return EXIT_OK
    if args.command == "check":
        return _check(args.specs, args.generated, args.allow_stale_tables)
    if args.command == "diff":
        a = compile_spec(args.spec_a, allow_stale_tables=args.allow_stale_tables)
        b = compile_spec(args.spec_b, allow_stale_tables=args.allow_stale_tables)
        diff = diff_files(a.files, b.files, f"a/{a.resolved.name}", f"b/{b.resolved.name}",
                          code_only=args.code_only)
        sys.stdout.write(diff)
        return EXIT_DIFFERENT if diff else EXIT_OK
    if args.command == "graph":
        graph = compile_spec(args.spec, allow_stale_tables=args.allow_stale_tables).graph
        sys.stdout.write(render_dot(graph) if args.dot else render_text(graph))
        return EXIT_OK
    if args.command == "explain":
        package = compile_spec(args.spec, allow_stale_tables=args.allow_stale_tables)
        try:
            sys.stdout.write(explain_file(package.resolved, package.graph, args.file))
        except KeyError as exc:
            raise CompileError(exc.args[0]) from None
        return EXIT_OK
    if args.command == "export-sglang":
        resolved = load_spec(args.spec, allow_stale_tables=args.allow_stale_tables)
        sys.stdout.write(sglang_launch(resolved).render())
        return EXIT_OK
    assert args.command == "schema"
    print(json.dumps(spec_json_schema(), sort_keys=True, indent=2))
    return EXIT_OK


def _check(specs: Path, generated: Path, allow_stale_tables: bool) -> int:
    report = check_generated(specs, generated, allow_stale_tables=allow_stale_tables)
    for error in report.spec_errors:
        print(error, file=sys.stderr)
    for problem in (*report.stale, *report.orphans):
        sys.stdout.write(problem)
    if report.spec_errors:
        return EXIT_SPEC_ERROR
    if report.stale:
        print(f"dspark-compile check: {generated} is out of date; run `dspark-compile build "
              f"<spec>` for each changed spec and commit the result", file=sys.stderr)
    if report.orphans:
        print(f"dspark-compile check: {generated} has packages that no spec in {specs} compiles to; "
              f"move each one's spec into {specs}/ or delete the package", file=sys.stderr)
    if report.stale or report.orphans:
        return EXIT_DIFFERENT
    print(f"dspark-compile check: {generated} matches {specs}")
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
