"""Reading and writing the JSON files of dspark's formats, with errors that name the file, line and field.

Every format module reads through these helpers, so a damaged file fails the same way whichever
command reads it: a `FormatError` whose message starts with the file (and line) and names the field.
The field readers are strict in the way JSON needs: `true` is not the count 1, `"7"` is not 7, and a
number must be finite.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dspark.atomic import atomic_write_text


class FormatError(ValueError):
    """A file or JSON object does not match its format; the message names where and which field."""


class StrictJsonError(FormatError):
    """Text that is not strict JSON: `problem` says what, `line` where (when known), `hint` what to do."""

    def __init__(self, problem: str, hint: str, line: int | None) -> None:
        super().__init__(f"{problem}; {hint}")
        self.problem, self.hint, self.line = problem, hint, line


def loads_strict(text: str) -> Any:
    """`json.loads` that also refuses what Python's reader lets through: NaN and Infinity, numbers
    too large for a double, and a key repeated in one object (JSON readers keep only the last)."""
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float,
                          object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise StrictJsonError(f"not valid JSON ({exc.msg} at column {exc.colno})",
                              "fix the JSON syntax in that file", exc.lineno) from None
    except _Refused as exc:
        raise StrictJsonError(exc.message, exc.hint, _line_of(text, exc.literal)) from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer of more than 4300 digits
        raise StrictJsonError(f"cannot be read: {exc}", "fix the value in that file", None) from None


class _Refused(ValueError):
    def __init__(self, message: str, hint: str, literal: str = "") -> None:
        super().__init__(message)
        self.message, self.hint, self.literal = message, hint, literal


def _refuse_constant(literal: str) -> Any:
    raise _Refused(f"holds {literal}, which is not a finite number",
                   "write a finite number (JSON has no NaN or Infinity)", literal)


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _Refused(f"holds the number {literal[:40]}, too large for a floating-point number",
                       "write a finite number that fits a double (below about 1.8e308)", literal)
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"has the key {key!r} twice in one object",
                           "remove one of the two; JSON readers silently keep only the last")
        out[key] = value
    return out


def _line_of(text: str, literal: str) -> int | None:
    # The json module's hooks get no position; the first bare occurrence is close enough to find it.
    if not literal:
        return None
    found = re.search(r"(?<![\w.])" + re.escape(literal) + r"(?![\w.])", text)
    return text.count("\n", 0, found.start()) + 1 if found else None


@contextmanager
def errors_as(error: type[FormatError]) -> Iterator[None]:
    """Raise the field helpers' `FormatError`s as the format's own error class (same message)."""
    try:
        yield
    except FormatError as err:
        if isinstance(err, error):
            raise
        raise error(str(err)) from None


def read_json_file(path: str | os.PathLike[str], what: str, hint: str,
                   error: type[FormatError] = FormatError) -> Any:
    """The parsed contents of `path`; `what` names the file's role, `hint` says how to get a good one, and
    `error` is the format's own error class."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: {what} not found; {hint}") from None
    except OSError as err:
        raise error(f"{path}: cannot read the {what} ({err.strerror or err}); {hint}") from None
    try:
        return loads_strict(text)
    except StrictJsonError as err:
        where = f"{path}:{err.line}" if err.line else str(path)
        raise error(f"{where}: {err.problem}; {err.hint}") from None


def write_json_file(path: str | os.PathLike[str], data: Any, indent: int = 2) -> Path:
    """Write `data` as strict JSON (no NaN or infinity) atomically; returns the path."""
    text = json.dumps(data, indent=indent, allow_nan=False) + "\n"
    return atomic_write_text(path, text)


