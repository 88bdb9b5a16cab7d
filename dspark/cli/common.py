"""What the `dspark` commands share: the error a user can fix, argument checks, loading a package.

A mistake the user can fix ends the command with one `dspark: error: ...` line and exit status 2,
never a traceback; a traceback is left for faults in dspark itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dspark.runtime.config import OnlineCostSettings
    from dspark.runtime.package import GeneratedPackage

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXAMPLE_PACKAGE = "generated/tiny_cpu_static"


class CliError(Exception):
    """A mistake in the command line or its inputs, said in words that tell the user what to do."""


def run_handler(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace,
                prog: str = "dspark") -> int:
    """Run a command; a `CliError` becomes one `PROG: error: ...` line and exit status 2."""
    try:
        return handler(args)
    except CliError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def require_positive(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise CliError(f"{flag} must be a positive integer, got {value}")


def require_non_negative(flag: str, value: int | None) -> None:
    if value is not None and value < 0:
        raise CliError(f"{flag} must be 0 or more, got {value}")


def load_package_or_fail(directory: Path) -> GeneratedPackage:
    """The generated package at `directory`, or a `CliError` saying what the path is instead."""
    if not directory.exists():
        raise CliError(f"{directory}: no such directory; pass a package built by "
                       f"`dspark-compile build SPEC`, e.g. {EXAMPLE_PACKAGE}")
    if not directory.is_dir():
        raise CliError(f"{directory} is a file, not a generated package directory; pass a package built "
                       f"by `dspark-compile build SPEC`, e.g. {EXAMPLE_PACKAGE}")
    from dspark.runtime.package import PackageError, load_package

    try:
        return load_package(directory)
    except (PackageError, ValueError, OSError) as err:  # ValueError: e.g. a broken tokenizer file
        raise CliError(str(err)) from None


def warn_if_dummy_weights(pkg: GeneratedPackage) -> None:
    """A loud warning on stderr when the deployment decodes with random weights (`load_format: dummy`)."""
    model, draft = pkg.deployment.model, pkg.deployment.draft
    dummy = [name for name, ref in (("target", model), ("draft", draft)) if ref.load_format == "dummy"]
    if dummy:
        print(f"WARNING: {pkg.deployment.name} runs with DUMMY (random) {' and '.join(dummy)} weights: "
              "its outputs are meaningless and drafts are rarely accepted. Use it to profile and "
              "benchmark a model size, not to serve.", file=sys.stderr)


def read_prompts_file(path: Path) -> list[str]:
    """The prompts of a file: a JSON list of strings (.json), or one prompt per non-blank line."""
    from dspark.corpus import load_prompts_file

    example = '["def main(", "import os"]'
    try:
        prompts = load_prompts_file(path)
    except FileNotFoundError:
        raise CliError(f"prompts file {path} not found") from None
    except IsADirectoryError:
        raise CliError(f"prompts file {path} is a directory; pass a .json list of strings or a text file "
                       "with one prompt per line") from None
    except UnicodeDecodeError:
        raise CliError(f"prompts file {path} is not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise CliError(f"prompts file {path} is not valid JSON ({err}); a .json prompts file holds a JSON "
                       f"list of strings, e.g. {example}") from None
    except ValueError as err:  # valid JSON of another shape
        raise CliError(f"{err}, e.g. {example}") from None
    except OSError as err:
        raise CliError(f"cannot read prompts file {path}: {err.strerror or err}") from None
    if not prompts:
        raise CliError(f"prompts file {path} holds no prompts")
    return prompts


def add_online_cost_args(p: argparse.ArgumentParser) -> None:
    """`--online-cost` / `--no-online-cost`, shared by `dspark run` and `dspark serve`."""
    cost = p.add_mutually_exclusive_group()
    cost.add_argument("--online-cost", dest="online_cost", action="store_true", default=None,
                      help="refit the additive cost table's knots from the decode steps' measured seconds "
                           "and swap the refitted table in between steps (the spec's online_cost settings, "
                           "else their defaults; default: as the spec's online_cost section says)")
    cost.add_argument("--no-online-cost", dest="online_cost", action="store_false",
                      help="keep the compiled cost table (and the step offset alone), whatever the spec says")


def online_cost_of(pkg: GeneratedPackage, flag: bool | None) -> OnlineCostSettings | None:
    """The online cost settings a run uses: the spec's, overridden by `--online-cost` (on, with the spec's
    settings or the defaults) or `--no-online-cost` (off)."""
    from dspark.runtime.config import OnlineCostSettings

    compiled = pkg.deployment.online_cost
    return {None: compiled, True: compiled or OnlineCostSettings(), False: None}[flag]
