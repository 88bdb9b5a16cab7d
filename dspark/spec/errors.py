"""Spec diagnostics: every problem is reported with the YAML position it concerns and a hint."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

FieldPath = tuple[str | int, ...]


def format_path(path: FieldPath) -> str:
    """Render `("graph", "token_tiers", 2)` as `graph.token_tiers[2]`."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out or "<spec>"


@dataclass(frozen=True)
class Location:
    """A 1-based position in a source file."""

    file: str
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


@dataclass(frozen=True)
class SpecIssue:
    """One problem found in a spec: where it is, what is wrong, and what to do about it."""

    path: FieldPath
    message: str
    hint: str
    location: Location | None = None

    def at(self, location: Location) -> SpecIssue:
        return SpecIssue(self.path, self.message, self.hint, location)

    def format(self) -> str:
        where = f"{self.location}: " if self.location else ""
        text = f"{where}{format_path(self.path)}: {self.message}"
        if self.hint:
            text += f"\n    hint: {self.hint}"
        return text


class SpecError(Exception):
    """A spec could not be loaded; `issues` lists every problem found, in source order."""

    def __init__(self, issues: Iterable[SpecIssue]) -> None:
        self.issues: Sequence[SpecIssue] = tuple(issues)
        if not self.issues:
            raise ValueError("SpecError needs at least one issue")
        super().__init__(self.report())

    def report(self) -> str:
        return "\n".join(issue.format() for issue in self.issues)

    def __str__(self) -> str:
        return self.report()
