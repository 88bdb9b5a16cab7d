"""Entry point of a generated package: `python -m generated.<name> run …`."""

from __future__ import annotations

import argparse
from pathlib import Path

from dspark.runtime.cli import add_run_args, run_package


def main(package_dir: Path, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m generated.{package_dir.name}",
                                     description=f"Run the {package_dir.name} deployment.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_args(sub.add_parser("run", help="generate completions for prompts"))
    args = parser.parse_args(argv)
    return run_package(package_dir, args)
