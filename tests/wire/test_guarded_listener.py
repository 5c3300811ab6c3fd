"""The guarded HTTP listener (wire/guarded_http.py) against raw sockets: a request head over the
cap is answered 431 and closed, whether it comes in one read or many; request bodies and pipelined
requests are not mistaken for heads; the listener keeps serving."""
from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from wire.guarded_http import ListenerLimits
from guarded_listener_helpers import serve_guarded

CAP = 4096


async def echo_length(scope, receive, send) -> None:
    """Answers each request with the length of its body."""
    if scope["type"] != "http":
        return
    n, more = 0, True
    while more:
        msg = await receive()
        n, more = n + len(msg.get("body", b"")), msg.get("more_body", False)
    body = str(n).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture()
def port() -> Iterator[int]:
    for port, _ in serve_guarded(echo_length, ListenerLimits(max_head_bytes=CAP, header_timeout_s=5)):
        yield port


def exchange(port: int, *pieces: bytes, pause_s: float = 0.0) -> bytes:
    """Send the pieces (pausing between them), then read until the server closes or goes quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            for piece in pieces:
                s.sendall(piece)
                time.sleep(pause_s)
        except (BrokenPipeError, ConnectionResetError):
            pass
        out = b""
        s.settimeout(1.0)
        try:
            while data := s.recv(65536):
                out += data
        except (TimeoutError, ConnectionResetError):
            pass
        return out


def post(body: bytes, extra: bytes = b"") -> bytes:
    return b"POST /x HTTP/1.1\r\nhost: t\r\n%scontent-length: %d\r\n\r\n%s" % (extra, len(body), body)


def test_a_head_over_the_cap_is_refused_with_431_and_the_listener_keeps_serving(port):
    out = exchange(port, post(b"", b"x-big: " + b"a" * (2 * CAP) + b"\r\n"))
    assert out.startswith(b"HTTP/1.1 431 ") and b"request head over 4096 bytes" in out, out[:200]
    assert exchange(port, post(b"hello")).endswith(b"\r\n\r\n5")


def test_a_head_dribbled_over_many_reads_is_counted_across_them(port):
    pieces = [b"POST /x HTTP/1.1\r\n"] + [b"x-h%d: %s\r\n" % (i, b"b" * 500) for i in range(20)]
    out = exchange(port, *pieces, pause_s=0.02)
    assert out.startswith(b"HTTP/1.1 431 "), out[:200]


def test_bodies_and_pipelined_requests_are_not_heads(port):
    assert exchange(port, post(b"z" * (50 * CAP))).endswith(b"\r\n\r\n204800")
    out = exchange(port, post(b"ab") + post(b"abc") + post(b"z" * (3 * CAP)))
    assert out.count(b"HTTP/1.1 200 ") == 3 and out.endswith(b"\r\n\r\n12288"), out
