"""Parse YAML into plain data while remembering where every key and value came from.

`yaml.safe_load` throws positions away and silently keeps the last of two duplicate keys; a spec
error must point at a line, and a duplicate key is almost always a copy-paste mistake, so the
document is composed into nodes and converted by hand.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

from dspark.spec.errors import FieldPath, Location, SpecError, SpecIssue

_FLOAT_WITH_EXPONENT = re.compile(
    r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$|^[-+]?\.[0-9_]+[eE][-+]?[0-9]+$"
)


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-6` as a float.

    PyYAML implements YAML 1.1, whose float pattern needs a dot and a signed exponent, so `1e-6`
    would arrive as the string "1e-6" and fail validation with a confusing type error.
    """


_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", _FLOAT_WITH_EXPONENT, list("-+0123456789.")
)


@dataclass(frozen=True)
class YamlDocument:
    """Plain data plus the source position of every value (and of every mapping key)."""

    data: Any
    value_locations: dict[FieldPath, Location]
    key_locations: dict[FieldPath, Location]


def parse_yaml(text: str, file: str) -> YamlDocument:
    loader = _SpecLoader(text)
    try:
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        raise SpecError([_syntax_issue(exc, file)]) from None
    finally:
        loader.dispose()
    if node is None:
        raise SpecError([SpecIssue((), "the spec file is empty",
                                   "write a YAML mapping with at least name, model, draft and "
                                   "backend (see `dspark-compile schema`)",
                                   Location(file, 1, 1))])
    builder = _Builder(loader, file)
    data = builder.build(node, ())
    if builder.issues:
        raise SpecError(builder.issues)
    return YamlDocument(data, builder.value_locations, builder.key_locations)


def _location(mark: yaml.Mark, file: str) -> Location:
    return Location(file, mark.line + 1, mark.column + 1)


def _syntax_issue(exc: yaml.MarkedYAMLError, file: str) -> SpecIssue:
    mark = exc.problem_mark or exc.context_mark
    message = "; ".join(part for part in (exc.context, exc.problem) if part) or "invalid YAML"
    return SpecIssue(
        ("<yaml>",), f"YAML syntax error: {message}",
        "fix the YAML syntax at this position (indentation, a missing ':' or an unclosed quote "
        "or bracket are the usual causes)",
        _location(mark, file) if mark else Location(file, 1, 1),
    )


class _Builder:
    def __init__(self, loader: _SpecLoader, file: str) -> None:
        self._loader = loader
        self._file = file
        self.value_locations: dict[FieldPath, Location] = {}
        self.key_locations: dict[FieldPath, Location] = {}
        self.issues: list[SpecIssue] = []

    def build(self, node: yaml.Node, path: FieldPath) -> Any:
        self.value_locations[path] = _location(node.start_mark, self._file)
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path)
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*path, i)) for i, item in enumerate(node.value)]
        try:
            return self._loader.construct_object(node, deep=True)
        except yaml.MarkedYAMLError as exc:
            self.issues.append(_syntax_issue(exc, self._file))
            return None

    def _mapping(self, node: yaml.MappingNode, path: FieldPath) -> dict[str, Any]:
        self._loader.flatten_mapping(node)  # resolves `<<` merge keys like safe_load does
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key_location = _location(key_node.start_mark, self._file)
            key = self._loader.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                self.issues.append(SpecIssue(
                    path, f"mapping key {key!r} is not a string",
                    "spec keys are field names; see `dspark-compile schema`", key_location))
                continue
            if key in out:
                first = self.key_locations[(*path, key)]
                self.issues.append(SpecIssue(
                    (*path, key), f"duplicate key {key!r} (first defined at line {first.line})",
                    "remove one of the two definitions; YAML would silently keep only the last",
                    key_location))
                continue
            self.key_locations[(*path, key)] = key_location
            out[key] = self.build(value_node, (*path, key))
        return out


def locate(document: YamlDocument, path: FieldPath, *, key: bool = False) -> Location:
    """Position of `path`'s value (or its key), else of the nearest ancestor's key.

    Defaults and missing fields have no position of their own, so they point at the `section:`
    line of the mapping that should contain them.
    """
    if key and path in document.key_locations:
        return document.key_locations[path]
    if path in document.value_locations:
        return document.value_locations[path]
    for end in range(len(path) - 1, 0, -1):
        found = document.key_locations.get(path[:end]) or document.value_locations.get(path[:end])
        if found is not None:
            return found
    return document.value_locations[()]
