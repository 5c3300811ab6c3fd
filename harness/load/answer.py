"""Reading an answer into its result: a stream of server-sent events (each event's arrival, the
tokens it brings, the usage, how it ended) or one JSON body.

A stream succeeds when it ends with `data: [DONE]` after a finish_reason, with no error event and no
event that is not JSON. A piece read from the socket can hold several events: they share its time."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import orjson

from .result import Failure, RequestResult, Usage

Pieces = AsyncIterator[tuple[float, bytes]]


def fail(r: RequestResult, failure: Failure, error: str) -> None:
    """Record the request's first failure (a later one does not replace it)."""
    if r.error is None:
        r.failure, r.error = failure, error


async def read_events(pieces: Pieces, r: RequestResult, keep_text: bool) -> None:
    """Read a 200 answer to a streaming request to its end."""
    buf, done, finished, text = b"", False, False, []
    events, contents = r.event_times, r.content_times
    async for now, data in pieces:
        buf += data
        while (i := buf.find(b"\n\n")) >= 0:
            event, buf = buf[:i], buf[i + 2:]
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                if events is not None:
                    events.append(now)
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                try:
                    obj = orjson.loads(payload)
                except ValueError:
                    fail(r, "bad_event", f"malformed event {payload[:120]!r}")
                    continue
                if not isinstance(obj, dict) or "error" in obj:
                    fail(r, "error_event", f"error event: {json.dumps(obj)[:300]}")
                    continue
                if r.response_id is None:
                    r.response_id = obj.get("id")
                if usage := obj.get("usage"):
                    r.usage = _usage(usage)
                brings_tokens = False
                for choice in obj.get("choices") or ():
                    piece = _text(choice)
                    if piece and keep_text:
                        text.append(piece)
                    brings_tokens = brings_tokens or not _opening(choice)
                    finished = finished or choice.get("finish_reason") is not None
                if brings_tokens:
                    contents.append(now)
    if keep_text:
        r.text = "".join(text)
    if not done:
        fail(r, "cut", "stream cut: ended without data: [DONE]")
    elif not finished:
        fail(r, "cut", "stream cut: no finish_reason before data: [DONE]")


async def read_body(pieces: Pieces, r: RequestResult, keep_text: bool) -> None:
    """Read a 200 answer to a plain request: one JSON body with choices."""
    raw = b"".join([piece async for _, piece in pieces])
    try:
        body = orjson.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict) or not body.get("choices"):
        fail(r, "bad_body", f"bad body: {raw[:120]!r}")
        return
    r.response_id = body.get("id")
    if usage := body.get("usage"):
        r.usage = _usage(usage)
    if keep_text:
        choice = body["choices"][0]
        r.text = choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content")


async def read_error(pieces: Pieces, r: RequestResult) -> None:
    """Read a non-200 answer: its body says why."""
    text = b"".join([piece async for _, piece in pieces]).decode("utf-8", "replace")
    fail(r, "http", f"HTTP {r.status}: {text[:300]}")


def _text(choice: dict[str, Any]) -> str | None:
    """The text a choice brings: a completion's `text`, a chat delta's `content` (not its role)."""
    if text := choice.get("text"):
        return text
    delta = choice.get("delta")
    return delta.get("content") if isinstance(delta, dict) else None


def _opening(choice: dict[str, Any]) -> bool:
    """A chat stream's first chunk: the assistant's role, before any token. Every other chunk of a
    choice brings tokens, their text empty or not (a special token, a character still arriving)."""
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(delta.get("role")) and not delta.get("content")


def _usage(usage: dict[str, Any]) -> Usage:
    return Usage(prompt_tokens=int(usage.get("prompt_tokens") or 0),
                 completion_tokens=int(usage.get("completion_tokens") or 0))