def validation_message(error: ValidationError) -> str:
    """A pydantic error as `field: message (hint); …`, our validators' messages and hints kept as they are."""
    details = error.errors()
    # A bad item also empties its list "after validation"; the item's own error is the one to show.
    item_locations = {tuple(d["loc"][:-1]) for d in details if d["loc"] and isinstance(d["loc"][-1], int)}
    problems = []
    for detail in details:
        if detail["type"] == "too_short" and tuple(detail["loc"]) in item_locations:
            continue
        location = ""
        for part in detail["loc"]:
            location += f"[{part}]" if isinstance(part, int) else (f".{part}" if location else str(part))
        cause = (detail.get("ctx") or {}).get("error")
        message = str(cause) if detail["type"] == "value_error" and cause else detail["msg"]
        if getattr(cause, "hint", ""):  # a FieldValueError says what to do
            message += f" ({cause.hint})"
        problems.append(f"{location}: {message}" if location else message)
    return "; ".join(problems)


def json_kind(value: Any) -> str:
    """What a JSON value is, for messages: "a list", "a string", "null", "a boolean", "a number"."""
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    return "a boolean" if isinstance(value, bool) else "a number"


def require_object(data: Any, where: str, what: str) -> Mapping[str, Any]:
    if not isinstance(data, dict):
        raise FormatError(f"{where}: {what} must be a JSON object, got {type(data).__name__}")
    return data


def reject_unknown(data: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    """Refuse keys a format does not define: a typo must not be silently ignored."""
    known = tuple(known)
    unknown = sorted(str(key) for key in data if key not in known)
    if unknown:
        raise FormatError(f"{where}: unknown field(s) {unknown}; the fields are {list(known)}")


def typed_field(data: Mapping[str, Any], key: str, types: tuple[type, ...], where: str, *,
          nullable: bool = False) -> Any:
    """`data[key]` checked against `types`; a nullable field may also be missing or null."""
    if key not in data:
        if nullable:
            return None
        raise FormatError(f"{where}: missing field {key!r}")
    value = data[key]
    if value is None and nullable:
        return None
    # JSON `true` is a bool, which Python also counts as an int; a count that is `true` is a writer bug.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = " or ".join(t.__name__ for t in types) + (" or null" if nullable else "")
        raise FormatError(f"{where}: field {key!r} must be {names}, got {repr(value)[:60]}")
    return float(value) if float in types and not isinstance(value, bool) else value


def int_field(data: Mapping[str, Any], key: str, where: str, *, nullable: bool = False,
              minimum: int | None = 0) -> Any:
    """An integer field (>= `minimum` unless that is None)."""
    value = typed_field(data, key, (int,), where, nullable=nullable)
    if value is not None and minimum is not None and value < minimum:
        raise FormatError(f"{where}: field {key!r} must be >= {minimum}, got {value}")
    return value


def number_field(data: Mapping[str, Any], key: str, where: str, *, nullable: bool = False) -> Any:
    """A finite number, as a float."""
    value = typed_field(data, key, (int, float), where, nullable=nullable)
    if value is not None and not math.isfinite(value):
        raise FormatError(f"{where}: field {key!r} must be a finite number, got {value}")
    return value


def number_list(data: Mapping[str, Any], key: str, where: str, length: int | None = None, *,
                nullable: bool = False) -> tuple[float, ...] | None:
    """A list of finite numbers as a tuple of floats; `length`, when given, is the required length."""
    values = typed_field(data, key, (list,), where, nullable=nullable)
    if values is None:
        return None
    if length is not None and len(values) != length:
        raise FormatError(f"{where}: field {key!r} has {len(values)} values, expected gamma={length}")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FormatError(f"{where}: field {key!r} must hold numbers, got {repr(value)[:40]}")
        if not math.isfinite(value):
            raise FormatError(f"{where}: field {key!r} must hold finite numbers, got {value}")
    return tuple(float(v) for v in values)


def int_list(data: Mapping[str, Any], key: str, where: str, *, minimum: int = 0) -> tuple[int, ...]:
    """A list of integers >= `minimum`, as a tuple."""
    values = typed_field(data, key, (list,), where)
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise FormatError(f"{where}: field {key!r} must hold integers >= {minimum}, got "
                              f"{repr(value)[:40]}")
    return tuple(values)
