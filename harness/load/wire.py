"""The load generator's HTTP/1.1 connection: one per client worker, kept alive between requests.

Unlike the router's client (supervisor/router/upstream.py), which hands over one chunk per await, a
response body here comes as whatever the socket holds at each read (up to 256 KiB), with chunked
framing undone in one pass: under heavy streaming load many SSE events share one wake-up, so the
client stays far from being the bottleneck, and each piece carries the time it was read."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Literal
from urllib.parse import urlsplit

READ_SIZE = 1 << 18

WireFailure = Literal["refused", "connect", "timeout", "broken"]


class WireError(Exception):
    """No answer, or a broken or malformed one; str() says which, `kind` names it: refused (nothing
    listens), connect (another connect failure), timeout (connect or read), broken (the connection
    closed or reset, or bytes that are not HTTP)."""

    def __init__(self, kind: WireFailure, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Connection:
    """Keep-alive connection to one base URL; `post` one request at a time. A kept-alive connection
    the server closed while it was idle is reopened before the request is written; a request is never
    sent twice (a failure after it was written is the request's)."""

    def __init__(self, url: str, timeout_s: float, connect_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise WireError("connect", f"expected an http://host:port URL, got {url!r}")
        self.host, self.port, self.prefix = u.hostname, u.port or 80, u.path.rstrip("/")
        self.host_header = u.netloc
        self.timeout_s, self.connect_timeout_s, self.clock = timeout_s, connect_timeout_s, clock
        self._r: asyncio.StreamReader | None = None
        self._w: asyncio.StreamWriter | None = None
        self._keep = False  # the current response leaves the connection reusable

    def close(self) -> None:
        if self._w is not None:
            self._w.transport.abort()
        self._r = self._w = None

    @property
    def is_open(self) -> bool:
        """Open and reusable: not closed by either side (as far as the event loop has seen)."""
        return (self._w is not None and not self._w.is_closing() and not self._r.at_eof()
                and self._r.exception() is None)

    async def _connect(self) -> None:
        try:
            self._r, self._w = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, limit=READ_SIZE), self.connect_timeout_s)
        except ConnectionRefusedError as e:
            raise WireError("refused", f"ConnectError: {self.host}:{self.port}: {e}") from None
        except TimeoutError:
            raise WireError("timeout", f"ConnectError: {self.host}:{self.port}: TimeoutError") from None
        except OSError as e:
            raise WireError("connect", f"ConnectError: {self.host}:{self.port}: {e or type(e).__name__}") from None

    async def post(self, path: str, body: bytes) -> tuple[int, dict[bytes, bytes]]:
        """Send a POST and read the response head: (status, headers); then read the body with
        `body()`."""
        req = (f"POST {self.prefix}{path} HTTP/1.1\r\nhost: {self.host_header}\r\ncontent-type: application/json\r\n"
               f"accept: text/event-stream\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
        if not self.is_open:
            self.close()
            await self._connect()
        try:
            self._w.write(req)
            async with asyncio.timeout(self.timeout_s):
                await self._w.drain()
                head = await self._r.readuntil(b"\r\n\r\n")
        except TimeoutError:
            self.close()
            raise WireError("timeout", f"no response within {self.timeout_s:g} s") from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            self.close()
            raise WireError("broken", f"no response: {type(e).__name__}: {e}") from None
        lines = head[:-4].split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            self.close()
            raise WireError("broken", f"malformed status line {lines[0][:80]!r}")
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
        self._keep = parts[0] == b"HTTP/1.1" and b"close" not in headers.get(b"connection", b"").lower()
        return int(parts[1]), headers

    async def body(self, headers: dict[bytes, bytes]) -> AsyncIterator[tuple[float, bytes]]:
        """The body as (time read, bytes) pieces, times on the connection's clock; raises WireError if
        it is cut short."""
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            gen = self._chunked()
        elif b"content-length" in headers:
            gen = self._sized(int(headers[b"content-length"]))
        else:
            self._keep = False
            gen = self._until_close()
        try:
            async for piece in gen:
                yield piece
        except BaseException:
            self.close()
            raise
        if not self._keep:
            self.close()

    async def _read(self) -> bytes:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._r.read(READ_SIZE)
        except TimeoutError:
            raise WireError("timeout", f"no data within {self.timeout_s:g} s") from None
        except OSError as e:
            raise WireError("broken", f"ReadError: {e}") from None

    async def _sized(self, n: int) -> AsyncIterator[tuple[float, bytes]]:
        while n > 0:
            data = await self._read()
            if not data:
                raise WireError("broken", "server disconnected before the end of the body")
            n -= len(data)
            yield self.clock(), data

    async def _until_close(self) -> AsyncIterator[tuple[float, bytes]]:
        while data := await self._read():
            yield self.clock(), data

    async def _chunked(self) -> AsyncIterator[tuple[float, bytes]]:
        buf, done = b"", False
        while not done:
            data = await self._read()
            if not data:
                raise WireError("broken", "server disconnected: chunked body cut short")
            now = self.clock()
            buf += data
            out, pos = [], 0
            while True:
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    break
                try:
                    size = int(buf[pos:i].split(b";", 1)[0], 16)
                except ValueError:
                    raise WireError("broken", f"malformed chunk size {buf[pos:i][:40]!r}") from None
                if size == 0:
                    end = buf.find(b"\r\n\r\n", i)
                    if end < 0:
                        break
                    done, pos = True, end + 4
                    break
                end = i + 2 + size
                if len(buf) < end + 2:
                    break
                out.append(buf[i + 2:end])
                pos = end + 2
            buf = buf[pos:]
            if out:
                yield now, b"".join(out)
