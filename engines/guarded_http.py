"""Connection hygiene for our uvicorn listeners (router, admin, engines): a cap on open
connections, a deadline for a request head (slowloris), the keep-alive idle timeout.

uvicorn's own ``limit_concurrency`` answers 503 only once a request arrives and keeps idle
connections open; here a connection over the cap is closed as soon as it is accepted (its file
descriptor freed at once), and a connection that has not sent a whole request head within
``header_timeout_s`` of connecting (or of its first bytes after a keep-alive pause) is closed.
Refusals are counted and logged at most once per ``LOG_EVERY_S``.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import time

import h11
import uvicorn
from pydantic import BaseModel, ConfigDict, Field
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("understudy.connections")
LOG_EVERY_S = 10.0


class ListenerLimits(BaseModel):
    """Limits of one listener."""

    model_config = ConfigDict(extra="forbid")

    max_connections: int = Field(default=1024, ge=1, description="open connections; more are closed on accept")
    header_timeout_s: float = Field(default=10.0, gt=0, description="connect (or first byte) -> whole request head")
    keepalive_timeout_s: float = Field(default=5.0, gt=0, description="idle time between requests on a connection")


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


def guarded_protocol(limits: ListenerLimits, stats: ConnectionStats) -> type[H11Protocol]:
    """An H11Protocol class enforcing ``limits`` (uvicorn.Config(http=...) takes a class)."""

    class GuardedH11Protocol(H11Protocol):
        _refused = False
        _head_timer: asyncio.TimerHandle | None = None

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
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                if self._head_timer is None:
                    self._arm()  # a new request head began after a keep-alive pause
            else:
                self._disarm()

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                stats.header_timeouts += 1
                stats.note()
                self.transport.abort()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._disarm()  # idle now: uvicorn's keep-alive timer runs; the next bytes re-arm ours

    return GuardedH11Protocol


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
