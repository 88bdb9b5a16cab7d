"""`dspark-compile`: compile deployment specs into generated packages and inspect the result."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark-compile", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("build", help="compile a spec into its generated package")
    p.add_argument("spec", type=Path)
    p.add_argument("-o", "--output", type=Path, help="package directory (default generated/<name>)")
    p.add_argument("--force", action="store_true", help="overwrite hand-edited generated files")
    _allow_stale(p)

    p = commands.add_parser("check", help="verify that generated/ matches what specs/ compile to")
    p.add_argument("--specs", type=Path, default=Path("specs"))
    p.add_argument("--generated", type=Path, default=Path("generated"))
    _allow_stale(p)

    p = commands.add_parser("diff", help="diff the packages two specs generate")
    p.add_argument("spec_a", type=Path)
    p.add_argument("spec_b", type=Path)
    _allow_stale(p)

    p = commands.add_parser("export-sglang",
                            help="print the SGLang launch flags and environment for a spec")
    p.add_argument("spec", type=Path)
    _allow_stale(p)

    p = commands.add_parser("graph", help="print the compile graph")
    p.add_argument("spec", type=Path)
    p.add_argument("--dot", action="store_true", help="print Graphviz DOT")

    p = commands.add_parser("explain", help="list the spec fields a generated file depends on")
    p.add_argument("spec", type=Path)
    p.add_argument("file", help="generated file name, e.g. attn_metadata.py")

    commands.add_parser("schema", help="print the spec's JSON schema")
    return parser


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
        diff = diff_files(a.files, b.files, f"a/{a.resolved.name}", f"b/{b.resolved.name}")
        sys.stdout.write(diff)
        return EXIT_DIFFERENT if diff else EXIT_OK
    if args.command == "graph":
        graph = compile_spec(args.spec).graph
        sys.stdout.write(render_dot(graph) if args.dot else render_text(graph))
        return EXIT_OK
    if args.command == "explain":
        package = compile_spec(args.spec)
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
    for problem in report.stale:
        sys.stdout.write(problem)
    if report.spec_errors:
        return EXIT_SPEC_ERROR
    if report.stale:
        print(f"dspark-compile check: {generated} is out of date; run `dspark-compile build "
              f"<spec>` for each changed spec and commit the result", file=sys.stderr)
        return EXIT_DIFFERENT
    print(f"dspark-compile check: {generated} matches {specs}")
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
