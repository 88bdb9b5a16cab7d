"""Files a spec points at: checkpoint config.json files and cost-model/calibration JSON tables.

Every failure raises `FieldValueError` naming the file, so the loader can attach it to the spec
field that referenced the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from dspark.formats.fields import FieldValueError
from dspark.spec.errors import format_path


def resolve_path(raw: str, base: Path) -> Path:
    """A path from the spec: absolute as written, relative to the spec file's directory."""
    path = Path(raw).expanduser()
    return path if path.is_absolute() else base / path


def read_json(path: Path, what: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FieldValueError(f"{what} {str(path)!r} does not exist",
                             "fix the path (relative paths start at the spec file's directory)"
                             ) from None
    except OSError as exc:
        raise FieldValueError(f"cannot read {what} {str(path)!r}: {exc.strerror}",
                             "check the file's permissions") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise FieldValueError(
            f"{what} {str(path)!r} is not valid JSON: {exc.msg} at line {exc.lineno} "
            f"column {exc.colno}", "fix the JSON syntax in that file") from None


def validate_file_data(model: type[BaseModel], data: Any, path: Path, what: str,
                       extra: dict[str, Any] | None = None) -> Any:
    """Validate a JSON file's object against a spec model; errors name the file and field."""
    if not isinstance(data, dict):
        raise FieldValueError(f"{what} {str(path)!r} must hold a JSON object",
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
