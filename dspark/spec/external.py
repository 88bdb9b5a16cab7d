"""Files a spec points at: checkpoint config.json files and cost-model/calibration JSON tables.

Every failure raises `FieldValueError` naming the file, so the loader can attach it to the spec
field that referenced the file. JSON is read strictly: `NaN`, `Infinity` and numbers that overflow
to infinity are refused (Python's json module accepts them, and the compiler's canonical JSON would
then fail far from the file), and so are duplicate keys, which JSON parsers silently resolve.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from dspark.formats.fields import FieldValueError
from dspark.formats.json_io import StrictJsonError, json_kind, loads_strict
from dspark.spec.errors import format_path

MAX_JSON_BYTES = 64 << 20  # the largest table dspark writes is a few hundred KB
PathKind = Literal["missing", "file", "directory", "other"]


def resolve_path(raw: str, base: Path) -> Path:
    """A path from the spec: absolute as written, relative to the spec file's directory."""
    if "\0" in raw:
        raise FieldValueError(f"the path {raw!r} contains a NUL character", "remove it from the path")
    try:
        path = Path(raw).expanduser()
    except RuntimeError:  # `~name` for a user this machine does not know
        raise FieldValueError(f"cannot expand {raw!r}: no such user's home directory here",
                             "write the path out, or use ~/ for your own home") from None
    return path if path.is_absolute() else base / path


def path_kind(path: Path) -> PathKind:
    """What is at `path`, without raising (a name too long or a loop reads as "other")."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except NotADirectoryError:
        return "missing"
    except (OSError, ValueError):
        return "other"
    if stat.S_ISDIR(mode):
        return "directory"
    return "file" if stat.S_ISREG(mode) else "other"


def read_json(path: Path, what: str) -> Any:
    kind = path_kind(path)
    if kind == "missing":
        raise FieldValueError(f"{what} {str(path)!r} does not exist",
                             "fix the path (relative paths start at the spec file's directory)")
    if kind != "file":
        thing = "a directory" if kind == "directory" else "not a regular file"
        raise FieldValueError(f"{what} {str(path)!r} is {thing}", "point at the JSON file itself")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_JSON_BYTES + 1)
    except OSError as exc:
        raise FieldValueError(f"cannot read {what} {str(path)!r}: {exc.strerror}",
                             "check the file's permissions") from None
    if len(raw) > MAX_JSON_BYTES:
        raise FieldValueError(f"{what} {str(path)!r} is larger than {MAX_JSON_BYTES >> 20} MiB",
                             "point at the table itself; dspark's tables are a few hundred KB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise FieldValueError(f"{what} {str(path)!r} is not UTF-8 text (byte {raw[exc.start]:#04x} "
                             f"at line {line})", "save the file as UTF-8 JSON") from None
    try:
        return loads_strict(text)
    except StrictJsonError as exc:
        where = f" (line {exc.line})" if exc.line else ""
        raise FieldValueError(f"{what} {str(path)!r}: {exc.problem}{where}", exc.hint) from None


def validate_file_data(model: type[BaseModel], data: Any, path: Path, what: str,
                       extra: dict[str, Any] | None = None) -> Any:
    """Validate a JSON file's object against a spec model; errors name the file and field."""
    if not isinstance(data, dict):
        raise FieldValueError(f"{what} {str(path)!r} must hold a JSON object, not {json_kind(data)}",
                             f"write an object with the fields of {model.__name__}")
    try:
        return model.model_validate({**(extra or {}), **data})
    except ValidationError as exc:
        problems = []
        for detail in exc.errors():
            error = (detail.get("ctx") or {}).get("error")
            message = str(error) if detail["type"] == "value_error" and error else detail["msg"]
            problems.append(f"{format_path(tuple(detail['loc']))}: {message}")
        allowed = ", ".join(name for name in model.model_fields if name not in (extra or {}))
        raise FieldValueError(f"{what} {str(path)!r} is invalid: " + "; ".join(problems),
                             f"the file must hold exactly these fields: {allowed}") from None
