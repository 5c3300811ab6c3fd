"""Connection hygiene for our uvicorn listeners (router, admin, engines): a cap on open
connections, a deadline for a request head (slowloris), the keep-alive idle timeout.

uvicorn's own ``limit_concurrency`` answers 503 only once a request arrives and keeps idle
connections open; here a connection over the cap is closed as soon as it is accepted (its file
descriptor freed at once), a connection that has not sent a whole request head within
``header_timeout_s`` of connecting (or of its first bytes after a keep-alive pause) is closed, and
a request head over ``max_head_bytes`` is answered 431 and closed.
Refusals are counted and logged at most once per ``LOG_EVERY_S``.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import time

import uvicorn
from pydantic import BaseModel, ConfigDict, Field
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("understudy.connections")
LOG_EVERY_S = 10.0
# scope["extensions"][CUT]: a callable that ends the response in progress without its end (what was
# sent is flushed, then the connection closes: the client sees a cut body, never a clean end),
# without uvicorn's "Exception in ASGI application" traceback that raising would log. The app
# returns after calling it.
CUT = "understudy.cut"


class ListenerLimits(BaseModel):
    """Limits of one listener."""

    model_config = ConfigDict(extra="forbid")

    max_connections: int = Field(default=1024, ge=1, description="open connections; more are closed on accept")
    header_timeout_s: float = Field(default=10.0, gt=0, description="connect (or first byte) -> whole request head")
    keepalive_timeout_s: float = Field(default=5.0, gt=0, description="idle time between requests on a connection")
    max_head_bytes: int = Field(default=65536, ge=1024, description="request line + headers; more: 431, closed")


class ConnectionStats:
    """Counters of one listener (shared by its connections)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.refused = 0
        self.header_timeouts = 0
        self._logged_at = 0.0
        self._logged_refused = 0
        self._logged_timeouts = 0

    def note(self) -> None:
        """Log what was refused or timed out since the last line, at most once per LOG_EVERY_S."""
        now = time.monotonic()
        if now - self._logged_at < LOG_EVERY_S:
            return
        refused, timeouts = self.refused - self._logged_refused, self.header_timeouts - self._logged_timeouts
        if refused or timeouts:
            self._logged_at = now
            self._logged_refused, self._logged_timeouts = self.refused, self.header_timeouts
            log.warning("%s: %d connections refused (over the cap), %d closed without a request head in time "
                        "(totals %d, %d)", self.name, refused, timeouts, self.refused, self.header_timeouts)


def guarded_protocol(limits: ListenerLimits, stats: ConnectionStats) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol enforcing ``limits`` (uvicorn.Config(http=...) takes a class).

    httptools (llhttp, C) rather than h11: every chunk of every streamed answer goes through this
    class, and with h11 the router spent a quarter more CPU per chunk (bench/probes/http_chunks.py).
    llhttp does not bound a request head, so this class does (``max_head_bytes``, 431), as h11 did."""

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _refused = False
        _head_timer: asyncio.TimerHandle | None = None
        _in_head = True  # between requests: since connecting or the last request's end, no whole head yet
        _head_bytes = 0  # of the head being received
        _tail = b""  # the last bytes of it (its end may straddle two reads)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= limits.max_connections:
                self._refused = True
                stats.refused += 1
                stats.note()
                transport.abort()  # RST: the descriptor is freed now, the client sees a refusal
                return
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                if self._head_timer is None and self._idle():
                    self._arm()  # a new request head began after a keep-alive pause
                if self._head_bytes + _head_part(self._tail, data) > limits.max_head_bytes:
                    self._disarm()
                    self._refuse_head()
                    return
                self._head_bytes += len(data)  # (past the head's end it no longer matters)
                self._tail = data[-3:]
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes, self._tail = False, 0, b""
            self._disarm()
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.scope is self.scope:  # (its task starts later in this loop round)
                self.scope.setdefault("extensions", {})[CUT] = lambda: self._cut(cycle)

        def _cut(self, cycle) -> None:  # noqa: ANN001 (uvicorn's RequestResponseCycle)
            """scope["extensions"][CUT] of ``cycle``'s request."""
            cycle.keep_alive = False
            cycle.disconnected = True  # nothing more is sent; uvicorn logs nothing when the app returns
            self.transport.close()

        def on_message_complete(self) -> None:
            self._in_head = True  # what comes next is the next request's head
            super().on_message_complete()

        def _idle(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self._in_head and self._idle() and not self.transport.is_closing():
                stats.header_timeouts += 1
                stats.note()
                self.transport.abort()

        def _refuse_head(self) -> None:
            body = (b'{"error":{"message":"request head over %d bytes","type":"invalid_request_error","code":431}}'
                    % limits.max_head_bytes)
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json"
                                 b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return GuardedHttpToolsProtocol


def _head_part(tail: bytes, data: bytes) -> int:
    """How many bytes of ``data`` belong to a request head whose last bytes so far are ``tail``."""
    end = data.find(b"\r\n\r\n")
    if end >= 0:
        return end + 4
    if tail and (end := (tail + data[:3]).find(b"\r\n\r\n")) >= 0:
        return end + 4 - len(tail)
    return len(data)


def guarded_config(app, limits: ListenerLimits, name: str, **kwargs) -> uvicorn.Config:
    """A uvicorn.Config for ``app`` with the guarded protocol; the stats are ``config.connection_stats``."""
    stats = ConnectionStats(name)
    cfg = uvicorn.Config(app, http=guarded_protocol(limits, stats),
                         timeout_keep_alive=limits.keepalive_timeout_s, **kwargs)  # type: ignore[arg-type]
    cfg.connection_stats = stats  # type: ignore[attr-defined]
    return cfg


class SpareFdListener(socket.socket):
    """A listening socket whose ``accept`` survives EMFILE (the process is out of descriptors).

    asyncio (3.11/3.12) answers EMFILE on accept by logging a traceback and scheduling a retry for
    every remaining backlog slot, in one loop tick (tens of thousands of log lines a second, issue
    12). Here a spare descriptor is kept: on EMFILE it is closed, the waiting connection accepted
    and closed at once (the client sees a refusal, the backlog drains), and the spare taken again;
    asyncio only sees "nothing more to accept now". Refusals are logged at most every LOG_EVERY_S.
    """

    _spare = -1
    refused_emfile = 0
    _logged_at = 0.0

    def reserve_spare(self) -> None:
        """Take the spare descriptor (call once listening)."""
        if self._spare < 0:
            self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def accept(self):  # type: ignore[override]
        try:
            return super().accept()
        except OSError as e:
            if e.errno != errno.EMFILE:
                raise
        if self._spare >= 0:
            os.close(self._spare)
            self._spare = -1
            try:
                conn, _ = super().accept()
                conn.close()
                self.refused_emfile += 1
            except OSError:
                pass
            try:
                self.reserve_spare()
            except OSError:
                self._spare = -1  # taken meanwhile: until one frees, asyncio polls again (no log flood)
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            log.error("out of file descriptors (EMFILE) on %s: %d connections refused so far; raise the "
                      "open-files limit or lower limits.max_client_connections", self.getsockname(),
                      self.refused_emfile)
        raise BlockingIOError(errno.EAGAIN, "out of descriptors; connection refused")
