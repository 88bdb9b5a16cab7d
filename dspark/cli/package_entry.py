"""Entry point of a generated package: `python -m generated.<name> run …` or `… serve`."""

from __future__ import annotations

import argparse
from pathlib import Path

from dspark.cli.common import run_handler
from dspark.cli.run import add_run_args, run_package
from dspark.cli.serve import add_serve_args, serve_package


def main(package_dir: Path, argv: list[str] | None = None) -> int:
    prog = f"python -m generated.{package_dir.name}"
    parser = argparse.ArgumentParser(
        prog=prog, description=f"Run or serve the {package_dir.name} deployment, compiled by dspark-compile.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="generate completions for prompts and print them with stats",
                         description=f"Generate completions for prompts with {package_dir.name} and print "
                                     "them, with tokens/s and tokens committed per decode step.")
    add_run_args(run)
    run.set_defaults(handler=lambda args: run_package(package_dir, args))
    serve = sub.add_parser("serve", help="serve the deployment over HTTP (OpenAI /v1/completions)",
                           description=f"Serve {package_dir.name} over HTTP: POST /v1/completions "
                                       "(OpenAI shapes, streaming), GET /v1/models, GET /health, "
                                       "GET /metrics.")
    add_serve_args(serve)
    serve.set_defaults(handler=lambda args: serve_package(package_dir, args))
    args = parser.parse_args(argv)
    return run_handler(args.handler, args, prog)
