"""The load for callers that are not async (tests, `bench failover`, `bench supervisor-restart`): its
event loop in a thread of its own, its results as plain tuples, readable while it runs.

``Load`` sends completions back to back (closed loop, kept-alive connections; it can tell when an
engine first serves after a moment), ``OpenLoad`` one every 1/rate s whatever the answers, each on a
fresh connection (so refused connections are seen). Times are time.monotonic()."""
from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any

from .client import Client
from .request import Request
from .result import RequestResult
from .schedules import OpenRate, closed_loop

PROMPT = "Once upon a time"


class LoopThread:
    """An asyncio event loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run `coro` on the loop and wait for its result."""
        return self.submit(coro).result()

    def call(self, fn: Callable[[], object]) -> None:
        self.loop.call_soon_threadsafe(fn)

    def close(self, timeout_s: float) -> None:
        """Give the loop's tasks `timeout_s` to finish, then stop it."""

        async def drain() -> None:
            if others := asyncio.all_tasks() - {asyncio.current_task()}:
                await asyncio.wait(others, timeout=timeout_s)

        try:
            self.run(drain())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
            if not self._thread.is_alive():
                self.loop.close()


class ThreadedLoad:
    """A load whose coroutine (`_run`) goes on an event loop in a thread of its own: started by
    `_start`, stopped by `stop`."""

    def __init__(self) -> None:
        self._stop = asyncio.Event()
        self._loop: LoopThread | None = None
        self._done: Future | None = None

    async def _run(self) -> None:
        raise NotImplementedError

    def _start(self) -> None:
        self._loop = LoopThread()
        self._done = self._loop.submit(self._run())

    def stop(self) -> None:
        """Send no more; give the requests in flight 120 s; a failure of the load itself is raised here."""
        if self._loop is None:
            return
        loop, self._loop = self._loop, None
        loop.call(self._stop.set)
        loop.close(120.0)
        if self._done.done():
            self._done.result()


class Load(ThreadedLoad):
    """Steady load: `threads` clients sending completions back to back through the router, each on
    its own kept-alive connection. ``results``: (start, end, outcome, engine) with outcome 200, the
    HTTP status of another answer, or the error in words (a stream is cut unless it ends with a
    finish_reason and [DONE]); engine from the router's x-understudy-engine header. With `bodies`,
    the clients send them in turn (each with the model and `stream` set) and every success's text
    lands in ``replies`` as (body index, text)."""

    def __init__(self, url: str, model: str, threads: int = 2, max_tokens: int = 4, stream: bool = False,
                 bodies: list[dict] | None = None) -> None:
        super().__init__()
        self.url, self.model, self.threads, self.max_tokens, self.stream = url, model, threads, max_tokens, stream
        self.bodies = bodies
        self.results: list[tuple[float, float, int | str, str | None]] = []
        self.replies: list[tuple[int, str]] = []
        self._watch: tuple[str, float, threading.Event, list[float]] | None = None
        self._client: Client | None = None

    def __enter__(self) -> "Load":
        self._start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _request(self, body: dict) -> Request:
        return Request.of({**body, "model": self.model, "stream": self.stream})

    async def _run(self) -> None:
        client = self._client = Client(self.url, 60.0, connect_timeout_s=60.0, keep_text=self.bodies is not None,
                                       on_result=self._record)
        if self.bodies is None:
            req = self._request({"prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0.0})
            await closed_loop(client, itertools.repeat(req), self.threads, self._stop)
            return
        reqs = [self._request(b) for b in self.bodies]
        index = {id(req): i for i, req in enumerate(reqs)}

        def answered(req: Request, r: RequestResult) -> None:
            if r.ok:
                self.replies.append((index[id(req)], r.text or ""))
        await closed_loop(client, itertools.cycle(reqs), self.threads, self._stop, answered=answered)

    def one(self, body: dict) -> str:
        """The text of one completion of `body` (model and stream set), sent alone on a loop of its
        own (not while the load runs); raises unless it succeeded."""

        async def send() -> RequestResult:
            client = Client(self.url, 60.0, connect_timeout_s=60.0, keep_text=True)
            conn = client.connection()
            try:
                return await client.send(conn, self._request(body))
            finally:
                conn.close()

        r = asyncio.run(send())
        if not r.ok:
            raise RuntimeError(f"a completion failed: {r.error}")
        return r.text or ""

    def _record(self, r: RequestResult) -> None:
        outcome = 200 if r.ok else r.status if r.failure == "http" else r.error
        self.results.append((r.sent, r.end, outcome, r.engine))
        w = self._watch
        if w is not None and r.ok and r.engine == w[0] and r.end >= w[1] and not w[2].is_set():
            w[3].append(r.end)
            w[2].set()

    @property
    def failures(self) -> list:
        return [r for r in self.results if r[2] != 200]

    def mid_answer(self) -> int:
        """Streams in flight that have had tokens (losing their engine now, they are continued, not
        sent again): read from the load's thread, the latest requests only (one each client)."""
        client = self._client
        recent = client.results[-self.threads:] if client is not None else []
        return sum(1 for r in recent if r.end is None and r.content_times)

    def watch(self, engine: str, after: float) -> tuple[threading.Event, list[float]]:
        """An event set (with its completion time) by the first success from ``engine`` after ``after``."""
        ev, out = threading.Event(), []
        self._watch = (engine, after, ev, out)
        return ev, out

    def first_success_from(self, engine: str, after: float) -> float | None:
        """Completion time of the first success served by ``engine`` that ended after ``after``."""
        times = [end for start, end, code, eng in self.results if code == 200 and eng == engine and end >= after]
        return min(times) if times else None


class OpenLoad(ThreadedLoad):
    """Open-loop load: a completion every 1/rate s whatever the answers, each on a fresh connection
    (so refused connections are seen). ``results``: (start, end, outcome) with outcome "ok",
    "refused", "HTTP <code>" or the error in words."""

    def __init__(self, url: str, model: str, rate: float = 20.0, max_tokens: int = 4) -> None:
        super().__init__()
        self.url, self.model, self.rate, self.max_tokens = url, model, rate, max_tokens
        self.results: list[tuple[float, float, str]] = []
        self._client = Client(url, 60.0, connect_timeout_s=60.0, on_result=self._record)

    def start(self) -> "OpenLoad":
        self._start()
        return self

    def _request(self, max_tokens: int | None = None) -> Request:
        return Request.of({"model": self.model, "prompt": PROMPT, "temperature": 0.0,
                           "max_tokens": max_tokens or self.max_tokens, "ignore_eos": True})

    async def _run(self) -> None:
        await OpenRate(self._client, self.rate, fresh=True).run(iter(self._request, None), self._stop, drain_s=90.0)

    def _record(self, r: RequestResult) -> None:
        outcome = ("ok" if r.ok else "refused" if r.failure == "refused" else f"HTTP {r.status}"
                   if r.failure == "http" else r.error)
        self.results.append((r.sent, r.end, outcome))

    def one(self, max_tokens: int | None = None) -> None:
        """One request (``max_tokens`` generated, EOS ignored), on a fresh connection; its outcome is
        appended to results. Blocks until it is answered (call it from a thread of your own)."""

        async def send() -> None:
            conn = self._client.connection()
            try:
                await self._client.send(conn, self._request(max_tokens))
            finally:
                conn.close()

        self._loop.run(send())
