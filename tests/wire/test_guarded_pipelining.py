"""A request refused on its head (401 by the Gate, 431 over max_head_bytes) pipelined behind one still
being answered (wire/guarded_http.py): the refusal waits for the answer in progress (and any
queued before it) to go out whole, then the connection closes; nothing is logged as an app error."""
from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest

from wire.guarded_http import Gate, ListenerLimits
from guarded_listener_helpers import serve_guarded

TOKEN = b"Bearer sesame"
CAP = 4096
REFUSAL_BODY = b'{"error": "no"}'
ACTIONS: list[bytes] = []  # bodies of the authenticated POSTs the app acted on


async def app(scope, receive, send) -> None:  # noqa: ANN001
    """GET /ui (open): "ui" after 0.3 s (still in progress when what was pipelined after it
    arrives); POST /act (token): records its body, answers "done"; else "ok"."""
    if scope["type"] != "http":
        return
    body, more = b"", True
    while more:
        msg = await receive()
        body, more = body + msg.get("body", b""), msg.get("more_body", False)
    if scope["path"] == "/ui":
        await asyncio.sleep(0.3)
        answer = b"ui"
    elif scope["path"] == "/act":
        ACTIONS.append(body)
        answer = b"done"
    else:
        answer = b"ok"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})


def gate() -> Gate:
    def check(path: bytes, headers: list[tuple[bytes, bytes]]) -> bool | None:
        if (b"authorization", TOKEN) in headers:
            return True
        return None if path == b"/ui" else False
    return Gate(check, b"HTTP/1.1 401 Unauthorized\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                % (len(REFUSAL_BODY), REFUSAL_BODY))


@pytest.fixture()
def port() -> Iterator[int]:
    limits = ListenerLimits(max_head_bytes=CAP, header_timeout_s=30, keepalive_timeout_s=30)
    for port, _ in serve_guarded(app, limits, gate()):
        yield port


def exchange(port: int, *pieces: bytes, pause_s: float = 0.05, hold_s: float = 0.0) -> bytes:
    """Send the pieces (pausing between them), then read until the server ends the connection
    (failing if it does not within 5 s: the refusal must end it, not a timeout); keep the socket
    open ``hold_s`` more (a client closing at once would make the server drop what is still sent)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        for i, piece in enumerate(pieces):
            if i:
                time.sleep(pause_s)
            s.sendall(piece)
        out = b""
        while data := s.recv(65536):
            out += data
        time.sleep(hold_s)
        return out


def responses(raw: bytes) -> list[tuple[int, bytes]]:
    """(status, body) of each response in ``raw`` (all with a content-length), in order."""
    out = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, raw
        lines = head.split(b"\r\n")
        length = next(int(v) for k, _, v in (line.partition(b": ") for line in lines[1:])
                      if k.lower() == b"content-length")
        out.append((int(lines[0].split()[1]), rest[:length]))
        raw = rest[length:]
    return out


def clean(capfd, caplog) -> bool:  # noqa: ANN001
    """Nothing logged as an app error (uvicorn's handler writes to the stderr of when it was set up,
    which capfd may not see; caplog sees the records)."""
    logged = capfd.readouterr().err + caplog.text
    return not any(s in logged for s in ("Traceback", "Exception in ASGI application", "RuntimeError"))


UI = b"GET /ui HTTP/1.1\r\nhost: t\r\n\r\n"
STATUS = b"GET /status HTTP/1.1\r\nhost: t\r\n\r\n"


def test_a_refused_request_pipelined_behind_an_open_one_is_answered_after_it(port, capfd, caplog) -> None:  # noqa: ANN001
    raw = exchange(port, UI + STATUS, hold_s=0.4)  # (had the 401 come first, /ui would fail after 0.3 s)
    assert clean(capfd, caplog)
    assert responses(raw) == [(200, b"ui"), (401, REFUSAL_BODY)]


def test_an_authenticated_action_pipelined_before_a_refusal_keeps_its_answer(port, capfd, caplog) -> None:  # noqa: ANN001
    ACTIONS.clear()
    act = b"POST /act HTTP/1.1\r\nhost: t\r\nauthorization: %s\r\ncontent-length: 5\r\n\r\nhello" % TOKEN
    # the refused request's body is dropped; the request after it is never answered
    refused = b"POST /status HTTP/1.1\r\nhost: t\r\ncontent-length: 3\r\n\r\nabc"
    assert responses(exchange(port, act + refused + STATUS)) == [(200, b"done"), (401, REFUSAL_BODY)]
    assert ACTIONS == [b"hello"]
    # behind a slow one, with an authenticated one queued between: both answered, in order, then the 401
    assert responses(exchange(port, UI + act + STATUS)) == [(200, b"ui"), (200, b"done"), (401, REFUSAL_BODY)]
    assert ACTIONS == [b"hello", b"hello"]
    assert clean(capfd, caplog)


def test_an_oversized_head_pipelined_behind_an_open_request_gets_its_431_after_it(port, capfd, caplog) -> None:  # noqa: ANN001
    # (the oversized part in a later read, while /ui is still in progress)
    big = b"x-big: " + b"a" * (2 * CAP) + b"\r\n\r\n"
    got = responses(exchange(port, UI + b"GET /status HTTP/1.1\r\nhost: t\r\n", big))
    assert [status for status, _ in got] == [200, 431] and got[0][1] == b"ui", got
    assert b"request head over 4096 bytes" in got[1][1]
    assert clean(capfd, caplog)


def test_an_oversized_head_in_the_same_read_as_the_request_before_it_gets_its_431(port, capfd, caplog) -> None:  # noqa: ANN001
    """The first request's end and the whole next head in one read: the head is measured as parsed."""
    ACTIONS.clear()
    act = b"POST /act HTTP/1.1\r\nhost: t\r\nauthorization: %s\r\ncontent-length: 5\r\n\r\nhello" % TOKEN
    big = b"POST /act HTTP/1.1\r\nhost: t\r\nauthorization: %s\r\nx-big: %s\r\ncontent-length: 2\r\n\r\nhi" % (
        TOKEN, b"a" * (2 * CAP))
    got = responses(exchange(port, act + big))
    assert [status for status, _ in got] == [200, 431] and ACTIONS == [b"hello"], got
    just_under = b"GET /ui HTTP/1.1\r\nhost: t\r\nconnection: close\r\nx-pad: %s\r\n\r\n"
    pad = CAP - len(just_under % b"")  # a head of exactly CAP bytes passes, one more is refused
    assert [s for s, _ in responses(exchange(port, UI + just_under % (b"p" * pad)))] == [200, 200]
    assert [s for s, _ in responses(exchange(port, UI + just_under % (b"p" * (pad + 1))))] == [200, 431]
    assert clean(capfd, caplog)


def test_a_refusal_on_an_idle_connection_is_answered_at_once(port, capfd, caplog) -> None:  # noqa: ANN001
    """(`exchange` fails unless the server itself ends the connection: the refusal, not a timeout.)"""
    assert responses(exchange(port, STATUS)) == [(401, REFUSAL_BODY)]
    # after a whole answered request (keep-alive), the next one refused: the connection ends after it
    assert responses(exchange(port, UI, STATUS, pause_s=0.5)) == [(200, b"ui"), (401, REFUSAL_BODY)]
    assert clean(capfd, caplog)
