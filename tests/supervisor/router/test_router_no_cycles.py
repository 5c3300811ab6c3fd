"""A request through the router leaves no reference cycle behind: what it made is freed by reference
counting as it ends, not left for the garbage collector's full collections, which stop the router's
event loop while they walk (25-80 ms at 256 streams on the H200 host, bench/RESULTS.md). Real
sockets and processes: the router on our guarded listener, as the supervisor serves it, in front of
stand-in engines (tests/supervisor/router/test_migration_router.py) that die on cue, so a request lost unread (its
connection reset), a continuation and a failed batch of continuations are among them."""
from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import httpx
import pytest

from supervisor.config import MigrationSection
from supervisor.effects.servers import make_server
from supervisor.metrics import Metrics
from supervisor.router import build_router
from supervisor.router.routing import RoutingTable
from tests.supervisor.router.test_migration_router import follow, stand_in_engines

OUR_MODULES = ("supervisor.", "engines.", "uvicorn.")
OUR_FILES = ("/supervisor/", "/engines/")


def ours(o: object) -> str | None:
    """What `o` is, if our code (or the HTTP server under it) made it."""
    code = getattr(o, "f_code", None) or getattr(o, "cr_code", None) or getattr(o, "ag_code", None) \
        or getattr(o, "__code__", None)
    if code is not None and type(o).__module__ == "builtins":  # a frame, coroutine, generator or function
        where = code.co_filename
        return f"{type(o).__name__} {code.co_name} ({where.rsplit('/', 2)[-2]}/{where.rsplit('/', 1)[-1]})" \
            if any(f in where for f in OUR_FILES) else None
    module = type(o).__module__
    return f"{module}.{type(o).__qualname__}" if module.startswith(OUR_MODULES) else None


def cycles_left_by(work: Callable[[], None]) -> Counter:
    """Our objects that `work()` left in reference cycles (collected with DEBUG_SAVEALL, which
    keeps what every collection finds, automatic ones included), by kind."""
    gc.collect()
    gc.garbage.clear()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        work()
        gc.collect()
        return Counter(kind for o in gc.garbage if (kind := ours(o)) is not None)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.fixture()
def engines(tmp_path, monkeypatch):
    """Four stand-in engines u1..u4 (tests/supervisor/router/test_migration_router.py): the test below loses three."""
    yield from stand_in_engines(tmp_path, monkeypatch, 4)


@pytest.fixture()
def router(engines) -> Iterator[str]:
    """The router on a port of its own (its loop in a thread), following the stand-in engines: the
    next one is promoted when the primary's process exits."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    loop = asyncio.new_event_loop()
    table = RoutingTable()
    app = build_router(table, Metrics(), hold_timeout_s=5, retry_after_s=1, upstream_timeout_s=10,
                       migration=MigrationSection())
    server = make_server(app, sock, "warning", name="router")
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(sockets=[sock]),), daemon=True)
    thread.start()
    following = asyncio.run_coroutine_threadsafe(follow(table, engines), loop)
    deadline = time.monotonic() + 10
    while not (server.started and table.primary is not None) and time.monotonic() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    following.cancel()
    server.should_exit = True
    thread.join(10)


def lost_unread(engine: subprocess.Popen, post: Callable[[], httpx.Response], text: str) -> None:
    """``post()`` while ``engine`` is stopped, then SIGKILL it: the request dies unread, its
    connection reset (as a primary SIGKILLed mid-step resets what it had not read); it is answered by
    the next engine."""
    os.kill(engine.pid, signal.SIGSTOP)
    answered: list[httpx.Response] = []
    t = threading.Thread(target=lambda: answered.append(post()))
    t.start()
    time.sleep(0.3)  # (sent: in the stopped engine's socket, unread)
    os.kill(engine.pid, signal.SIGKILL)
    t.join(30)
    assert answered and answered[0].json()["choices"][0]["text"] == text


def test_requests_streams_a_client_leaving_and_a_continuation_leave_no_cycles(router, engines):
    body = {"model": "m", "prompt": "p", "max_tokens": 4}

    def work() -> None:
        with httpx.Client(base_url=router, timeout=30) as c:
            for _ in range(3):
                assert c.post("/v1/completions", json=body).json()["choices"][0]["text"] == "t0 t1 t2 t3 "
                with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    assert b"".join(r.iter_bytes()).endswith(b"data: [DONE]\n\n")
            with c.stream("POST", "/v1/completions", json={**body, "max_tokens": 50, "stream": True}) as r:
                next(r.iter_lines())  # our client leaves mid-stream
            assert c.post("/v1/completions", content=b"{not json").status_code >= 400  # passed through
            assert c.post("/v1/completions", json={**body, "continuation": {}}).status_code == 400  # refused
            lost_unread(engines[0][0], lambda: c.post("/v1/completions", json=body), "t0 t1 t2 t3 ")
            # u2 dies after two tokens: the stream is continued on u3, in a batch; u3 dies in it after
            # one more: the batch fails, and its member is continued on u4, whole
            dying = {**body, "max_tokens": 6, "stream": True, "die_after": {"u2": 2, "u3": 1}}
            with c.stream("POST", "/v1/completions", json=dying) as r:
                text = b"".join(r.iter_bytes())
            assert b"t5 " in text and text.endswith(b"data: [DONE]\n\n"), text
            for _ in range(3):  # and after it
                assert c.post("/v1/completions", json=body).json()["choices"][0]["text"] == "t0 t1 t2 t3 "
        time.sleep(0.3)  # (the router's side of the client that left ends)

    left = cycles_left_by(work)
    assert not left, f"reference cycles left for the garbage collector: {dict(left)}"
