"""Typed JSON documents: plain JSON values of dataclasses, and their JSON Schema.

The summary document is a tree of dataclasses (:mod:`traceml.analysis.document`). This module
turns such a tree into plain JSON values (:func:`plain`: field order is key order) and derives
the JSON Schema (draft 2020-12) of a dataclass from its type hints (:func:`json_schema`), so
``docs/final_summary.schema.json`` is generated, never kept by hand. Regenerate it with::

    python -m traceml.analysis.document docs/final_summary.schema.json

(the command lives with the document, so that this generic module imports none of its users).

Type hints map to JSON Schema as follows: ``int`` integer, ``float`` number, ``str`` string,
``bool`` boolean, ``X | None`` adds ``null``, ``list[X]`` array, ``dict[str, X]`` object of X,
bare ``dict`` any object, a dataclass an object with every field required and no other keys.
``Annotated[X, Schema(...)]`` adds keywords (``minimum``, ``description``, ``enum``, ...),
``Annotated[dict[str, X], Keys(names)]`` an object with exactly those keys, and
``Annotated[X, Refine({...})]`` the ``allOf`` of X's schema and the given one.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import typing
from typing import Any

_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}


class Schema:
    """JSON Schema keywords added to an annotated type's schema; ``enum`` or ``const``
    replace its ``type``. Example: ``Annotated[int, Schema(minimum=0)]``."""

    def __init__(self, **keywords: Any) -> None:
        self.keywords = keywords


class Keys:
    """A ``dict[str, X]`` with exactly the keys ``names`` (each required), each described by
    ``describe.format(name)`` when given."""

    def __init__(self, names: typing.Iterable[str], describe: str | None = None) -> None:
        self.names = tuple(names)
        self.describe = describe


class Refine:
    """The ``allOf`` of the annotated type's schema and ``schema`` (e.g. a narrower enum)."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema


def plain(value: Any) -> Any:
    """``value`` as plain JSON values: a dataclass becomes a dict of its fields in field order
    (or what its ``to_json()`` returns, when it has one), lists and dicts are copied. Dicts are
    copied shallowly: the document's dicts hold numbers, strings and evidence, never dataclasses.
    """
    to_json = getattr(value, "to_json", None)
    if to_json is not None:
        return to_json()
    if dataclasses.is_dataclass(value):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        if value and (dataclasses.is_dataclass(value[0]) or isinstance(value[0], (list, dict))):
            return [plain(v) for v in value]
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


def json_schema(
    root: type, *, defs: dict[str, type], title: str, description: str
) -> dict[str, Any]:
    """The JSON Schema of dataclass ``root``; the dataclasses in ``defs`` (name -> class) go to
    ``$defs`` and are referenced from everywhere they appear."""
    refs = {cls: name for name, cls in defs.items()}
    body = _object(root, refs)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": title,
        "description": description,
        "type": "object",
        "required": body["required"],
        "additionalProperties": False,
        "properties": body["properties"],
        "$defs": {name: _object(cls, refs) for name, cls in defs.items()},
    }


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]), include_extras=True)


def _object(cls: type, refs: dict[type, str]) -> dict[str, Any]:
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    return {
        "type": "object",
        "properties": {name: _schema(hints[name], refs) for name in names},
        "required": names,
        "additionalProperties": False,
    }


def _schema(hint: Any, refs: dict[type, str]) -> dict[str, Any]:
    if typing.get_origin(hint) is typing.Annotated:
        base, *extras = typing.get_args(hint)
        out = _schema(base, refs)
        for extra in extras:
            out = _annotate(out, extra, base, refs)
        return out
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        out = _schema(inner, refs)
        kind = out.get("type")
        if kind is None:
            raise TypeError(f"cannot make {inner!r} nullable")
        return {**out, "type": [kind, "null"]}
    if hint in refs:
        return {"$ref": f"#/$defs/{refs[hint]}"}
    if hint in _TYPES:
        return {"type": _TYPES[hint]}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _object(hint, refs)
    origin = typing.get_origin(hint)
    if hint is dict:
        return {"type": "object"}
    if origin is list:
        return {"type": "array", "items": _schema(args[0], refs)}
    if origin is dict:
        if args[1] is Any:  # a JSON object of anything (a finding's evidence)
            return {"type": "object"}
        return {"type": "object", "additionalProperties": _schema(args[1], refs)}
    raise TypeError(f"no JSON Schema for {hint!r}")


def _annotate(out: dict[str, Any], extra: Any, base: Any, refs: dict[type, str]) -> dict[str, Any]:
    if isinstance(extra, Schema):
        if "enum" in extra.keywords or "const" in extra.keywords:
            out = {k: v for k, v in out.items() if k != "type"}
        return {**out, **extra.keywords}
    if isinstance(extra, Keys):
        value = _schema(typing.get_args(base)[1], refs)
        return {
            "type": "object",
            "properties": {
                name: {
                    **value,
                    **({"description": extra.describe.format(name)} if extra.describe else {}),
                }
                for name in extra.names
            },
            "required": list(extra.names),
            "additionalProperties": False,
        }
    if isinstance(extra, Refine):
        return {"allOf": [out, extra.schema]}
    raise TypeError(f"unknown schema annotation {extra!r}")
