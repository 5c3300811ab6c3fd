"""The router's HTTP/1.1 client for engines on loopback: keep-alive connections pooled per upstream,
responses framed by Content-Length, chunked encoding or connection close. Lean on purpose: it is on
the path of every request. A connection goes back to the pool only after its response was read whole
without error; every network wait is bounded by a timeout."""
from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections import deque
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from supervisor.router.http_wire import (HOP_BY_HOP, NETWORK_ERRORS, NOT_RELAYED, READ_LIMIT, ConnectError, Headers,
                                         ReadError, RemoteProtocolError, UpstreamError, UpstreamTimeout, read_head,
                                         request_head, take_chunks, upstream_error)
from supervisor.router.slots import Slots
from supervisor.router.upstream_response import Connection, Response

__all__ = ["HOP_BY_HOP", "NOT_RELAYED", "Client", "ConnectError", "Headers", "ReadError", "RemoteProtocolError",
           "Response", "UpstreamError", "UpstreamTimeout", "take_chunks"]


LARGE_BODY = 1 << 16
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
log = logging.getLogger("understudy.router")


class _Origin:
    """One upstream (http[s]://host[:port][/prefix]) and its idle connections, most recently used last."""
    __slots__ = ("url", "host", "port", "tls", "host_header", "prefix", "idle", "warming")

    def __init__(self, url: str, local_headers: bytes = b"") -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ConnectError(f"upstream url: expected http://host:port, got {url!r}")
        self.url = url
        self.tls = ssl.create_default_context() if u.scheme == "https" else None
        self.host, self.port = u.hostname, u.port or (443 if self.tls else 80)
        self.host_header = u.netloc.rpartition("@")[2].encode("ascii")
        if local_headers and u.hostname in LOOPBACK:  # (the node secret: for our engines, never another host)
            self.host_header += b"\r\n" + local_headers
        self.prefix = u.path.rstrip("/").encode("ascii")  # engines are served at the root, usually
        self.idle: deque[Connection] = deque()
        self.warming = False  # a connection is being opened to be kept idle (Client.warm)


class Sent:
    """A request written on a connection, its response head not read yet (Client.send_now). Its
    connection is released by ``Client.response`` (once called, whatever happens) or ``Client.abandon``."""
    __slots__ = ("origin", "conn", "method", "awaited")

    def __init__(self, origin: _Origin, conn: Connection, method: str) -> None:
        self.origin, self.conn, self.method = origin, conn, method
        self.awaited = False  # Client.response took it over


