"""Turn pydantic validation errors into positioned spec issues with actionable hints."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import ValidationError

from dspark.formats.fields import FieldValueError
from dspark.spec.errors import SpecIssue, format_path
from dspark.spec.introspect import FieldTarget, literal_options, model_at, resolve_loc
from dspark.spec.yaml_source import YamlDocument, locate

_SCHEMA_HINT = "see `dspark-compile schema` for every field and its documentation"
_TYPE_NAMES = {
    "int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
    "string_type": "a string", "tuple_type": "a list", "list_type": "a list",
    "model_type": "a mapping", "dict_type": "a mapping", "model_attributes_type": "a mapping",
    "model_mapping": "a mapping",  # the target model's sections, told apart by family
}


def issues_from_validation(error: ValidationError, document: YamlDocument) -> list[SpecIssue]:
    issues = []
    for detail in error.errors():
        target = resolve_loc(tuple(detail["loc"]))
        kind = detail["type"]
        if kind == "missing":
            issue = _missing(target, document)
        elif kind == "extra_forbidden":
            issue = _extra(detail, target, document)
        else:
            issue = SpecIssue(target.path, _message(detail), _hint(detail, target),
                              locate(document, target.path))
        issues.append(issue)
    return issues


def _missing(target: FieldTarget, document: YamlDocument) -> SpecIssue:
    name, parent = target.path[-1], target.path[:-1]
    where = f"under `{format_path(parent)}`" if parent else "at the top level"
    doc = f" ({target.field.description})" if target.field and target.field.description else ""
    return SpecIssue(target.path, "required field is missing",
                     f"add `{name}:` {where}{doc}", locate(document, target.path))


def _extra(detail: Any, target: FieldTarget, document: YamlDocument) -> SpecIssue:
    name = str(target.path[-1])
    model = model_at(tuple(detail["loc"][:-1]))
    allowed = sorted(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
    hint = f"did you mean `{close[0]}`? " if close else ""
    hint += f"allowed keys here: {', '.join(allowed)}" if allowed else _SCHEMA_HINT
    return SpecIssue(target.path, f"unknown key {name!r}", hint,
                     locate(document, target.path, key=True))


def _message(detail: Any) -> str:
    error = (detail.get("ctx") or {}).get("error")
    if detail["type"] == "value_error" and error is not None:
        return str(error)
    return str(detail["msg"])


def _hint(detail: Any, target: FieldTarget) -> str:
    error = (detail.get("ctx") or {}).get("error")
    if isinstance(error, FieldValueError) and error.hint:
        return error.hint
    kind = detail["type"]
    doc = target.field.description if target.field and target.field.description else ""
    if kind == "literal_error":
        options = literal_options(target.field)
        close = difflib.get_close_matches(str(detail.get("input")), options, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return hint + f"use one of: {', '.join(options)}"
    if kind == "cost_model_type":
        return ("write `type: sps-1d`, `type: additive` or `type: tier`, then either `file: PATH` or "
                "the table's fields inline")
    if kind == "calibration_type":
        return "write `file: PATH` (a calibration JSON file) or `temperatures: [...]` (one per draft)"
    if kind == "finite_number":
        return "write a finite number; no spec field takes NaN or infinity"
    if kind in _TYPE_NAMES:
        value = detail.get("input")
        hint = f"expected {_TYPE_NAMES[kind]}, got {type(value).__name__} {_short_repr(value)}"
        if isinstance(value, str) and kind in ("int_type", "float_type", "bool_type"):
            hint += " (remove the quotes)"
        return f"{hint}; {doc}" if doc else hint
    return doc or _SCHEMA_HINT


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
