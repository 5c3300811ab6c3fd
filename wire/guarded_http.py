"""Connection hygiene for our uvicorn listeners (router, admin, engines): a cap on open
connections shared fairly between clients, a deadline for a request head (slowloris), the
keep-alive idle timeout, and (admin) credentials checked on the request head, before its body.

uvicorn's own ``limit_concurrency`` answers 503 only once a request arrives and keeps idle
connections open; here a connection over the cap is closed as soon as it is accepted (its file
descriptor freed at once), a connection that has not sent a whole request head within
``header_timeout_s`` of connecting (or of its first bytes after a keep-alive pause) is closed, and
a request head over ``max_head_bytes`` is answered 431 and closed. With ``peer_share`` (router,
admin) each client address holds at most that share of the cap, and a new connection closes an
idle one (the peer's own at its share, else the biggest holder's) instead of being refused
(wire/connection_share.py). A listener with a ``Gate`` (admin) answers a request without valid
credentials (401) from its head alone and closes the connection after discarding at most
``REFUSED_BODY_DISCARD`` bytes of its body; a connection that sent valid ones is never closed to
make room. A refused request (401 or 431) pipelined behind one still being answered gets its refusal
once that answer (and any queued before it) is whole, never before or inside it; what the client sends
meanwhile is dropped. Refusals are counted and logged at most once per ``LOG_EVERY_S``.
"""
from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import socket
import struct
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from pydantic import BaseModel, ConfigDict, Field
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from wire.connection_share import Occupancy

log = logging.getLogger("understudy.connections")
LOG_EVERY_S = 10.0
# Bytes of a refused (401) request's body dropped unread before closing: closing with unread bytes
# sends a reset, and the client's kernel then drops the answer it had received but not yet read.
# A client that sends more before reading (no legitimate admin request has a body) may miss it.
REFUSED_BODY_DISCARD = 1 << 20
# scope["extensions"][CUT]: a callable that ends the response in progress without its end (what was
# sent is flushed, then the connection closes: the client sees a cut body, never a clean end),
# without uvicorn's "Exception in ASGI application" traceback that raising would log. The app
# returns after calling it.
CUT = "understudy.cut"


class _Cut:
    """scope["extensions"][CUT] of one request: it holds uvicorn's RequestResponseCycle weakly. A
    closure over it made each request a reference cycle (cycle -> scope -> extensions -> closure ->
    cycle), left for the garbage collector's full collections, which stop the process while they walk."""
    __slots__ = ("_cycle",)

    def __init__(self, cycle) -> None:  # noqa: ANN001 (uvicorn's RequestResponseCycle)
        self._cycle = weakref.ref(cycle)

    def __call__(self) -> None:
        cycle = self._cycle()
        if cycle is None:  # (the request is over: nothing to cut)
            return
        cycle.keep_alive = False
        cycle.disconnected = True  # nothing more is sent; uvicorn logs nothing when the app returns
        cycle.transport.close()


class ListenerLimits(BaseModel):
    """Limits of one listener."""

    model_config = ConfigDict(extra="forbid")

    max_connections: int = Field(default=1024, ge=1, description="open connections; more are closed on accept")
    header_timeout_s: float = Field(default=10.0, gt=0, description="connect (or first byte) -> whole request head")
    keepalive_timeout_s: float = Field(default=5.0, gt=0, description="idle time between requests on a connection")
    max_head_bytes: int = Field(default=65536, ge=1024, description="request line + headers; more: 431, closed")
    peer_share: float | None = Field(default=None, gt=0, le=1, description="share of max_connections one client "
                                     "address may hold unauthenticated; null: a plain cap, nothing closed to make room")


@dataclass(frozen=True)
class Gate:
    """Who may send requests on a listener, decided on each request's head (before its body is read):
    ``check(path, headers)`` is True for valid credentials, None for a path open to anyone, False to
    refuse with ``refusal`` (a whole HTTP response; the connection is closed after it)."""

    check: Callable[[bytes, list[tuple[bytes, bytes]]], bool | None]
    refusal: bytes


