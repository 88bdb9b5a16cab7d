"""Entry point of a generated package: `python -m generated.<name> run …` or `… serve`."""

from __future__ import annotations

import argparse
from pathlib import Path

from dspark.cli.main import add_run_args, add_serve_args, run_package, serve_package


def main(package_dir: Path, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m generated.{package_dir.name}",
                                     description=f"Run the {package_dir.name} deployment.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_args(sub.add_parser("run", help="generate completions for prompts"))
    add_serve_args(sub.add_parser("serve", help="serve the deployment over HTTP (OpenAI /v1/completions)"))
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve_package(package_dir, args)
    return run_package(package_dir, args)
