"""Run, serve, benchmark, profile and calibrate compiled DSpark speculative-decoding deployments.

A deployment is a package that `dspark-compile build SPEC` generates from a YAML spec, e.g.
generated/tiny_cpu_static. `dspark COMMAND --help` describes each command.
"""

from __future__ import annotations

import argparse

from dspark.cli.bench import add_bench_parser, run_bench
from dspark.cli.calibrate import add_calibrate_parser, run_calibrate
from dspark.cli.common import run_handler
from dspark.cli.cost_eval import add_cost_eval_parser, run_cost_eval
from dspark.cli.fit_confidence import add_fit_confidence_parser, run_fit_confidence
from dspark.cli.profile import add_profile_parser
from dspark.cli.refit_tables import add_refit_tables_parser
from dspark.cli.report import add_report_parser
from dspark.cli.run import add_run_parser
from dspark.cli.serve import add_serve_parser
from dspark.cli.simulate import add_simulate_parser
from dspark.cli.train_draft import add_train_draft_parser
from dspark.cli.train_tiny import add_train_tiny_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_run_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub).set_defaults(handler=run_bench)
    add_profile_parser(sub)
    add_refit_tables_parser(sub)
    add_calibrate_parser(sub).set_defaults(handler=run_calibrate)
    add_fit_confidence_parser(sub).set_defaults(handler=run_fit_confidence)
    add_cost_eval_parser(sub).set_defaults(handler=run_cost_eval)
    add_report_parser(sub)  # sets its own handler
    add_train_tiny_parser(sub)
    add_train_draft_parser(sub)
    add_simulate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_handler(args.handler, args)


if __name__ == "__main__":
    raise SystemExit(main())
