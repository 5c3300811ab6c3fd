"""HTTP/1.1 on the wire for the router's client (supervisor/router/upstream.py): the request head,
the response head, chunked bodies, and the errors a network wait turns into."""
from __future__ import annotations

import asyncio

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


def request_head(method: str, target: bytes, host: bytes, headers: Headers, body: bytes) -> bytes:
    parts = [method.encode("ascii"), b" ", target, b" HTTP/1.1\r\nhost: ", host, b"\r\n"]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    if body or method in BODY_METHODS:
        parts += (b"content-length: ", str(len(body)).encode("ascii"), b"\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


async def read_head(reader: asyncio.StreamReader) -> tuple[bytes, int, Headers]:
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


def upstream_error(e: Exception, what: str) -> UpstreamError:
    """The UpstreamError for a failed network wait (``what``: what it left us without). ``e``'s
    traceback is dropped: its frames hold asyncio's StreamReader, which holds ``e`` (a reference
    cycle per request lost with a killed engine, left to the garbage collector)."""
    e.__traceback__ = None
    if isinstance(e, TimeoutError):  # asyncio.timeout expired (before OSError: TimeoutError is one)
        return UpstreamTimeout(f"{what} within the timeout")
    if isinstance(e, asyncio.IncompleteReadError):
        return RemoteProtocolError(f"server disconnected: {what}")
    if isinstance(e, OSError):
        return ReadError(str(e) or type(e).__name__)
    return RemoteProtocolError(f"malformed response: {e}")
