"""What one request may ask of an engine: body bytes, prompts, messages and their characters,
choices (n), prompt tokens.

Checked before any costly work: the body's size while it arrives (an ASGI wrapper, 413), the
counts of the parsed JSON before it is validated (``check_body``, 400: prompts, messages, the
messages' characters; validation costs per item, so 230,000 tiny messages in 8 MB cost about a
second of the front end's CPU), n and prompts x n once validated (400), and a prompt's length in
characters before it is tokenized (400): every token of the vocabulary spells at most
``max_token_chars`` characters, so a prompt of more than ``max_prompt_tokens * max_token_chars``
characters has more tokens than allowed whatever the tokenizer makes of it. Errors name the limit
and its config key (``limits.*``).
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

from wire.protocol import MAX_N  # the ceiling of limits.max_n


class RequestLimits(BaseModel):
    """The per-request limits an engine enforces (the supervisor passes its ``limits`` section)."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(default=8 << 20, ge=1024, description="request body size (413 above)")
    max_prompt_tokens: int | None = Field(default=None, ge=1, description="null = the model's context - 1")
    max_prompts: int = Field(default=256, ge=1, description="prompts in one /v1/completions request")
    max_messages: int = Field(default=4096, ge=1, description="messages in one /v1/chat/completions request")
    max_message_chars: int = Field(default=4 << 20, ge=1, description="characters of all the messages' content "
                                   "in one chat request (text parts included)")
    max_n: int = Field(default=MAX_N, ge=1, le=MAX_N, description="choices per prompt (n)")
    max_sequences: int = Field(default=256, ge=1, description="prompts x n in one request")


class LimitError(Exception):
    """A request over a limit; becomes an OpenAI error body with ``status``."""

    def __init__(self, status: int, message: str, param: str | None, key: str) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.key = status, message, param, key

    def body(self) -> dict:
        kind = "request_too_large" if self.status == 413 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.key}}


def check_shape(limits: RequestLimits, prompts: int, n: int, param: str = "prompt") -> None:
    """Prompts per request, n, and their product (each choice of each prompt is one sequence)."""
    if prompts > limits.max_prompts:
        raise LimitError(400, f"the request has {prompts} prompts; at most {limits.max_prompts} are allowed "
                              f"(limits.max_prompts)", param, "max_prompts")
    if n > limits.max_n:
        raise LimitError(400, f"n={n}; at most {limits.max_n} choices are allowed (limits.max_n)", "n", "max_n")
    if prompts * n > limits.max_sequences:
        raise LimitError(400, f"{prompts} prompts x n={n} = {prompts * n} sequences; at most {limits.max_sequences} "
                              f"are allowed in one request (limits.max_sequences)", "n", "max_sequences")


def check_body(limits: RequestLimits, body: Any, chat: bool) -> None:
    """On the parsed JSON, before it is validated (whose cost grows with every item): the number of
    prompts (completions), of messages and their characters (chat). Anything that is not the shape
    expected is left to validation, which names it."""
    if not isinstance(body, dict):
        return
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            check_shape(limits, len(prompt), 1)
        return
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    if len(messages) > limits.max_messages:
        raise LimitError(400, f"the request has {len(messages)} messages; at most {limits.max_messages} are allowed "
                              f"(limits.max_messages)", "messages", "max_messages")
    chars = sum(_content_chars(m.get("content")) for m in messages if isinstance(m, dict))
    if chars > limits.max_message_chars:
        raise LimitError(400, f"the messages hold {chars} characters; at most {limits.max_message_chars} are allowed "
                              f"(limits.max_message_chars)", "messages", "max_message_chars")


def _content_chars(content: Any) -> int:
    """Characters of one message's content: a string, or the text of its parts."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def prompt_token_limit(limits: RequestLimits, max_model_len: int) -> int:
    """The most prompt tokens a request may carry: the config's, never more than the context allows."""
    room = max_model_len - 1
    return room if limits.max_prompt_tokens is None else min(limits.max_prompt_tokens, room)


def check_chars(text_len: int, token_limit: int, max_token_chars: int, param: str) -> None:
    """Before tokenizing: refuse a text too long to fit ``token_limit`` tokens whatever it says."""
    bound = token_limit * max(1, max_token_chars)
    if text_len > bound:
        raise LimitError(400, f"the {param} is {text_len} characters: more than the {token_limit} prompt tokens "
                              f"allowed (limits.max_prompt_tokens, bounded by the context) can hold "
                              f"(at most {bound} characters; checked before tokenizing)", param, "max_prompt_tokens")


def check_tokens(n_tokens: int, token_limit: int, param: str) -> None:
    if n_tokens > token_limit:
        raise LimitError(400, f"the {param} is {n_tokens} tokens; at most {token_limit} are allowed "
                              f"(limits.max_prompt_tokens, bounded by the context)", param, "max_prompt_tokens")


class BodyLimit:
    """ASGI wrapper: 413 for a body over ``max_bytes``, by its Content-Length or as it arrives."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await drain(receive)
                await self._refuse(send, int(value))
                return
        seen = 0
        refused = False

        async def counted() -> dict:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes and not refused:
                    refused = True
                    await self._refuse(send, seen)
                    return {"type": "http.disconnect"}  # the app stops reading; its answer is dropped
            return message

        async def guarded_send(message: dict) -> None:
            if not refused:
                await send(message)
        await self.app(scope, counted, guarded_send)

    async def _refuse(self, send: Send, size: int) -> None:
        err = body_too_large(size, self.max_bytes)
        data = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": data})


DRAIN_MAX_BYTES = 64 << 20  # read (and drop) at most this much of a refused body


async def drain(receive: Receive, max_bytes: int = DRAIN_MAX_BYTES) -> None:
    """Read and drop a refused body (bounded), so that the refusal is not lost: closing a socket with
    unread data sends a reset, and the client's kernel then drops the answer it had received."""
    seen = 0
    while seen <= max_bytes:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def body_too_large(size: int, max_bytes: int) -> LimitError:
    return LimitError(413, f"the request body is {size} bytes or more; at most {max_bytes} are allowed "
                           f"(limits.max_body_bytes)", None, "max_body_bytes")