class ConnectionStats:
    """Counters of one listener (shared by its connections)."""

    FIELDS = {"refused": "refused (over the cap or the client's share, nothing idle to close)",
              "evicted": "idle ones closed to make room", "header_timeouts": "closed without a request head in time",
              "unauthorized": "requests refused on their head (401)"}

    def __init__(self, name: str) -> None:
        self.name = name
        self.refused = self.evicted = self.header_timeouts = self.unauthorized = 0
        self.occupancy: Occupancy | None = None  # who holds the connections (set by guarded_protocol)
        self._logged_at = 0.0
        self._logged = dict.fromkeys(self.FIELDS, 0)

    def note(self) -> None:
        """Log what was refused, closed or timed out since the last line, at most once per LOG_EVERY_S."""
        now = time.monotonic()
        if now - self._logged_at < LOG_EVERY_S:
            return
        now_counts = {k: getattr(self, k) for k in self.FIELDS}
        new = {k: v - self._logged[k] for k, v in now_counts.items() if v > self._logged[k]}
        if new:
            self._logged_at, self._logged = now, now_counts
            log.warning("%s: connections %s", self.name, ", ".join(
                f"{n} {self.FIELDS[k]} (total {now_counts[k]})" for k, n in new.items()))


def _reset(transport: asyncio.BaseTransport) -> None:
    """Close with an RST (SO_LINGER 0), whether or not the client's bytes arrived: a plain close of a
    connection with nothing unread sends a FIN, which a client reads as an empty answer."""
    tsock = transport.get_extra_info("socket")
    if tsock is not None:
        tsock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _bytes_waiting(transport: asyncio.BaseTransport) -> bool:
    """Bytes already wait on a just-accepted connection (a client that sent its request at once)."""
    tsock = transport.get_extra_info("socket")
    if tsock is None:
        return False
    sock = socket.socket(fileno=tsock.fileno())  # (asyncio's wrapper has no recv)
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # (BlockingIOError: nothing yet)
        return False
    finally:
        sock.detach()


def peer_of(transport: asyncio.BaseTransport) -> str:
    """The client address a connection counts against (IPv6: its /64, which one host may hold whole;
    an IPv4 client of a dual-stack listener, ::ffff:a.b.c.d, is a.b.c.d)."""
    name = transport.get_extra_info("peername")
    return peer_of_address(name[0] if isinstance(name, tuple) and name else "")


def peer_of_address(host: str) -> str:
    if ":" not in host:
        return host
    try:
        ip = ipaddress.IPv6Address(host.split("%")[0])
    except ValueError:
        return host
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network(f"{ip}/64", strict=False).network_address)


