"""A response from an upstream (supervisor/router/upstream.py): its head in, its body read once,
whole or chunk by chunk, bounded by the client's timeout; the connection goes back to the pool only
after the body was read whole without error."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from supervisor.router.http_wire import (NETWORK_ERRORS, Headers, RemoteProtocolError, UpstreamError, UpstreamTimeout,
                                         take_chunks, upstream_error)
from supervisor.router.idle_guard import IdleGuard


class Connection:
    """One connection to an upstream."""
    __slots__ = ("reader", "writer", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.idle_since = reader, writer, 0.0

    def usable(self, now: float, keepalive_s: float) -> bool:
        """Idle not too long (the server may be about to close it) and not closed by the server."""
        return (now - self.idle_since < keepalive_s and not self.reader.at_eof()
                and not self.writer.transport.is_closing())

    def close(self) -> None:
        self.writer.transport.abort()  # nothing to flush: we never close with a request half sent


Release = Callable[["Connection", bool], None]  # the connection back to its pool (True) or closed (False)


class Response:
    """A response whose head is in; its body is read once, whole (``read``) or chunk by chunk
    (``stream``). ``close`` drops the connection unless the body was read whole."""

    def __init__(self, conn: Connection, release: Release, timeout_s: float, method: str, version: bytes,
                 status: int, headers: Headers) -> None:
        self.status, self.headers = status, headers
        self._conn: Connection | None = conn
        self._release, self._timeout_s = release, timeout_s
        self._chunked = False
        self._length: int | None = None  # None: until the connection closes (unless chunked)
        self._keep_alive = version == b"HTTP/1.1"
        self._raw = bytearray()  # chunked: body bytes read but not yet taken as chunks
        self._guard = IdleGuard(timeout_s)  # (cancels the task reading the body)
        for name, value in headers:
            if name == b"content-length":
                self._length = int(value)
            elif name == b"transfer-encoding":
                self._chunked = b"chunked" in value.lower()
            elif name == b"connection":
                self._keep_alive = self._keep_alive and b"close" not in value.lower()
        if method == "HEAD" or status in (204, 304):
            self._chunked, self._length = False, 0
        elif self._chunked:
            self._length = None
        if self._length is None and not self._chunked:
            self._keep_alive = False
        if self._length is not None and self._length < 0:
            raise ValueError(f"content-length {self._length}")

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower case)."""
        for k, v in self.headers:
            if k == name:
                return v
        return None

    @property
    def is_event_stream(self) -> bool:
        return (self.header(b"content-type") or b"").startswith(b"text/event-stream")

    async def read(self) -> bytes:
        """The whole body."""
        if self._length is not None and self._conn is not None:  # the common case: one read
            async with self._body_wait():
                body = await self._conn.reader.readexactly(self._length) if self._length else b""
            self._done()
            return body
        return b"".join([chunk async for chunk in self.stream()])

    async def stream(self) -> AsyncIterator[bytes]:
        """The body as it arrives (of a chunked body, the chunks that have arrived, joined)."""
        try:
            while (chunk := await self._next_chunk()) is not None:
                yield chunk
        finally:
            self.close()

    async def finish(self, timeout_s: float) -> None:
        """Read what is left of the body (after an event stream's [DONE], only its end) and discard
        it, so the connection is back in the pool before our client hears the answer is complete:
        the client may send its next request at once, and it should find this connection idle.
        Past ``timeout_s``, or on any error, the connection is dropped instead: the answer is whole."""
        try:
            async with asyncio.timeout(timeout_s):
                while await self._next_chunk() is not None:
                    pass
        except (TimeoutError, UpstreamError):
            self.close()

    def close(self) -> None:
        """Drop the connection unless the body was read whole (then it is back in the pool)."""
        self._guard.stop()
        if self._conn is not None:
            conn, self._conn = self._conn, None
            self._release(conn, False)

    def _done(self) -> None:
        """The body was read whole: the connection can serve another request."""
        self._guard.stop()
        if self._conn is not None:
            conn, self._conn = self._conn, None
            self._release(conn, self._keep_alive)

    async def _next_chunks(self) -> bytes | None:
        """Every chunk of a chunked body that has arrived, joined (after waiting for one if none
        has); None at the body's end. An event stream relays a chunk per token: reading what is
        there at once, rather than a chunk at a time with a timeout each, is what keeps the router's
        CPU per chunk low (and a router that fell behind catches up in fewer, larger writes)."""
        while True:
            try:
                chunks, used, ended = take_chunks(self._raw)
            except ValueError as e:
                self.close()
                raise upstream_error(e, "body cut short") from None
            if used:
                del self._raw[:used]
            if ended:
                self._keep_alive = self._keep_alive and not self._raw  # bytes past the body: not reusable
                self._done()
            if chunks:
                return b"".join(chunks)
            if ended:
                return None
            self._raw += await self._read_some()

    async def _read_some(self) -> bytes:
        """What the connection has (waiting for something), bounded by the client's timeout through
        the idle guard: a timer per timeout period, not per read."""
        guard = self._guard
        guard.begin()
        try:
            data = await self._conn.reader.read(1 << 16)  # type: ignore[union-attr]
        except asyncio.CancelledError:
            if guard.timed_out and asyncio.current_task().uncancel() == 0:  # type: ignore[union-attr]
                self.close()
                raise UpstreamTimeout("body cut short within the timeout") from None
            raise
        except NETWORK_ERRORS as e:
            self.close()
            raise upstream_error(e, "body cut short") from None
        finally:
            guard.end()
        if not data:
            self.close()
            raise RemoteProtocolError("server disconnected: body cut short")
        return data

    def _body_wait(self) -> "_BodyWait":
        """One bounded wait for body bytes; on any failure the connection is dropped, and network
        failures become UpstreamErrors."""
        return _BodyWait(self)

    async def _next_chunk(self) -> bytes | None:
        """The next piece of the body; None at its end."""
        if self._conn is None:
            return None
        if self._chunked:
            return await self._next_chunks()
        reader = self._conn.reader
        async with self._body_wait():
            if self._length is not None:
                n, self._length = self._length, 0
                chunk = await reader.readexactly(n) if n else None
            else:
                chunk = await reader.read(1 << 16) or None
        if chunk is None:
            self._done()
        return chunk


class _BodyWait:
    """Response._body_wait as a class: it runs once per streamed chunk, and a generator-based
    context manager costs several times more."""
    __slots__ = ("_resp", "_timeout")

    def __init__(self, resp: Response) -> None:
        self._resp, self._timeout = resp, asyncio.timeout(resp._timeout_s)

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()

    async def __aexit__(self, kind, exc, tb) -> bool:
        try:
            await self._timeout.__aexit__(kind, exc, tb)  # turns its cancellation into TimeoutError
        except NETWORK_ERRORS as e:
            self._resp.close()
            raise upstream_error(e, "body cut short") from None
        if exc is None:
            return False
        self._resp.close()
        if isinstance(exc, NETWORK_ERRORS):
            raise upstream_error(exc, "body cut short") from None
        return False


