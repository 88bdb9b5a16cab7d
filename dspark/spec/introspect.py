"""Walk the spec models along a pydantic error location to find the field it concerns.

Pydantic locations contain union tags (`cost_model.sps-1d.max_batch_tokens`) that do not exist in
the YAML; walking the types tells tags apart from keys and yields the field's docs for hints.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Tag
from pydantic.fields import FieldInfo

from dspark.spec.errors import FieldPath
from dspark.spec.models import DeploymentSpec


@dataclass(frozen=True)
class FieldTarget:
    """Where a pydantic location points: the YAML path, the owning model and its field."""

    path: FieldPath
    owner: type[BaseModel] | None
    field: FieldInfo | None


def resolve_loc(loc: tuple[str | int, ...], root: type[BaseModel] = DeploymentSpec) -> FieldTarget:
    current: Any = root
    path: list[str | int] = []
    owner: type[BaseModel] | None = None
    field: FieldInfo | None = None
    for part in loc:
        variants = _tagged_variants(current)
        if variants and isinstance(part, str) and part in variants:
            current = variants[part]
            continue
        current = _strip_optional(current)
        if _is_model(current):
            owner = current
            field = current.model_fields.get(str(part))
            current = field.annotation if field is not None else None
        elif isinstance(part, int):
            current = _item_type(current)
        else:
            current = None
        path.append(part)
    return FieldTarget(tuple(path), owner, field)


def model_at(loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The model class validated at `loc` (the mapping itself, not a field in it)."""
    current: Any = DeploymentSpec
    for part in loc:
        variants = _tagged_variants(current)
        if variants and isinstance(part, str) and part in variants:
            current = variants[part]
            continue
        current = _strip_optional(current)
        if not _is_model(current) or str(part) not in current.model_fields:
            return None
        current = current.model_fields[str(part)].annotation
    current = _strip_optional(current)
    return current if _is_model(current) else None


def literal_options(field: FieldInfo | None) -> tuple[str, ...]:
    if field is None:
        return ()
    annotation = _strip_optional(field.annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(str(option) for option in typing.get_args(annotation))
    return ()


def _is_model(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, BaseModel)


def _strip_annotated(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _union_members(annotation: Any) -> tuple[Any, ...]:
    annotation = _strip_annotated(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return ()


def _strip_optional(annotation: Any) -> Any:
    members = [m for m in _union_members(annotation) if m is not type(None)]
    if len(members) == 1:
        return _strip_annotated(members[0])
    return _strip_annotated(annotation)


def _tagged_variants(annotation: Any) -> dict[str, Any]:
    """Tag -> model for a (possibly optional, possibly nested) discriminated union."""
    out: dict[str, Any] = {}
    for member in _union_members(annotation):
        if typing.get_origin(member) is typing.Annotated:
            base, *meta = typing.get_args(member)
            out.update({item.tag: base for item in meta if isinstance(item, Tag)})
        out.update(_tagged_variants(member))
    return out


def _item_type(annotation: Any) -> Any:
    args = typing.get_args(_strip_annotated(annotation))
    return args[0] if args else None


def leaf_values(model: BaseModel, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted path, value) of every leaf field of a validated model, in declaration order.

    A nested model is walked (a union member as the variant it validated to); anything else,
    lists and None included, is one leaf. Fields excluded from dumps (`exclude=True`) count too:
    they are part of what the spec says.
    """
    out: list[tuple[str, Any]] = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(value, BaseModel):
            out += leaf_values(value, path)
        else:
            out.append((path, value))
    return out
