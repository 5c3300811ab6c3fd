"""The router's HTTP/1.1 client for engines on loopback: keep-alive connections pooled per upstream,
responses framed by Content-Length, chunked encoding or connection close. Lean on purpose: it is on
the path of every request. A connection goes back to the pool only after its response was read whole
without error; every network wait is bounded by a timeout."""
from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

Headers = list[tuple[bytes, bytes]]  # lower-case names, as on the wire otherwise

HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailers", b"transfer-encoding", b"upgrade", b"host", b"content-length"})
NOT_RELAYED = HOP_BY_HOP | {b"date", b"server"}  # our own server (uvicorn) sends its date and server headers

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})  # always send a Content-Length, 0 included
READ_LIMIT = 1 << 18  # the longest response head (and chunk-size line) we accept
# what a network wait can raise: timeouts and socket errors (OSError), a connection closed early,
# a head over READ_LIMIT, and a malformed head or chunk (ValueError)
NETWORK_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError)


class UpstreamError(Exception):
    """The call failed: connection refused or broken, or an answer that is not HTTP/1.x."""


class ConnectError(UpstreamError):
    """Nothing accepted the connection."""


class ReadError(UpstreamError):
    """The connection broke while we were sending or reading."""


class RemoteProtocolError(UpstreamError):
    """The upstream closed without answering, or answered something malformed."""


class UpstreamTimeout(UpstreamError):
    """Connecting, waiting for a free connection slot, or one read ran past its timeout."""


class _Conn:
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


class _Origin:
    """One upstream (http[s]://host[:port][/prefix]) and its idle connections, most recently used last."""
    __slots__ = ("url", "host", "port", "tls", "host_header", "prefix", "idle")

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ConnectError(f"upstream url: expected http://host:port, got {url!r}")
        self.url = url
        self.tls = ssl.create_default_context() if u.scheme == "https" else None
        self.host, self.port = u.hostname, u.port or (443 if self.tls else 80)
        self.host_header = u.netloc.rpartition("@")[2].encode("ascii")
        self.prefix = u.path.rstrip("/").encode("ascii")  # engines are served at the root, usually
        self.idle: deque[_Conn] = deque()


