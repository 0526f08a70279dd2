"""Is this value of this annotated type, without coercion?

A recipe override or a model override arrives from a JSON job body or a YAML file, where
``true`` for an epoch count, ``"3"`` for a depth or ``1`` for a flag is a mistake, not a
request: pydantic's lax mode (and a plain dataclass) would take ``true`` as 1 and ``"3"`` as 3,
or keep the string until the run fails. :func:`type_problem` is the one strict check both
places use (``training.recipe_parts.Strict``, ``vit_service.models.registry.check_types``).
Only the types those configs use are judged (bool, int, float, str, Literal, unions,
lists / tuples / dicts of them); any other annotation (a nested pydantic model, a class)
is left to its own validation.
"""

from __future__ import annotations

import types
import typing
from typing import Any

_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def arms(annotation: Any) -> list[Any]:
    """The types a union allows, flattened, each without its ``Annotated`` constraints
    (``int | None`` -> ``[int, NoneType]``; a plain type -> ``[it]``)."""
    if typing.get_origin(annotation) is typing.Annotated:
        return arms(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for arm in typing.get_args(annotation) for a in arms(arm)]
    return [annotation]


def takes_only_text(annotation: Any) -> bool:
    """Whether every non-null value of ``annotation`` is a string (``str``, a ``Literal`` of
    strings, unions of them)."""
    kinds = [a for a in arms(annotation) if a is not type(None)]
    return bool(kinds) and all(
        a is str or (typing.get_origin(a) is typing.Literal
                     and all(isinstance(x, str) for x in typing.get_args(a))) for a in kinds)


def type_problem(value: Any, annotation: Any) -> str | None:
    """None when ``value`` is of type ``annotation`` as written (an int is a float, a bool is
    no int, a string is no number), else what was expected and what came."""
    miss = _mismatch(value, annotation)
    return None if miss is None else f"expected {miss[0]}, got {_shown(miss[1])}"


def _mismatch(value: Any, annotation: Any) -> tuple[str, Any] | None:
    """None when ``value`` fits ``annotation``, else (what was expected, the value that did
    not fit: ``value`` or an item of it)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return None
    if origin is typing.Annotated:
        return _mismatch(value, args[0])
    if annotation is None or annotation is type(None):
        return None if value is None else ("null", value)
    if origin is typing.Union or origin is types.UnionType:
        misses = [_mismatch(value, a) for a in arms(annotation)]
        if any(m is None for m in misses):
            return None
        inner = [m for m in misses if m is not None and m[1] is not value]
        if inner:  # the value has an arm's shape but an item of it does not fit: name it
            return inner[0]
        return " or ".join(dict.fromkeys(m[0] for m in misses if m is not None)), value
    if origin is typing.Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return None
        return f"one of {', '.join(map(repr, args))}", value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            return "a list", value
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                return f"{len(args)} items", value
            items = zip(value, args, strict=True)
        else:
            items = ((v, args[0] if args else Any) for v in value)
        return next((m for v, a in items if (m := _mismatch(v, a)) is not None), None)
    if origin is dict:
        if not isinstance(value, dict):
            return "a mapping", value
        key_type, value_type = args or (Any, Any)
        return next((m for k, v in value.items()
                     if (m := _mismatch(k, key_type) or _mismatch(v, value_type)) is not None),
                    None)
    if annotation is bool:
        ok = isinstance(value, bool)
    elif annotation is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif annotation is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif annotation is str:
        ok = isinstance(value, str)
    else:
        return None  # a nested model or a class: its own validation judges it
    return None if ok else (_NAMES[annotation], value)
