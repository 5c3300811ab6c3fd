"""When requests are sent: a closed loop (each worker sends its next request when its previous one
is answered) or an open rate (one request every 1/rate s whatever the answers)."""
from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator

from .client import Client
from .request import Request
from .result import RequestResult
from .wire import Connection


def _going(client: Client, stop: asyncio.Event | None, deadline: float) -> bool:
    return not (stop is not None and stop.is_set()) and client.clock() < deadline


async def closed_loop(client: Client, requests: Iterator[Request], workers: int, stop: asyncio.Event | None = None,
                      deadline: float = math.inf,
                      answered: Callable[[Request, RequestResult], None] | None = None) -> None:
    """`workers` workers, each on its own kept-alive connection, send the next of `requests` when
    their previous one is answered (``answered(request, result)``, if given), until `requests` run
    out, `stop` is set or the client's clock passes `deadline`; the requests in flight then finish."""

    async def worker() -> None:
        conn = client.connection()
        try:
            while _going(client, stop, deadline) and (req := next(requests, None)) is not None:
                result = await client.send(conn, req)
                if answered is not None:
                    answered(req, result)
        finally:
            conn.close()

    await asyncio.gather(*(worker() for _ in range(workers)))


class OpenRate:
    """One request every 1/`rate` s, whatever the answers; an arrival while `concurrency` requests
    are in flight is not sent (`not_sent` counts them). Each request goes on a kept-alive connection
    (one of at most as many as are in flight at once), or on a fresh one with `fresh` (so refused
    connections are seen). A client that falls more than 1 s behind (a stalled loop) starts again
    from now instead of bursting."""

    def __init__(self, client: Client, rate: float, *, concurrency: int | None = None, fresh: bool = False) -> None:
        self.client, self.rate, self.concurrency, self.fresh = client, rate, concurrency, fresh
        self.not_sent = 0
        self._idle: list[Connection] = []
        self._inflight: set[asyncio.Task[None]] = set()

    async def run(self, requests: Iterator[Request], stop: asyncio.Event, deadline: float = math.inf,
                  drain_s: float = 60.0) -> None:
        """Send `requests` until `stop` is set, the client's clock passes `deadline` or they run
        out; then the requests in flight get `drain_s` to finish, and are cancelled."""
        clock = self.client.clock
        gap, next_t = 1.0 / self.rate, clock()
        try:
            while _going(self.client, stop, deadline):
                delay = next_t - clock()
                if delay > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), timeout=delay)
                        break
                    except TimeoutError:
                        pass
                elif delay < -1.0:
                    next_t = clock()
                next_t += gap
                if self.concurrency is not None and len(self._inflight) >= self.concurrency:
                    self.not_sent += 1
                    continue
                if (req := next(requests, None)) is None:
                    break
                task = asyncio.create_task(self._one(req, clock()))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)
            if self._inflight:
                await asyncio.wait(set(self._inflight), timeout=drain_s)
        finally:
            for task in list(self._inflight):
                task.cancel()
            if self._inflight:  # their results say "cancelled" once these have run
                await asyncio.wait(set(self._inflight), timeout=5.0)
            for conn in self._idle:
                conn.close()

    async def _one(self, req: Request, sent: float) -> None:
        conn = self._idle.pop() if self._idle and not self.fresh else self.client.connection()
        try:
            await self.client.send(conn, req, sent)
        finally:
            if not self.fresh and conn.is_open:
                self._idle.append(conn)
            else:
                conn.close()
