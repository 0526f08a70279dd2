"""Training recipes: YAML presets, dotted overrides, validation.

``load_recipe(name, overrides)`` is a pure function: read the YAML, apply dotted overrides
(``optim.lr=1e-3``, ``model.pos_encoding=learned``), validate against the schema
(:class:`Recipe`, in ``training.recipe_schema``), and return a :class:`Recipe` or raise
:class:`RecipeError` naming every bad key. The CLI and the jobs API both go through it.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from training.recipe_parts import WRONG_TYPE
from training.recipe_schema import Recipe
from vit_service.value_types import arms, takes_only_text

__all__ = [
    "RECIPES_DIR", "Recipe", "RecipeError", "apply_overrides", "flatten", "is_text_field",
    "list_recipes", "load_recipe", "parse_override", "parse_overrides", "parse_value",
    "recipe_path", "setting_text", "setting_texts", "validate_recipe",
]

RECIPES_DIR = Path(__file__).parent / "recipes"

# YAML 1.1 reads "1e-3" as a string; accept the usual float spellings in overrides and files.
_FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


class RecipeError(ValueError):
    """A recipe could not be loaded: unknown name, unknown key, or a value of the wrong type.

    ``errors`` holds ``(dotted key, message)`` pairs.
    """

    def __init__(self, message: str, errors: list[tuple[str, str]] | None = None) -> None:
        self.errors = errors or []
        lines = [message] + [f"  {k}: {m}" for k, m in self.errors]
        super().__init__("\n".join(lines))


def parse_value(value: Any, path: tuple[str, ...] = ()) -> Any:
    """A string from the command line -> a Python value by YAML scalar rules (``2`` -> int,
    ``1e-3`` -> float, ``null`` -> None, ``[0.9, 0.95]`` -> list); other values pass through.
    ``path``: where the value goes in a recipe (a text field inside a table keeps its float-
    like strings). A string YAML cannot read, or one with anchors and aliases (whose expansion
    can be exponential), stays the string."""
    if not isinstance(value, str):
        return value
    if _FLOAT_RE.match(value.strip()):
        try:
            return int(value) if re.fullmatch(r"[+-]?\d+", value.strip()) else float(value)
        except ValueError:  # past Python's 4,300 digits for an int
            return value
    read = _read_yaml(value)
    return value if read is _UNREADABLE else _fix_floats(read, path)


_UNREADABLE = object()


class _NoAliasLoader(yaml.SafeLoader):
    """A safe loader that stops at the first anchor or alias, in the one pass that reads."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise yaml.YAMLError("anchors and aliases are not read")
        return super().compose_node(parent, index)


MAX_BRACKETS = 100  # a YAML value with more '[' / '{' is not read: PyYAML's scanner slows down
# with nesting (2,000 of them: seconds), and no recipe value needs a tenth of that


def _read_yaml(value: str) -> Any:
    if not value.strip():
        return ""
    if value.count("[") + value.count("{") > MAX_BRACKETS:
        return _UNREADABLE
    try:
        return yaml.load(value, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader
    # RecursionError: "[[[[..." nested too deep; ValueError: a date that does not exist
    # ("2024-02-30"), an int past Python's 4,300 digits
    except (yaml.YAMLError, RecursionError, ValueError):
        return _UNREADABLE


def parse_override(key: str, value: Any) -> Any:
    """The value of the dotted recipe ``key`` as :func:`parse_value` reads it, except that a
    field that takes only text keeps the text: a data set id of sixteen digits (or digits
    and one ``e``) or a name ``2024`` is not a number, and ``#`` starts no comment (``null``
    still unsets an optional one, and a quoted string is its content)."""
    if not isinstance(value, str) or not _text_field(key.split(".")):
        return parse_value(value, tuple(key.split(".")))
    if value.strip() in _YAML_NULLS:
        return None
    if value.strip()[:1] not in ("'", '"'):  # unquoted: the text as typed; YAML would cut
        return value  # "/x #1" at its comment and read "!!str x" or "--- x" as "x"
    read = _read_yaml(value)
    return read if isinstance(read, str) else value


_YAML_NULLS = ("null", "Null", "NULL", "~")


def setting_text(value: Any) -> str:
    """The ``--set`` text that :func:`parse_override` reads back as exactly ``value`` (a typed
    override: a job's stored value): a string double-quoted with YAML's escapes (so no
    ``#``, ``: ``, ``on`` or ``3`` inside it is read as anything but text), a number, bool or
    null as JSON, a list or table in YAML's flow style."""
    if isinstance(value, str):
        text = yaml.safe_dump(value, default_style='"', allow_unicode=True, width=math.inf)
    elif isinstance(value, list | tuple | dict):
        text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True,
                              width=math.inf)
    else:
        return json.dumps(value)
    return text.removesuffix("\n...\n").strip()


def setting_texts(overrides: Mapping[str, Any]) -> dict[str, str]:
    """:func:`setting_text` of each typed override: what a job's trainer is given, and what
    its submission validates, so both read the same values."""
    return {k: setting_text(v) for k, v in overrides.items()}


def is_text_field(key: str) -> bool:
    """Whether the recipe field at dotted ``key`` takes only strings (and maybe null): a data
    set id, a name, a path."""
    return _text_field(key.split("."))