class Client:
    """Keep-alive HTTP/1.1 client; at most ``max_connections`` connections busy at once (a request
    waits up to ``timeout_s`` for one). ``timeout_s`` bounds each read and write, like httpx's
    read/write timeouts; idle connections older than ``keepalive_s`` are not reused (uvicorn closes
    idle connections after 5 s)."""

    def __init__(self, *, timeout_s: float, connect_timeout_s: float = 5.0, max_connections: int = 1024,
                 keepalive_s: float = 4.0, local_headers: Headers = ()) -> None:
        """``local_headers``: sent to loopback upstreams only (the node secret)."""
        self.timeout_s, self.connect_timeout_s, self.keepalive_s = timeout_s, connect_timeout_s, keepalive_s
        self._local = b"\r\n".join(name + b": " + value for name, value in local_headers)
        self._slots = Slots(max_connections)
        self._origins: dict[str, _Origin] = {}
        self._warming: set[asyncio.Task] = set()  # connections being opened by warm()
        self._closed = False

    async def request(self, method: str, url: str, target: bytes, headers: Headers, body: bytes) -> Response:
        """Send one request to ``url`` (http://host:port, a base URL) for ``target`` (path?query);
        return once the response head is in. The caller reads or closes the returned Response."""
        origin = self._origins.get(url) or self._add_origin(url)
        if not self._slots.take_now():
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._slots.take()
            except TimeoutError:
                raise UpstreamTimeout(f"no free connection within {self.timeout_s:g}s") from None
        try:
            conn = self._take_idle(origin) or await self._connect(origin)
        except BaseException:
            self._slots.release()
            raise
        return await self.response(self._write(origin, conn, method, target, headers, body))

    def send_now(self, method: str, url: str, target: bytes, headers: Headers, body: bytes) -> Sent | None:
        """Write the request now, without a wait, on an idle pooled connection to ``url`` (one kept by
        ``warm``); None (nothing sent) when no connection is free or idle there. Its answer:
        ``await response(sent)``, which also fails it if the connection broke."""
        origin = self._origins.get(url)
        if origin is None or not origin.idle or not self._slots.take_now():
            return None
        conn = self._take_idle(origin)
        if conn is None:  # (the idle ones had expired)
            self._slots.release()
            return None
        return self._write(origin, conn, method, target, headers, body)

    async def response(self, sent: Sent) -> Response:
        """The response head to a request written (``send_now``, or ``request``'s own)."""
        origin, conn = sent.origin, sent.conn
        sent.awaited = True
        try:
            async with asyncio.timeout(self.timeout_s):
                await conn.writer.drain()
                version, status, resp_headers = await read_head(conn.reader)
            return Response(conn, partial(self._release, origin), self.timeout_s, sent.method, version, status,
                            resp_headers)
        except NETWORK_ERRORS as e:
            self._release(origin, conn, reuse=False)
            raise upstream_error(e, "no response") from None
        except BaseException:
            self._release(origin, conn, reuse=False)
            raise

    def abandon(self, sent: Sent) -> None:
        """A request written whose answer will not be read: its connection is closed."""
        self._release(sent.origin, sent.conn, reuse=False)

    def warm(self, url: str) -> None:
        """Keep a connection to ``url`` open and idle (the engine a failover would promote: its
        continuations then go out at once, with no connect first, ``send_now``): one is opened in the
        background unless one idle there is younger than half the keep-alive."""
        origin = self._origins.get(url) or self._add_origin(url)
        now = time.monotonic()
        if origin.warming or self._closed or any(now - c.idle_since < self.keepalive_s / 2 for c in origin.idle):
            return
        origin.warming = True
        task = asyncio.ensure_future(self._open_idle(origin))
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

    def _write(self, origin: _Origin, conn: Connection, method: str, target: bytes, headers: Headers,
               body: bytes) -> Sent:
        """The request written on ``conn`` (its slot taken); a failure releases both."""
        try:
            head = request_head(method, origin.prefix + target, origin.host_header, headers, body)
            if len(body) > LARGE_BODY:  # (a failover's batch, ~2 MB: written as it is, not copied after the head)
                conn.writer.writelines((head, body))
            else:
                conn.writer.write(head + body)
        except BaseException:
            self._release(origin, conn, reuse=False)
            raise
        return Sent(origin, conn, method)

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
        usable idle connection left (and none being opened for warm)."""
        now = time.monotonic()
        for key, o in list(self._origins.items()):
            while o.idle and not o.idle[0].usable(now, self.keepalive_s):
                o.idle.popleft().close()
            if not o.idle and not o.warming:
                del self._origins[key]
        origin = self._origins[url] = _Origin(url, self._local)
        return origin

    def _take_idle(self, origin: _Origin) -> Connection | None:
        now = time.monotonic()
        while origin.idle:
            conn = origin.idle.pop()
            if conn.usable(now, self.keepalive_s):
                return conn
            conn.close()
        return None

    async def _connect(self, origin: _Origin) -> Connection:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(origin.host, origin.port, ssl=origin.tls,
                                                               limit=READ_LIMIT)
        except TimeoutError:
            raise UpstreamTimeout(f"connect to {origin.host}:{origin.port} timed out") from None
        except OSError as e:
            raise ConnectError(str(e) or type(e).__name__) from None
        return Connection(reader, writer)

    def _release(self, origin: _Origin, conn: Connection, reuse: bool) -> None:
        """A request is done with ``conn``: pool it (``reuse``) or close it; free its slot."""
        self._slots.release()
        if reuse:
            self._pool(origin, conn)
        else:
            conn.close()

    def _pool(self, origin: _Origin, conn: Connection) -> None:
        """``conn`` is idle now (closed instead if its origin is gone); expired ones are closed."""
        if self._closed or self._origins.get(origin.url) is not origin:
            conn.close()
            return
        now = conn.idle_since = time.monotonic()
        idle = origin.idle
        while idle and now - idle[0].idle_since >= self.keepalive_s:  # expired ones, oldest first
            idle.popleft().close()
        idle.append(conn)

    async def _open_idle(self, origin: _Origin) -> None:
        try:
            self._pool(origin, await self._connect(origin))
        except UpstreamError as e:  # (the engine is going: the next pass's warm tries again)
            log.debug("keeping a connection to %s open: %s", origin.url, e)
        finally:
            origin.warming = False


