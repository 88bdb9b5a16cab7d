"""Render values as Python source that cannot carry code: the only way spec data reaches output.

Only plain data types are accepted (checked with `type(...) is`, so a str subclass with a custom
`__repr__` cannot sneak in); anything else is a compiler bug and raises.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any

from dspark.families import ModelFamily
from dspark.modes import VerifyMode

_SCALARS = (str, int, bool, type(None))


class LiteralError(TypeError):
    pass


def py_literal(value: Any, indent: int = 0, width: int = 100, lead: int = 0) -> str:
    """`value` as a Python literal; containers that do not fit in `width` are split one item per
    line, continuing at `indent` spaces (the column of the line the literal starts on). `lead`
    counts what precedes the literal on its first line after the indent (a `key: ` or `name=`)."""
    flat = _flat(value)
    if indent + lead + len(flat) + 1 <= width or not isinstance(value, (list, tuple, dict)) or not value:
        return flat  # + 1: the comma that follows an item
    inner = " " * (indent + 4)
    if isinstance(value, dict):
        items = [f"{_flat(key)}: {py_literal(item, indent + 4, width, len(_flat(key)) + 2)}"
                 for key, item in value.items()]
    elif all(type(item) in (*_SCALARS, float) for item in value):
        items = _pack([_flat(item) for item in value], width - len(inner) - 1)
    else:
        items = [py_literal(item, indent + 4, width) for item in value]
    open_, close = {dict: "{}", list: "[]", tuple: "()"}[type(value)]
    body = "".join(f"{inner}{item},\n" for item in items)
    return f"{open_}\n{body}{' ' * indent}{close}"


def _pack(items: list[str], width: int) -> list[str]:
    # Numbers read better several to a line than one per line, as a person would write a table.
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + 2 + len(item) <= width:
            lines[-1] += ", " + item
        else:
            lines.append(item)
    return lines


def _flat(value: Any) -> str:
    kind = type(value)
    if kind in _SCALARS:
        return repr(value)
    if kind is float:
        if not math.isfinite(value):
            raise LiteralError(f"{value!r} has no Python literal")
        return repr(value)
    if kind is list:
        return "[" + ", ".join(_flat(item) for item in value) + "]"
    if kind is tuple:
        if len(value) == 1:
            return f"({_flat(value[0])},)"
        return "(" + ", ".join(_flat(item) for item in value) + ")"
    if kind is dict:
        return "{" + ", ".join(f"{_flat(k)}: {_flat(v)}" for k, v in value.items()) + "}"
    if kind is VerifyMode:
        return f"VerifyMode.{value.name}"
    if kind is ModelFamily:  # the deployment names it by its value, read back into the family at import
        return repr(value.value)
    raise LiteralError(f"cannot render a {kind.__name__} as a Python literal: {value!r}")


def docstring_literal(text: str) -> str:
    """`text` as a triple-quoted docstring, escaped so no text can end it early."""
    if type(text) is not str:
        raise LiteralError(f"a docstring must be a str, not {type(text).__name__}")
    out = []
    for char in text:
        if char == "\\":
            out.append("\\\\")
        elif char == '"':
            out.append('\\"')
        elif char == "\n" or (char.isprintable() and char != "\r"):
            out.append(char)
        else:
            out.append(char.encode("unicode_escape").decode("ascii"))
    return '"""' + "".join(out) + '"""'


def docstring_body(text: str, indent: int, width: int = 100) -> str:
    """The body of a docstring opened at column `indent`: `text`'s paragraphs (split on blank lines)
    wrapped to `width`, continuation lines indented, and a closing line of its own when it spans
    several. The compiler's own prose only: quotes and backslashes are refused, not escaped."""
    if type(text) is not str or '"""' in text or "\\" in text:
        raise LiteralError(f"docstring text must be a str without triple quotes or backslashes: {text!r}")
    pad = " " * indent
    lines: list[str] = []
    for i, paragraph in enumerate(text.split("\n\n")):
        if i:
            lines.append("")
        # The first line starts after the opening quotes.
        # Code spans stay on one line: their spaces are held out of the wrapping.
        spans = paragraph.split("`")
        held = "`".join(part.replace(" ", "\0") if k % 2 else part for k, part in enumerate(spans))
        wrapped = [line.replace("\0", " ") for line in
                   textwrap.wrap(held, width - indent, initial_indent="   " if i == 0 else "")]
        lines += [wrapped[0].removeprefix("   ") if i == 0 else wrapped[0], *wrapped[1:]]
    body = "\n".join(pad + line if j and line else line for j, line in enumerate(lines))
    return body + ("\n" + pad if len(lines) > 1 else "")