def guarded_protocol(limits: ListenerLimits, stats: ConnectionStats, gate: Gate | None = None) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol enforcing ``limits`` and ``gate`` (uvicorn.Config(http=...) takes a class).

    httptools (llhttp, C) rather than h11: every chunk of every streamed answer goes through this
    class, and with h11 the router spent a quarter more CPU per chunk (bench/HISTORY.md,
    "HTTP cost per stream chunk").
    llhttp does not bound a request head, so this class does (``max_head_bytes``, 431), as h11 did."""
    occupancy = stats.occupancy = Occupancy(limits.max_connections, limits.peer_share)

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _refused = False  # over the cap: never admitted
        _head_timer: asyncio.TimerHandle | None = None
        _in_head = True  # between requests: since connecting or the last request's end, no whole head yet
        _head_bytes = 0  # of the head being received
        _tail = b""  # the last bytes of it (its end may straddle two reads)
        _discard: int | None = None  # refused on its head: body bytes still to drop before closing
        _refusal: tuple[bytes, Callable[[], None]] | None = None  # (answer, end): waits for the one in progress
        _heard = False  # a byte arrived

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            peer = peer_of(transport) if occupancy.fair else ""
            talking = occupancy.pressed(peer) and _bytes_waiting(transport)  # (a syscall only under pressure)
            while (c := occupancy.victim(peer)) is not None and occupancy.silent(c) and _bytes_waiting(c.transport):
                occupancy.heard(c)  # accepted in the same round, its request not read yet: a talker, not silent
            admitted, victim = occupancy.admit(self, peer, talking)
            if not admitted:
                self._refused = True
                stats.refused += 1
                stats.note()
                _reset(transport)  # the descriptor is freed now, the client sees a refusal
                return
            if victim is not None:
                victim._make_room()  # type: ignore[attr-defined]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            occupancy.release(self)
            self._disarm()
            super().connection_lost(exc)

        def _make_room(self) -> None:
            """Closed (idle) so that a new connection can have its slot."""
            occupancy.release(self)
            self._disarm()
            stats.evicted += 1
            stats.note()
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if not self._heard:
                self._heard = True
                occupancy.heard(self)
            if self._discard is not None:  # refused: the body is dropped unread, up to a bound
                self._discard -= len(data)
                if self._discard < 0:
                    self.transport.close()
                return
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
            if self._discard is not None:
                return  # (a request pipelined after a refused one, in the same read)
            self._in_head, self._head_bytes, self._tail = False, 0, b""
            self._disarm()
            if self._parsed_head_bytes() > limits.max_head_bytes:  # (begun in the read that ended the last one)
                self._refuse_head()
                return
            occupancy.busy(self)
            if gate is not None:
                verdict = gate.check(self.url.split(b"?", 1)[0], self.headers)
                if verdict is False:
                    self._refuse_unauthorized()
                    return
                if verdict:
                    occupancy.trust(self)
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.scope is self.scope:  # (its task starts later in this loop round)
                self.scope.setdefault("extensions", {})[CUT] = _Cut(cycle)

        def on_body(self, body: bytes) -> None:
            if self._discard is None:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self._discard is not None:
                return
            self._in_head = True  # what comes next is the next request's head
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.transport.is_closing() or not self._idle():
                return  # (a pipelined request that started instead keeps it busy)
            if self._refusal is not None:  # a request refused behind this one: its turn now
                answer, end = self._refusal
                self._refusal = None
                self._unset_keepalive_if_required()  # (``end`` closes the connection)
                self.transport.write(answer)
                end()
            else:
                occupancy.idle(self)

        def _parsed_head_bytes(self) -> int:
            """The head's size as parsed (request line, headers, blank line): data_received counts
            the bytes of each read, except those of a head that begins in the read which ends the
            request before it."""
            line = len(self.parser.get_method()) + len(self.url) + len(b"  HTTP/1.1\r\n")
            return line + sum(len(k) + len(v) + len(b": \r\n") for k, v in self.headers) + 2

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
            self._refuse(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json"
                         b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body),
                         self.transport.close)

        def _refuse_unauthorized(self) -> None:
            """The gate's refusal, from the head alone: the answer goes out with the end of our side
            of the connection; what the client still sends of its body is dropped (a bounded amount,
            within header_timeout_s, so a client that reads only after sending still gets the answer
            in most cases), then the connection is closed. Never read into memory."""
            stats.unauthorized += 1
            stats.note()
            self._refuse(gate.refusal, self._end_refused)  # type: ignore[union-attr]

        def _end_refused(self) -> None:
            occupancy.doomed(self)  # the first to close if room is needed
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(limits.header_timeout_s, self.transport.close)

        def _refuse(self, answer: bytes, end: Callable[[], None]) -> None:
            """Answer a request refused on its head with ``answer``, then ``end`` the connection: at
            once when no earlier response on it is in progress, else (pipelined) from
            on_response_complete once that one and any queued behind it are whole (written now, the
            refusal would come first, or inside it, and end the connection under it). Nothing more
            is read meanwhile: what the client sends is dropped (up to REFUSED_BODY_DISCARD bytes).
            The answer in progress keeps its keep-alive headers (with ``cycle.keep_alive = False``
            uvicorn would close the connection before on_response_complete, and the refusal would be
            lost); the refusal says ``connection: close``."""
            self._discard = REFUSED_BODY_DISCARD
            if self._idle():
                self.transport.write(answer)
                end()
            else:
                self._refusal = (answer, end)

    return GuardedHttpToolsProtocol


def _head_part(tail: bytes, data: bytes) -> int:
    """How many bytes of ``data`` belong to a request head whose last bytes so far are ``tail``."""
    end = data.find(b"\r\n\r\n")
    if end >= 0:
        return end + 4
    if tail and (end := (tail + data[:3]).find(b"\r\n\r\n")) >= 0:
        return end + 4 - len(tail)
    return len(data)


def guarded_config(app, limits: ListenerLimits, name: str, gate: Gate | None = None, **kwargs) -> uvicorn.Config:
    """A uvicorn.Config for ``app`` with the guarded protocol (no WebSocket upgrades: a connection
    is HTTP from its accept to its close); the stats are ``config.connection_stats``."""
    stats = ConnectionStats(name)
    cfg = uvicorn.Config(app, http=guarded_protocol(limits, stats, gate), ws="none",
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
