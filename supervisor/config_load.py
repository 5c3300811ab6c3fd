"""Load UnderstudyConfig from YAML; every error names the file, the key path, what was expected
and what was found, e.g. ``config.yaml: engines.count: expected an integer >= 1, got 'two'``."""
from __future__ import annotations

import re
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import annotated_types
import yaml
from pydantic import BaseModel, ValidationError

from supervisor.config import UnderstudyConfig

DEFAULT_CONFIG_NAME = "understudy.yaml"


class ConfigError(Exception):
    """A config that cannot be used; str() is the one-line (or few-line) report for the operator."""


def default_config_text() -> str:
    """The embedded default (same text as configs/understudy.yaml)."""
    return resources.files("supervisor").joinpath("defaults", DEFAULT_CONFIG_NAME).read_text()


def load_config(path: str | Path | None = None) -> UnderstudyConfig:
    """Read ``path`` (None = the embedded default) and validate it."""
    if path is None:
        return parse_config(default_config_text(), "<embedded default>")
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: cannot read: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") \
            from None
    return parse_config(text, str(p))


def parse_config(text: str, source: str) -> UnderstudyConfig:
    """Parse YAML text; ``source`` names it in errors."""
    try:
        data = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"{source}: invalid YAML: nested too deeply") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{source}: {where}invalid YAML: {getattr(e, 'problem', None) or e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return UnderstudyConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError("\n".join(f"{source}: {line}" for line in format_errors(e))) from None


def format_errors(err: ValidationError) -> list[str]:
    """One ``path: expected X, got Y`` line per pydantic error."""
    lines = []
    for e in err.errors():
        loc = [p for p in e["loc"] if not (isinstance(p, str) and p.startswith(("function-", "literal[")))]
        text = _describe(e, loc)
        m = re.match(r"^([a-z_.]+): (.*)$", text)
        if e["type"] == "value_error" and m:  # a model validator naming its own field
            loc, text = [*loc, m.group(1)], m.group(2)
        path = ".".join(str(p) for p in loc) or "(top level)"
        lines.append(f"{path}: {text}")
    return lines


def _describe(e: dict[str, Any], loc: list) -> str:
    kind = e["type"]
    got = e.get("input")
    if kind == "extra_forbidden":
        parent = _field_owner(UnderstudyConfig, loc[:-1])
        known = ", ".join(parent.model_fields) if parent else "?"
        return f"unknown key (expected one of: {known})"
    if kind == "missing":
        return "required key is missing"
    if kind == "value_error":
        return str(e.get("ctx", {}).get("error", e["msg"]))
    want = _expected(UnderstudyConfig, loc)
    shown = "null" if got is None else "true" if got is True else "false" if got is False else repr(got)  # (as YAML)
    return f"expected {want or e['msg']}, got {shown}"


def _field_owner(model: type[BaseModel], loc: list) -> type[BaseModel] | None:
    """The model class reached by following ``loc`` from ``model``."""
    cur: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(cur, type) and issubclass(cur, BaseModel)) or part not in cur.model_fields:
            return None
        cur = _unwrap(cur.model_fields[part].annotation)
    return cur if isinstance(cur, type) and issubclass(cur, BaseModel) else None


def _unwrap(ann: Any) -> Any:
    """Strip Optional / list to the innermost model or scalar type."""
    origin = typing.get_origin(ann)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        return _unwrap(args[0]) if len(args) == 1 else ann
    if origin in (list, dict):
        return _unwrap(typing.get_args(ann)[-1])
    return ann


def _expected(model: type[BaseModel], loc: list) -> str | None:
    """Human description of the field at ``loc``: type plus its bounds."""
    while loc and isinstance(loc[-1], int):  # an item of a list: describe the item type
        loc = loc[:-1]
    if not loc:
        return None
    owner = _field_owner(model, loc[:-1])
    last = loc[-1]
    if owner is None or last not in owner.model_fields:
        return None
    info = owner.model_fields[last]
    ann = _unwrap(info.annotation)
    if typing.get_origin(ann) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(ann))
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    base = names.get(ann, "a mapping" if isinstance(ann, type) and issubclass(ann, BaseModel) else str(ann))
    bounds = []
    for m in info.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if isinstance(m, getattr(annotated_types, attr.capitalize())):
                bounds.append(f"{sym} {getattr(m, attr)}")
        if isinstance(m, annotated_types.MinLen) and m.min_length:
            base = "a non-empty " + base.split(" ", 1)[-1]
    return " ".join([base, " and ".join(bounds)]).strip()