class Client:
    """Keep-alive HTTP/1.1 client; at most ``max_connections`` connections busy at once (a request
    waits up to ``timeout_s`` for one). ``timeout_s`` bounds each read and write, like httpx's
    read/write timeouts; idle connections older than ``keepalive_s`` are not reused (uvicorn closes
    idle connections after 5 s)."""

    def __init__(self, *, timeout_s: float, connect_timeout_s: float = 5.0, max_connections: int = 1024,
                 keepalive_s: float = 4.0) -> None:
        self.timeout_s, self.connect_timeout_s, self.keepalive_s = timeout_s, connect_timeout_s, keepalive_s
        self._slots = asyncio.Semaphore(max_connections)
        self._origins: dict[str, _Origin] = {}
        self._closed = False

    async def request(self, method: str, url: str, target: bytes, headers: Headers, body: bytes) -> Response:
        """Send one request to ``url`` (http://host:port, a base URL) for ``target`` (path?query);
        return once the response head is in. The caller reads or closes the returned Response."""
        origin = self._origins.get(url) or self._add_origin(url)
        if self._slots.locked():
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._slots.acquire()
            except TimeoutError:
                raise UpstreamTimeout(f"no free connection within {self.timeout_s:g}s") from None
        else:
            await self._slots.acquire()  # does not suspend
        try:
            conn = self._take_idle(origin) or await self._connect(origin)
        except BaseException:
            self._slots.release()
            raise
        try:
            head = _request_head(method, origin.prefix + target, origin.host_header, headers, body)
            conn.writer.write(head + body)
            async with asyncio.timeout(self.timeout_s):
                await conn.writer.drain()
                version, status, resp_headers = await _read_head(conn.reader)
            return Response(self, origin, conn, method, version, status, resp_headers)
        except NETWORK_ERRORS as e:
            self._release(origin, conn, reuse=False)
            raise _upstream_error(e, "no response") from None
        except BaseException:
            self._release(origin, conn, reuse=False)
            raise

    async def fetch(self, method: str, url: str, path: str, json_body: Any = None,
                    timeout_s: float | None = None) -> tuple[int, bytes]:
        """One whole exchange with ``url`` (a base URL) for ``path``: (status, body). The supervisor's
        own calls (health, canary, startup) use it: one HTTP client in the process, and no httpx to
        import before a restarted supervisor serves. Raises UpstreamError (UpstreamTimeout past
        ``timeout_s``, default the client's)."""
        body = b"" if json_body is None else json.dumps(json_body).encode()
        headers: Headers = [] if json_body is None else [(b"content-type", b"application/json")]
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(limit):
                resp = await self.request(method, url, path.encode(), headers, body)
                return resp.status, await resp.read()
        except TimeoutError:
            raise UpstreamTimeout(f"{method} {url}{path}: no whole answer within {limit:g}s") from None

    async def aclose(self) -> None:
        """Close idle connections; busy ones close when their response is done."""
        self._closed = True
        for origin in self._origins.values():
            while origin.idle:
                origin.idle.pop().close()
        self._origins.clear()

    def _add_origin(self, url: str) -> _Origin:
        """A new upstream (engines get a new port per incarnation): also forget upstreams with no
        usable idle connection left."""
        now = time.monotonic()
        for key, o in list(self._origins.items()):
            while o.idle and not o.idle[0].usable(now, self.keepalive_s):
                o.idle.popleft().close()
            if not o.idle:
                del self._origins[key]
        origin = self._origins[url] = _Origin(url)
        return origin

    def _take_idle(self, origin: _Origin) -> _Conn | None:
        now = time.monotonic()
        while origin.idle:
            conn = origin.idle.pop()
            if conn.usable(now, self.keepalive_s):
                return conn
            conn.close()
        return None

    async def _connect(self, origin: _Origin) -> _Conn:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(origin.host, origin.port, ssl=origin.tls,
                                                               limit=READ_LIMIT)
        except TimeoutError:
            raise UpstreamTimeout(f"connect to {origin.host}:{origin.port} timed out") from None
        except OSError as e:
            raise ConnectError(str(e) or type(e).__name__) from None
        return _Conn(reader, writer)

    def _release(self, origin: _Origin, conn: _Conn, reuse: bool) -> None:
        """A request is done with ``conn``: pool it (``reuse``) or close it; free its slot."""
        self._slots.release()
        if not reuse or self._closed or self._origins.get(origin.url) is not origin:
            conn.close()
            return
        now = conn.idle_since = time.monotonic()
        idle = origin.idle
        while idle and now - idle[0].idle_since >= self.keepalive_s:  # expired ones, oldest first
            idle.popleft().close()
        idle.append(conn)


