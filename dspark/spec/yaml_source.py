"""Parse YAML into plain data while remembering where every key and value came from.

`yaml.safe_load` throws positions away and silently keeps the last of two duplicate keys; a spec
error must point at a line, and a duplicate key is almost always a copy-paste mistake, so the
document is composed into nodes and converted by hand. The conversion refuses what a spec never
needs and a hostile file could abuse: explicit tags (`!!python/...`, `!!binary`, `!custom`), values
that are not finite numbers (`.nan`, `.inf`, `1e400`), and alias expansion beyond `MAX_VALUES`.

Aliases stay allowed (`<<: *defaults` is a common way to share settings), so expansion is what is
bounded: a "billion laughs" document is a few lines whose aliases multiply into billions of
values. Counting every value built (merged keys included) and stopping at `MAX_VALUES` keeps
time and memory bounded whatever the aliases do, while refusing aliases outright would break
honest specs for no gain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import yaml

from dspark.spec.errors import FieldPath, Location, SpecError, SpecIssue
from dspark.spec.yaml_syntax import MAX_DEPTH, SpecLoader, mark_location, syntax_issue

# A spec has about a hundred values; the largest inline tables a few thousand.
MAX_VALUES = 20_000
_MERGE_TAG = "tag:yaml.org,2002:merge"
_Pair = tuple[yaml.Node, yaml.Node]  # (key node, value node)
_NO_TAGS_HINT = ("remove the tag: a spec holds plain YAML mappings, lists, strings, numbers and "
                 "booleans (quote a value to make it a string)")


@dataclass(frozen=True)
class YamlDocument:
    """Plain data plus the source position of every value (and of every mapping key).

    `issues` are problems found while converting (tags, non-finite numbers, duplicate keys, ...);
    the value at each such path is left out or None, so validating `data` may report the same
    path again, which the loader drops in favour of the issue here.
    """

    data: Any
    value_locations: dict[FieldPath, Location]
    key_locations: dict[FieldPath, Location]
    issues: tuple[SpecIssue, ...] = field(default=())


class _TooLarge(Exception):
    def __init__(self, mark: yaml.Mark, reason: str) -> None:
        super().__init__(reason)
        self.mark, self.reason = mark, reason


def parse_yaml(text: str, file: str) -> YamlDocument:
    """Raises `SpecError` for text that is not one YAML document or expands beyond the limits;
    returns every other problem in `YamlDocument.issues`."""
    try:
        loader = SpecLoader(text)  # the reader refuses control characters here already
        try:
            node = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise SpecError([syntax_issue(exc, text, file)]) from None
    if node is None:
        raise SpecError([SpecIssue((), "the spec file is empty",
                                   "write a YAML mapping with at least name, model, draft and "
                                   "backend (see `dspark-compile schema`)",
                                   Location(file, 1, 1))])
    builder = _Builder(loader, file)
    try:
        data = builder.build(node, (), 0)
    except _TooLarge as exc:
        blamed = loader.alias_marks[0] if loader.alias_marks else exc.mark
        alias = " (YAML aliases repeat what they refer to; the first alias is here)" \
            if loader.alias_marks else ""
        raise SpecError([SpecIssue((), f"{exc.reason}{alias}",
                                   "write the values out, or use far fewer aliases; a spec has "
                                   "about a hundred values", mark_location(blamed, file))]) from None
    return YamlDocument(data, builder.value_locations, builder.key_locations, tuple(builder.issues))


class _Builder:
    def __init__(self, loader: SpecLoader, file: str) -> None:
        self._loader = loader
        self._file = file
        self._built = 0
        self._open: set[int] = set()  # nodes being built: meeting one again is a recursive alias
        self._reported: set[int] = set()  # nodes already blamed (a merged mapping is read per use)
        self.value_locations: dict[FieldPath, Location] = {}
        self.key_locations: dict[FieldPath, Location] = {}
        self.issues: list[SpecIssue] = []

    def build(self, node: yaml.Node, path: FieldPath, depth: int, alias: yaml.Mark | None = None) -> Any:
        """`alias`: where the alias that led here is written, when the node was reached through one."""
        self._count(node, depth)
        self.value_locations[path] = self._at(node)
        if self._tagged(node, path):
            return None
        if id(node) in self._open:
            self.issues.append(SpecIssue(path, "a recursive alias: this value contains itself",
                                         "replace the alias with the values it should stand for",
                                         mark_location(alias, self._file) if alias else self._at(node)))
            return None
        if isinstance(node, yaml.ScalarNode):
            return self._scalar(node, path)
        self._open.add(id(node))
        try:
            if isinstance(node, yaml.MappingNode):
                out = {}
                for key, (key_node, value) in self._pairs(node, path, depth).items():
                    self.key_locations[(*path, key)] = self._at(key_node)
                    out[key] = self.build(value, (*path, key), depth + 1,
                                          self._loader.alias_uses.get((id(node), id(key_node))))
                return out
            return [self.build(item, (*path, i), depth + 1, self._loader.alias_uses.get((id(node), i)))
                    for i, item in enumerate(node.value)]
        finally:
            self._open.discard(id(node))

    def _count(self, node: yaml.Node, depth: int) -> None:
        self._built += 1
        if self._built > MAX_VALUES:
            raise _TooLarge(node.start_mark, f"the spec expands to more than {MAX_VALUES} values")
        if depth > MAX_DEPTH:
            raise _TooLarge(node.start_mark, f"the spec nests deeper than {MAX_DEPTH} levels")

    def _scalar(self, node: yaml.ScalarNode, path: FieldPath) -> Any:
        try:
            value = self._loader.construct_object(node, deep=True)
        except yaml.MarkedYAMLError as exc:
            self._issue(node, path, f"cannot read the value {node.value!r}: {exc.problem}",
                        "quote it to make it a string")
            return None
        except ValueError:  # an integer with more digits than Python converts (4300)
            self._issue(node, path, f"the number {_short(node.value)} has too many digits to read",
                        "write a realistic value")
            return None
        if isinstance(value, float) and not math.isfinite(value):
            what = "is not a number" if math.isnan(value) else "is infinite"
            if not node.value.lstrip("+-").startswith("."):
                what = f"is too large for a floating-point number (it reads as {value})"
            self._issue(node, path, f"{_short(node.value)} {what}",
                        "write a finite number; no spec field takes NaN or infinity")
            return None
        return value

    def _pairs(self, node: yaml.MappingNode, path: FieldPath, depth: int) -> dict[str, _Pair]:
        """Key -> (key node, value node) of a mapping, `<<` merges resolved: the mapping's own keys
        win, then earlier merged mappings over later ones (as YAML's merge key specifies)."""
        own: dict[str, _Pair] = {}
        merged: dict[str, _Pair] = {}
        for key_node, value_node in node.value:
            self._count(key_node, depth)
            if key_node.tag == _MERGE_TAG and id(key_node) not in self._loader.explicit_tags:
                for key, pair in self._merged(value_node, path, depth).items():
                    merged.setdefault(key, pair)
                continue
            key = self._key(key_node, path)
            if key is None:
                continue
            if key in own:
                first = own[key][0].start_mark.line + 1
                self._issue(key_node, (*path, key), f"duplicate key {key!r} (first defined at line {first})",
                            "remove one of the two definitions; YAML would silently keep only the last")
                continue
            own[key] = (key_node, value_node)
        for key, pair in merged.items():
            own.setdefault(key, pair)
        return own

    def _merged(self, source: yaml.Node, path: FieldPath, depth: int) -> dict[str, _Pair]:
        if self._tagged(source, path):
            return {}
        sources = source.value if isinstance(source, yaml.SequenceNode) else [source]
        out: dict[str, _Pair] = {}
        for item in sources:
            if not isinstance(item, yaml.MappingNode) or self._tagged(item, path):
                self._issue(item, path, "a `<<` merge takes a mapping or a list of mappings",
                            "merge an alias of a mapping, e.g. `<<: *defaults`")
                continue
            if id(item) in self._open:
                self._issue(item, path, "a recursive merge: this mapping merges itself",
                            "merge a mapping defined outside this one")
                continue
            self._open.add(id(item))
            try:
                for key, pair in self._pairs(item, path, depth + 1).items():
                    self._count(pair[1], depth)
                    out.setdefault(key, pair)
            finally:
                self._open.discard(id(item))
        return out

    def _key(self, node: yaml.Node, path: FieldPath) -> str | None:
        if self._tagged(node, (*path, node.value if isinstance(node, yaml.ScalarNode) else "?")):
            return None
        if not isinstance(node, yaml.ScalarNode):
            kind = "a mapping" if isinstance(node, yaml.MappingNode) else "a list"
            self._issue(node, (*path, "?"), f"a mapping key is {kind}",
                        "spec keys are field names; see `dspark-compile schema`")
            return None
        key = self._scalar(node, (*path, node.value))
        if not isinstance(key, str):  # unless _scalar already said why it could not read it
            self._issue(node, (*path, node.value), f"mapping key {key!r} is not a string",
                        "spec keys are field names; see `dspark-compile schema`")
            return None
        return key

    def _tagged(self, node: yaml.Node, path: FieldPath) -> bool:
        tagged = self._loader.explicit_tags.get(id(node))
        if tagged is not None:
            tag, mark = tagged
            if id(node) not in self._reported:
                self._reported.add(id(node))
                self.issues.append(SpecIssue(path, f"YAML tag {_tag_name(tag)!r} is not allowed",
                                             _NO_TAGS_HINT, mark_location(mark, self._file)))
        return tagged is not None

    def _issue(self, node: yaml.Node, path: FieldPath, message: str, hint: str) -> None:
        if id(node) not in self._reported:
            self._reported.add(id(node))
            self.issues.append(SpecIssue(path, message, hint, self._at(node)))

    def _at(self, node: yaml.Node) -> Location:
        return mark_location(node.start_mark, self._file)


def _tag_name(tag: str) -> str:
    return "!!" + tag.removeprefix("tag:yaml.org,2002:") if tag.startswith("tag:yaml.org,2002:") \
        else tag


def _short(text: str, limit: int = 40) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


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