def _text_field(path: list[str]) -> bool:
    model: Any = Recipe
    for i, part in enumerate(path):
        fields = {f.alias or n: f for n, f in model.model_fields.items()} | model.model_fields
        field = fields.get(part)
        if field is None:
            return False
        if i == len(path) - 1:
            return takes_only_text(field.annotation)
        nested = [a for a in arms(field.annotation)
                  if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(nested) != 1:
            return False
        model = nested[0]
    return False


def _fix_floats(obj: Any, path: tuple[str, ...] = ()) -> Any:
    """``obj`` with each string that spells a float (``1e-3``, which YAML 1.1 leaves a string)
    made a float, except in fields that take only text (``path``: where ``obj`` sits in a
    recipe; a data set id ``12345678e9012345`` is no number)."""
    if isinstance(obj, str) and _FLOAT_RE.match(obj.strip()) and not obj.strip().isdigit():
        return obj if path and _text_field(list(path)) else float(obj)
    if isinstance(obj, dict):
        return {k: _fix_floats(v, (*path, str(k))) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fix_floats(v, path) for v in obj]
    return obj


def apply_overrides(raw: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Copy of ``raw`` with each dotted key set (``"optim.lr": "1e-3"``). Missing intermediate
    tables are created, so unknown keys reach validation and are reported there."""
    out = copy.deepcopy(raw)
    errors: list[tuple[str, str]] = []
    for key, value in overrides.items():
        parts = [p for p in str(key).split(".")]
        if not all(parts):
            errors.append((str(key), "malformed key"))
            continue
        node: Any = out
        for i, p in enumerate(parts[:-1]):
            if node.get(p) is None:
                node[p] = {}
            if not isinstance(node[p], dict):
                errors.append((str(key), f"{'.'.join(parts[: i + 1])} is not a table"))
                break
            node = node[p]
        else:
            node[parts[-1]] = parse_override(str(key), value)
    if errors:
        raise RecipeError("bad override(s):", errors)
    return out


def parse_overrides(pairs: list[str] | None) -> dict[str, str]:
    """``["a.b=1", "c=x"]`` -> ``{"a.b": "1", "c": "x"}`` (the CLI's ``--set``)."""
    out: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise RecipeError("bad --set value:", [(pair, "expected KEY=VALUE")])
        out[key.strip()] = value.strip()
    return out


def recipe_path(name: str | Path) -> Path:
    """A recipe name (``cifar10-smoke``) or a path to a YAML file -> the file."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    candidate = RECIPES_DIR / f"{name}.yaml"
    if candidate.is_file():
        return candidate
    raise RecipeError(f"unknown recipe {str(name)!r}; available: {', '.join(list_recipes())}")


def validate_recipe(raw: Mapping[str, Any]) -> Recipe:
    """Validate a recipe dict (e.g. from the jobs API); raise :class:`RecipeError`."""
    try:
        return Recipe.model_validate(_fix_floats(dict(raw)))
    except ValidationError as e:
        errors = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"]) or "(recipe)"
            if err["type"] == "extra_forbidden":
                msg = "unknown key"
            elif err["type"] == "missing":
                msg = "required key is missing"
            elif err["type"] == WRONG_TYPE:  # the message shows the value
                msg = err["msg"]
            elif isinstance(err.get("input"), dict):  # a table-level check: no dump
                msg = str(err["msg"]).removeprefix("Value error, ")
            else:
                msg = f"{err['msg']} (got {err.get('input')!r})"
            errors.append((key, msg))
        raise RecipeError(f"invalid recipe {raw.get('name', '?')!r}:", errors) from None


def load_recipe(
    name: str | Path, overrides: Mapping[str, Any] | None = None
) -> Recipe:
    """Read recipe ``name`` (or a YAML path), apply dotted ``overrides``, validate."""
    path = recipe_path(name)
    # a shallow copy: apply_overrides copies deeply before it changes anything
    raw = dict(_read_recipe_file(*_version(path)))
    raw.setdefault("name", path.stem)
    return validate_recipe(apply_overrides(raw, overrides or {}))


def _version(path: Path) -> tuple[str, int, int, int, int]:
    """What tells one version of a file from another: its resolved path, inode, size and
    modification and change times (an edit that keeps the size within one clock tick, or a
    copy that keeps the mtime, still changes the inode or the change time)."""
    st = path.stat()
    return str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


@functools.lru_cache(maxsize=64)
def _read_recipe_file(path: str, *version: int) -> dict[str, Any]:
    """A recipe file's mapping, parsed once per version of the file (``version``: see
    :func:`_version`): parsing is most of what loading a recipe costs (~20 ms), and a
    job's submission loads its recipe several times. Callers copy what they change."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping")
    return raw


def list_recipes() -> dict[str, str]:
    """Recipe name -> one-line description, for every YAML in ``training/recipes``."""
    out = {}
    for p in sorted(RECIPES_DIR.glob("*.yaml")):
        try:
            desc = _read_recipe_file(*_version(p)).get("description", "")
        except OSError:  # removed since the listing
            continue
        except RecipeError:  # not YAML, or not a mapping
            desc = "(not a valid recipe file)"
        out[p.stem] = str(desc).strip().splitlines()[0] if desc else ""
    return out


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict -> dotted keys (``{"optim": {"lr": 1}}`` -> ``{"optim.lr": 1}``)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v
    return out