class Response:
    """A response whose head is in; its body is read once, whole (``read``) or chunk by chunk
    (``stream``). ``close`` drops the connection unless the body was read whole."""

    def __init__(self, client: Client, origin: _Origin, conn: _Conn, method: str, version: bytes,
                 status: int, headers: Headers) -> None:
        self.status, self.headers = status, headers
        self._client, self._origin, self._conn = client, origin, conn
        self._chunked = False
        self._length: int | None = None  # None: until the connection closes (unless chunked)
        self._keep_alive = version == b"HTTP/1.1"
        self._raw = bytearray()  # chunked: body bytes read but not yet taken as chunks
        self._guard: asyncio.TimerHandle | None = None  # _idle_guard's timer
        self._task: asyncio.Task | None = None  # the task reading the body
        self._waiting_since: float | None = None  # when the read in progress began (loop time)
        self._timed_out = False
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

    def _stop_guard(self) -> None:
        if self._guard is not None:
            self._guard.cancel()
            self._guard = None

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
        self._stop_guard()
        if self._conn is not None:
            conn, self._conn = self._conn, None
            self._client._release(self._origin, conn, reuse=False)

    def _done(self) -> None:
        """The body was read whole: the connection can serve another request."""
        self._stop_guard()
        if self._conn is not None:
            conn, self._conn = self._conn, None
            self._client._release(self._origin, conn, reuse=self._keep_alive)

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
                raise _upstream_error(e, "body cut short") from None
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
        `_idle_guard`: a timer per timeout period, not per read."""
        loop = asyncio.get_running_loop()
        self._task, self._waiting_since = asyncio.current_task(), loop.time()
        if self._guard is None:
            self._guard = loop.call_later(self._client.timeout_s, self._idle_guard)
        try:
            data = await self._conn.reader.read(1 << 16)  # type: ignore[union-attr]
        except asyncio.CancelledError:
            if self._timed_out and self._task.uncancel() == 0:  # type: ignore[union-attr]
                self.close()
                raise UpstreamTimeout("body cut short within the timeout") from None
            raise
        except NETWORK_ERRORS as e:
            self.close()
            raise _upstream_error(e, "body cut short") from None
        finally:
            self._waiting_since = None
        if not data:
            self.close()
            raise RemoteProtocolError("server disconnected: body cut short")
        return data

    def _idle_guard(self) -> None:
        """Fires once per timeout period: cancels a read that has waited the whole timeout, else re-arms."""
        loop = asyncio.get_running_loop()
        since = self._waiting_since
        if since is not None and loop.time() - since >= self._client.timeout_s - 0.001:  # (timers fire within ~1 ms)
            self._guard, self._timed_out = None, True
            self._task.cancel()  # type: ignore[union-attr]
        else:
            start = loop.time() if since is None else since
            self._guard = loop.call_at(start + self._client.timeout_s, self._idle_guard)

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
        self._resp, self._timeout = resp, asyncio.timeout(resp._client.timeout_s)

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()

    async def __aexit__(self, kind, exc, tb) -> bool:
        try:
            await self._timeout.__aexit__(kind, exc, tb)  # turns its cancellation into TimeoutError
        except NETWORK_ERRORS as e:
            self._resp.close()
            raise _upstream_error(e, "body cut short") from None
        if exc is None:
            return False
        self._resp.close()
        if isinstance(exc, NETWORK_ERRORS):
            raise _upstream_error(exc, "body cut short") from None
        return False


def take_chunks(buf: bytes | bytearray) -> tuple[list[bytes], int, bool]:
    """The complete chunks at the start of a chunked body's unread bytes: (their payloads, the
    bytes they used, whether the body's end (the zero-size chunk and its trailers) was among them).
    Raises ValueError on a malformed chunk."""
    chunks: list[bytes] = []
    at = 0
    while True:
        eol = buf.find(b"\r\n", at)
        if eol < 0:
            if len(buf) - at > READ_LIMIT:
                raise ValueError("chunk-size line too long")
            return chunks, at, False
        size = int(buf[at:eol].split(b";", 1)[0], 16)
        if size < 0:
            raise ValueError(f"negative chunk size {size}")
        if size == 0:  # the last chunk, then trailers up to an empty line
            end = buf.find(b"\r\n\r\n", eol)
            if end < 0:
                if len(buf) - eol > READ_LIMIT:
                    raise ValueError("trailers too long")
                return chunks, at, False
            return chunks, end + 4, True
        start = eol + 2
        if len(buf) < start + size + 2:
            return chunks, at, False
        if buf[start + size:start + size + 2] != b"\r\n":
            raise ValueError("chunk not followed by CRLF")
        chunks.append(bytes(buf[start:start + size]))
        at = start + size + 2


def _request_head(method: str, target: bytes, host: bytes, headers: Headers, body: bytes) -> bytes:
    parts = [method.encode("ascii"), b" ", target, b" HTTP/1.1\r\nhost: ", host, b"\r\n"]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    if body or method in BODY_METHODS:
        parts += (b"content-length: ", str(len(body)).encode("ascii"), b"\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


async def _read_head(reader: asyncio.StreamReader) -> tuple[bytes, int, Headers]:
    """HTTP version, status and headers of the next final (non-1xx) response."""
    while True:
        lines = (await reader.readuntil(b"\r\n\r\n"))[:-4].split(b"\r\n")
        version, status_text = lines[0].split(b" ", 2)[:2]
        status = int(status_text)
        if not version.startswith(b"HTTP/1.") or not 100 <= status <= 999:
            raise ValueError(f"bad status line {lines[0][:80]!r}")
        headers: Headers = []
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon:
                raise ValueError(f"bad header line {line[:80]!r}")
            headers.append((name.strip().lower(), value.strip()))
        if not 100 <= status < 200 or status == 101:
            return version, status, headers


def _upstream_error(e: Exception, what: str) -> UpstreamError:
    """The UpstreamError for a failed network wait (``what``: what it left us without)."""
    if isinstance(e, TimeoutError):  # asyncio.timeout expired (before OSError: TimeoutError is one)
        return UpstreamTimeout(f"{what} within the timeout")
    if isinstance(e, asyncio.IncompleteReadError):
        return RemoteProtocolError(f"server disconnected: {what}")
    if isinstance(e, OSError):
        return ReadError(str(e) or type(e).__name__)
    return RemoteProtocolError(f"malformed response: {e}")
