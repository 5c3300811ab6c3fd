"""A generation request's body, from bytes to a validated request, at a cost bounded per request.

Parsed with the cyclic GC paused (JSON makes no cycles; a body of a million small lists otherwise
sets off hundreds of collections over a growing heap), bounded on the parsed JSON (wire/limits.py
``check_body``), then validated by the strict request models (wire/protocol.py). A refusal names
the field and where in it, without rendering the whole offending value.
"""
from __future__ import annotations

import gc
import json
import re
from typing import Any, Iterator

import orjson
from pydantic import BaseModel, ValidationError

PREVIEW_CHARS = 80  # of an offending value, in an error message
# Union members in pydantic's error locations ("list[int]", "str", ...): not part of where the error is.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|dict\[.*\]|list\[.*\]|function-\w+\[.*\])$")


class BodyError(Exception):
    """A body that is not JSON or not a valid request: a 400 naming the field (``param``)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def loads(body: bytes) -> Any:
    """The body's JSON, parsed with the GC paused (BodyError ``invalid_json`` if it is not JSON)."""
    paused = gc.isenabled()
    gc.disable()
    try:
        return orjson.loads(body)
    except ValueError as e:  # not JSON (JSONDecodeError says where), or not text at all
        where = f"{e.msg} (at character {e.pos})" if isinstance(e, json.JSONDecodeError) else str(e)
        try:
            body.decode()
        except UnicodeDecodeError as u:  # (orjson's message names surrogates and character 0 for any bad byte)
            where = f"not UTF-8: byte {body[u.start]:#04x} at offset {u.start}"
        raise BodyError(f"request body is not valid JSON: {where}", code="invalid_json") from None
    finally:
        if paused:
            gc.enable()


def validate(model: type[BaseModel], data: Any) -> BaseModel:
    """``model`` from the parsed body; BodyError naming the first problem."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise BodyError(*describe(e.errors(include_url=False))) from None


def describe(errors: list[dict]) -> tuple[str, str | None, str | None]:
    """(message, param, code) of pydantic's errors: the first field's, and of a union (every member
    failed) the member that got furthest, e.g. ``prompt.1.0`` of ``[[1], ["a"]]``; code
    ``invalid_type`` when the value has the wrong JSON type (OpenAI's code)."""
    field = errors[0]["loc"][:1]
    mine = [(_where(e["loc"]), e) for e in errors if e["loc"][:1] == field]
    deepest = max(len(w) for w, _ in mine)
    best = max(w for w, _ in mine if len(w) == deepest)  # the furthest into a list
    chosen = [e for w, e in mine if w == best]
    msgs = list(dict.fromkeys(e["msg"] for e in chosen))
    code = "invalid_type" if all(e["type"].endswith("_type") for e in chosen) else None
    where = ".".join(str(p) for p in best) or "body"
    got = chosen[0].get("input")
    beyond = isinstance(got, float) and got.is_integer() and abs(got) >= 2**63  # (JSON's integers past 64 bits
    return f"{where}: {' or '.join(msgs)} (got {preview(got)}{': an integer past 64 bits' if beyond else ''})", \
        (str(field[0]) if field else None), code  # come as floats)


def _where(loc: tuple) -> tuple:
    return tuple(p for p in loc if not (isinstance(p, str) and _UNION_TAG.match(p)))


def preview(value: Any, limit: int = PREVIEW_CHARS) -> str:
    """``value`` as JSON (a string as Python's repr), cut after about ``limit`` characters; only
    what is shown is rendered, however large the value."""
    if isinstance(value, str):
        return repr(value[:limit]) + ("..." if len(value) > limit else "")
    out, size = [], 0
    for piece in _pieces(value):
        out.append(piece)
        size += len(piece)
        if size > limit:
            return "".join(out)[:limit] + "..."
    return "".join(out)


def _pieces(value: Any) -> Iterator[str]:
    if isinstance(value, list):
        yield "["
        for i, item in enumerate(value):
            yield ", " if i else ""
            yield from _pieces(item)
        yield "]"
    elif isinstance(value, dict):
        yield "{"
        for i, (k, v) in enumerate(value.items()):
            yield (", " if i else "") + json.dumps(str(k)) + ": "
            yield from _pieces(v)
        yield "}"
    elif isinstance(value, str):
        yield json.dumps(value[:PREVIEW_CHARS + 1])
    else:
        yield json.dumps(value, default=str)
