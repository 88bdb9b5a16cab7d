"""The jinja2 environment that renders generated files from `dspark/templates`."""

from __future__ import annotations

import hashlib
from functools import cache

import jinja2

from dspark.compiler.literals import docstring_body, docstring_literal, py_literal


@cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("dspark", "templates"),
        undefined=jinja2.StrictUndefined,  # a typo in a template is an error, not empty output
        keep_trailing_newline=True,
        trim_blocks=True,  # a block tag's own line leaves no blank line behind
        lstrip_blocks=True,
        autoescape=False,  # output is Python source; `py` does the escaping that matters
    )
    env.filters["py"] = py_literal
    env.filters["docstring"] = docstring_literal
    env.filters["doc"] = docstring_body
    return env


def template_sha256(name: str) -> str:
    """Hash of a template's source, so editing a template changes its node's hash."""
    env = environment()
    assert env.loader is not None
    source, _, _ = env.loader.get_source(env, name)
    return hashlib.sha256(source.encode("utf-8")).hexdigest()
