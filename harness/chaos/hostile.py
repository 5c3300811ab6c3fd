"""Hostile-client faults, aimed at the data plane (127.0.0.1 only, bounded in size, count and time):

- ``big-request``: one 20 MB completion request; the node must refuse it cleanly (413, or 400 for
  its prompt) while the load goes on.
- ``idle-connections``: ``count`` connections opened and held idle for ``hold_s``, then closed;
  the node must refuse those over its cap and time out the rest, and keep serving.
"""
from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit

from .records import FaultRecord

BIG_REQUEST_BYTES = 20_000_000
MAX_IDLE = 5000
MAX_HOLD_S = 120.0


def big_body() -> bytes:
    """A completion request of about BIG_REQUEST_BYTES (as in issue 12)."""
    return json.dumps({"model": "chaos", "prompt": "hello world " * (BIG_REQUEST_BYTES // 12),
                       "max_tokens": 4}).encode()


async def post_early_answer(data_url: str, path: str, body: bytes, timeout_s: float = 60.0,
                            headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """POST ``body`` the way a real client does, but stop sending once the server answers (a node
    that refuses a 20 MB body answers before reading it, then closes: httpx would report only the
    reset). Returns (status, response body)."""
    u = urlsplit(data_url)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(u.hostname, u.port), timeout_s)
    try:
        async with asyncio.timeout(timeout_s):
            extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
            writer.write(f"POST {path} HTTP/1.1\r\nhost: {u.netloc}\r\ncontent-type: application/json\r\n{extra}"
                         f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode())
            head = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
            try:
                for i in range(0, len(body), 1 << 20):
                    if head.done():
                        break
                    writer.write(body[i:i + (1 << 20)])
                    await writer.drain()
            except OSError:
                pass  # the server stopped reading: its answer is what counts
            raw = await head
            lines = raw.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            length = next((int(v) for k, _, v in (ln.partition(":") for ln in lines[1:])
                           if k.strip().lower() == "content-length"), None)
            content = await (reader.readexactly(length) if length is not None else reader.read())
            return status, content
    finally:
        writer.transport.abort()


async def big_request(fault: FaultRecord, data_url: str, timeout_s: float = 60.0) -> None:
    """POST the big request; an error unless it is refused with 413 or 400 and an error body."""
    fault.target_role = "router"
    t0 = time.monotonic()
    try:
        status, content = await post_early_answer(data_url, "/v1/completions", big_body(), timeout_s)
    except (OSError, ValueError, IndexError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
        fault.error = f"big request: no answer: {type(e).__name__}: {e}"
        return
    finally:
        fault.t_done = time.time()
    fault.detail.update(http_status=status, seconds=round(time.monotonic() - t0, 3))
    try:
        fault.detail["code"] = json.loads(content)["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        fault.error = f"big request: answered {status} without an OpenAI error body: {content[:120]!r}"
        return
    if status not in (400, 413):
        fault.error = f"big request: expected 413 (or 400), got {status}"


async def idle_connections(fault: FaultRecord, data_url: str, count: int, hold_s: float) -> None:
    """Open ``count`` idle connections, hold them ``hold_s``, close them; record how many the node
    closed first (refused over its cap, or timed out without a request head)."""
    count, hold_s = min(count, MAX_IDLE), min(hold_s, MAX_HOLD_S)
    u = urlsplit(data_url)
    fault.target_role = "router"
    writers: list[asyncio.StreamWriter] = []
    readers: list[asyncio.StreamReader] = []
    failed = 0
    try:
        for _ in range(count):
            try:
                r, w = await asyncio.wait_for(asyncio.open_connection(u.hostname, u.port), 5.0)
            except (OSError, asyncio.TimeoutError):
                failed += 1
                continue
            readers.append(r)
            writers.append(w)
        opened_at = time.monotonic()
        closed = await asyncio.gather(*(_closed_within(r, hold_s) for r in readers))
        fault.detail.update(opened=len(writers), connect_failed=failed, closed_by_node=sum(closed),
                            held_s=round(time.monotonic() - opened_at, 3))
    finally:
        for w in writers:
            w.transport.abort()
        fault.t_done = time.time()


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), seconds) == b""
    except asyncio.TimeoutError:
        return False
    except OSError:
        return True
