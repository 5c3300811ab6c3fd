"""What the router answers by itself: a Reply (a whole body, or an upstream stream to pass through),
in the OpenAI error shape the engines use, sent as bare ASGI messages."""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from urllib.parse import quote

from wire.guarded_http import CUT
from supervisor.router.upstream import HOP_BY_HOP, Headers
from supervisor.router.upstream import Response as UpstreamResponse

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[dict, Receive, Send], Awaitable[None]]


class Reply:
    """A whole body, or an upstream event stream to pass through."""
    __slots__ = ("status", "headers", "body", "stream", "epoch")

    def __init__(self, status: int, headers: Headers, body: bytes = b"",
                 stream: UpstreamResponse | None = None, epoch: int = 0) -> None:
        self.status, self.headers, self.body, self.stream, self.epoch = status, headers, body, stream, epoch


def error_body(message: str, type_: str, code: int) -> dict:
    """OpenAI's error shape, as the engines answer."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def json_reply(status: int, content: dict, headers: Headers | None = None) -> Reply:
    body = json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode()
    return Reply(status, [(b"content-type", b"application/json"), *(headers or [])], body)


async def send_whole(send: Send, reply: Reply) -> None:
    """A response with its body known: Content-Length framed (none where HTTP allows no body)."""
    headers = reply.headers
    if not (reply.status < 200 or reply.status in (204, 304)):
        headers = [*headers, (b"content-length", str(len(reply.body)).encode())]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})


def target_of(scope: dict) -> tuple[bytes, Headers]:
    """The request target (path?query) and the headers to pass on."""
    target = scope.get("raw_path") or quote(scope["path"]).encode("ascii")
    if query := scope.get("query_string"):
        target += b"?" + query
    return target, [(k, v) for k, v in scope["headers"] if k not in HOP_BY_HOP]


def cut(scope: dict) -> bool:
    """End the response in progress without its end (the client sees the body cut short, after
    what was sent: an error event), through our listener's extension (wire/guarded_http.py
    CUT); False where the server has none (a test transport): the caller raises instead."""
    close = scope.get("extensions", {}).get(CUT)
    if close is None:
        return False
    close()
    return True
