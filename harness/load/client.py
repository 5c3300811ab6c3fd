"""The client side of a load: sends requests to one base URL, times each, keeps every result."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from .answer import fail, read_body, read_error, read_events
from .request import Request
from .result import RequestResult
from .wire import Connection, WireError

ENGINE_HEADER = b"x-understudy-engine"  # set by the router on every proxied answer
EPOCH_HEADER = b"x-understudy-epoch"
RETRIES_HEADER = b"x-understudy-retries"


class Client:
    """Sends requests on connections to `url` (`connection()`); `results` holds every request sent,
    in the order sent, each filled in as its answer comes; `on_result` is called with each as it
    ends (in the event loop). `keep_text`: keep the generated text; `every_event`: keep the arrival
    of every data event of a stream too (the router's chunk counts index it). `timeout_s` bounds each
    read, `connect_timeout_s` each connect."""

    def __init__(self, url: str, timeout_s: float, *, connect_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, keep_text: bool = False, every_event: bool = False,
                 on_result: Callable[[RequestResult], None] | None = None) -> None:
        self.url, self.timeout_s, self.connect_timeout_s, self.clock = url, timeout_s, connect_timeout_s, clock
        self.keep_text, self.every_event, self.on_result = keep_text, every_event, on_result
        self.results: list[RequestResult] = []

    def connection(self) -> Connection:
        return Connection(self.url, self.timeout_s, self.connect_timeout_s, self.clock)

    async def send(self, conn: Connection, req: Request, sent: float | None = None) -> RequestResult:
        """Send `req` on `conn` and read its answer whole; `sent`: when it counts as sent (now)."""
        r = RequestResult(path=req.path, stream=req.stream, sent=self.clock() if sent is None else sent,
                          event_times=[] if self.every_event and req.stream else None)
        self.results.append(r)
        try:
            r.status, headers = await conn.post(req.path, req.body)
            r.head = self.clock()
            r.engine = _str(headers.get(ENGINE_HEADER))
            r.epoch, r.retries = _int(headers.get(EPOCH_HEADER)), _int(headers.get(RETRIES_HEADER))
            if r.status != 200:
                await read_error(conn.body(headers), r)
            elif req.stream:
                await read_events(conn.body(headers), r, self.keep_text)
            else:
                await read_body(conn.body(headers), r, self.keep_text)
        except WireError as e:
            connecting = e.kind in ("refused", "connect") or str(e).startswith("ConnectError")
            fail(r, e.kind, str(e) if connecting or not req.stream else f"stream cut: {e}")
        except asyncio.CancelledError:
            fail(r, "cancelled", "cancelled: the load stopped while it was in flight")
            raise
        finally:
            r.end = self.clock()
            if self.on_result is not None:
                self.on_result(r)
        return r


def _str(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")


def _int(value: bytes | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None
