"""The router's request limits: the body is read within ``limits.body_timeout_s`` (408) and
``limits.max_body_bytes`` (413, from Content-Length before a byte is read); a generation request's
prompts and n, a chat request's messages and their characters are checked on the parsed JSON (400,
wire/limits.py ``check_body``, ``check_shape``) before it goes anywhere, so external engines are
bounded too and a huge message list costs the router one parse, no validation. Bodies that are not
JSON objects pass untouched: the engine names what is wrong with them. (Listener limits:
supervisor/effects/servers.py; engines get theirs in their EngineConfig.)"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from wire.limits import LimitError, RequestLimits, body_too_large, check_body, check_shape, drain

Receive = Callable[[], Awaitable[dict]]


class Refusal(Exception):
    """A request refused before it is forwarded: ``status`` and an OpenAI-style ``body``."""

    def __init__(self, status: int, body: dict) -> None:
        super().__init__(body["error"]["message"])
        self.status, self.body = status, body


def _refusal(e: LimitError) -> Refusal:
    return Refusal(e.status, e.body())


async def read_body(scope: dict, receive: Receive, max_bytes: int, timeout_s: float) -> bytes | None:
    """The whole request body, None if the client left first; Refusal when over a limit."""
    parts, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            for name, value in scope["headers"]:
                if name == b"content-length" and value.isdigit() and int(value) > max_bytes:
                    await drain(receive)  # bounded; the answer then reaches the client
                    raise _refusal(body_too_large(int(value), max_bytes))
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > max_bytes:
                    if message.get("more_body", False):
                        await drain(receive)
                    raise _refusal(body_too_large(size, max_bytes))
                parts.append(chunk)
                if not message.get("more_body", False):
                    return parts[0] if len(parts) == 1 else b"".join(parts)
    except TimeoutError:
        raise Refusal(408, {"error": {"message": f"the request body did not arrive within {timeout_s:g}s "
                                                 f"(limits.body_timeout_s)", "type": "timeout", "param": None,
                                      "code": "body_timeout_s"}}) from None


def check_request(path: str, req: Any, limits: RequestLimits) -> None:
    """Prompts per request, n, prompts x n of a generation request, a chat request's messages and
    their characters; `req` its body as supervisor/router/continuation.py `parse_request` read it
    (Refusal when over; anything but a JSON object passes: the engine answers it with its own error)."""
    if not isinstance(req, dict):
        return
    chat = path.endswith("chat/completions")
    n = req.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) else 1
    prompts = 1
    prompt = req.get("prompt")
    if not chat and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompts = len(prompt)
    try:
        check_body(limits, req, chat=chat)
        check_shape(limits, prompts, n, "messages" if chat else "prompt")
    except LimitError as e:
        raise _refusal(e) from None
