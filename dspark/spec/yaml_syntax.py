"""The YAML parser the spec loader uses, and the positioned issue for text it cannot parse.

The loader is PyYAML's safe loader with three changes: `1e-6` reads as a float, composing records
every explicit tag and every alias (so the builder can refuse tags with their position, and blame
the first alias when expansion grows too large), and nesting is capped before Python's recursion
limit turns a deeply nested document into a traceback.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from dspark.spec.errors import Location, SpecIssue

# No spec comes close: the deepest path is cost_model.step_seconds[i][j], five levels.
MAX_DEPTH = 32

_FLOAT_WITH_EXPONENT = re.compile(
    r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$|^[-+]?\.[0-9_]+[eE][-+]?[0-9]+$"
)
SYNTAX_PATH = ("<yaml>",)


class SpecLoader(yaml.SafeLoader):
    """SafeLoader that reads `1e-6` as a float and records tags and aliases while composing.

    PyYAML implements YAML 1.1, whose float pattern needs a dot and a signed exponent, so `1e-6`
    would arrive as the string "1e-6" and fail validation with a confusing type error.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.explicit_tags: dict[int, tuple[str, yaml.Mark]] = {}  # id(node) -> tag, where written
        self.alias_marks: list[yaml.Mark] = []
        # (id(parent), position) -> where an alias was written: an alias composes to the node it
        # names, so its own position is only known here. The position is the item index in a
        # sequence, id(key node) in a mapping.
        self.alias_uses: dict[tuple[int, int], yaml.Mark] = {}
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self.alias_marks.append(event.start_mark)
            if parent is not None and index is not None:
                self.alias_uses[(id(parent), index if isinstance(index, int) else id(index))] = \
                    event.start_mark
            return super().compose_node(parent, index)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"the document nests deeper than {MAX_DEPTH} levels", event.start_mark)
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        tag = getattr(event, "tag", None)
        if tag is not None:
            self.explicit_tags[id(node)] = (tag, event.start_mark)
        return node


SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", _FLOAT_WITH_EXPONENT, list("-+0123456789.")
)


def mark_location(mark: yaml.Mark, file: str) -> Location:
    return Location(file, mark.line + 1, mark.column + 1)


def syntax_issue(exc: yaml.YAMLError, text: str, file: str) -> SpecIssue:
    """The issue for text PyYAML cannot parse, at the position where the mistake starts."""
    hint = ("fix the YAML syntax at this position (indentation, a missing ':' or an unclosed quote "
            "or bracket are the usual causes)")
    if isinstance(exc, yaml.reader.ReaderError):
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        return SpecIssue(SYNTAX_PATH, f"YAML cannot contain the control character "
                                      f"{chr(exc.character)!r} (code point {exc.character:#x})",
                         "remove it, or write it as an escape inside a double-quoted string",
                         Location(file, line, column))
    if not isinstance(exc, yaml.MarkedYAMLError):
        return SpecIssue(SYNTAX_PATH, f"YAML syntax error: {exc}", hint, Location(file, 1, 1))
    mark, other = _blamed_mark(exc)
    message = "; ".join(part for part in (exc.context, exc.problem) if part) or "invalid YAML"
    if other is not None and mark is not None and other.line != mark.line:
        message += f" (line {other.line + 1})"
    return SpecIssue(SYNTAX_PATH, f"YAML syntax error: {message}", hint,
                     mark_location(mark, file) if mark else Location(file, 1, 1))


def _blamed_mark(exc: yaml.MarkedYAMLError) -> tuple[yaml.Mark | None, yaml.Mark | None]:
    """(where the mistake is, the other mark). A token or flow collection that never ends is
    reported where it starts (an unclosed quote: the opening quote, not the end of the file); other
    errors where the parser stopped."""
    context = exc.context or ""
    starts_there = context.startswith(("while scanning a", "while parsing a flow"))
    if exc.context_mark is not None and (starts_there or exc.problem_mark is None):
        return exc.context_mark, exc.problem_mark
    return exc.problem_mark, exc.context_mark
