"""The supervisor's events as server-sent events (``GET /events`` on the admin port), for the status page.

One zmq SUB on the supervisor's event PUB (the documented ``events.sock``) feeds a bounded history and
one bounded queue per client. Nothing grows without bound: the history keeps the last ``history``
events, a client whose queue fills (it reads slower than events come) is dropped with a final
``overflow`` message, a client that stops reading altogether is cut after ``write_timeout_s``, and at
most ``max_clients`` streams are open at once. When the supervisor stops, every stream ends with
``event: bye`` (an open stream would hold up the server's shutdown). Event ids are ``{boot}:{n}``; a client reconnecting
with ``Last-Event-ID`` of this boot gets only what it missed from the history, else all of it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections import deque
from typing import Any, Callable

import zmq
import zmq.asyncio
from starlette.responses import Response

log = logging.getLogger("understudy.events")

_DROPPED = object()  # queue sentinel: this client fell behind and is dropped
STOP_POLL_S = 0.25  # how often an idle stream checks whether the supervisor is stopping


class TooManyClients(Exception):
    pass


class Subscriber:
    """One client's bounded queue of ``(n, event)``; ``_DROPPED`` ends it."""

    def __init__(self, size: int) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=size)
        self.dropped = False


class EventFanout:
    """Reads the event PUB once and hands every event to each subscriber, never blocking on one."""

    def __init__(self, endpoint: Callable[[], str], *, stopping: Callable[[], bool] = lambda: False,
                 history: int = 500, queue_size: int = 256, max_clients: int = 32, write_timeout_s: float = 10.0,
                 keepalive_s: float = 15.0) -> None:
        self._endpoint = endpoint
        self.stopping = stopping  # the supervisor is stopping: streams end (a server waits for open ones)
        self.boot = secrets.token_hex(4)
        self.history: deque[tuple[int, dict[str, Any]]] = deque(maxlen=history)
        self.subscribers: set[Subscriber] = set()
        self.queue_size, self.max_clients = queue_size, max_clients
        self.write_timeout_s, self.keepalive_s = write_timeout_s, keepalive_s
        self._n = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._task: asyncio.Task | None = None

    # ---- the one reader
    async def start(self) -> None:
        """Subscribe to the event PUB (call from the admin app's lifespan, before events matter)."""
        if self._task is not None:
            return
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVHWM, 10000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._endpoint())
        self._task = asyncio.get_running_loop().create_task(self._read(sock), name="event-fanout")

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        try:
            while True:
                raw = await sock.recv()
                try:
                    event = json.loads(raw)
                except ValueError:
                    log.warning("event stream: not JSON, ignored: %r", raw[:200])
                    continue
                if isinstance(event, dict):
                    self.deliver(event)
        finally:
            sock.close(0)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        for sub in list(self.subscribers):
            self._drop(sub)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def deliver(self, event: dict[str, Any]) -> None:
        """Number ``event``, keep it in the history, queue it for every client; drop clients that are full."""
        self._n += 1
        item = (self._n, event)
        self.history.append(item)
        for sub in list(self.subscribers):
            try:
                sub.queue.put_nowait(item)
            except asyncio.QueueFull:
                log.warning("event stream: a client fell %d events behind; dropped (it will reconnect)",
                            self.queue_size)
                self._drop(sub)

    # ---- clients
    def subscribe(self) -> Subscriber:
        if len(self.subscribers) >= self.max_clients:
            raise TooManyClients(f"{len(self.subscribers)} event streams are open (the limit is {self.max_clients})")
        sub = Subscriber(self.queue_size)
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)

    def _drop(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)
        sub.dropped = True
        while not sub.queue.empty():  # make room for the sentinel; the client resyncs from /status
            sub.queue.get_nowait()
        sub.queue.put_nowait(_DROPPED)

    def backlog(self, last_event_id: str | None) -> list[tuple[int, dict[str, Any]]]:
        """History after ``last_event_id`` when it is from this boot, else all of it."""
        after = 0
        if last_event_id:
            boot, _, n = last_event_id.partition(":")
            if boot == self.boot and n.isdigit():
                after = int(n)
        return [item for item in self.history if item[0] > after]

    def format(self, n: int, event: dict[str, Any]) -> bytes:
        return f"id: {self.boot}:{n}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()

    def stream(self, last_event_id: str | None) -> "EventStreamResponse":
        """The response for one client (raises TooManyClients)."""
        return EventStreamResponse(self, self.subscribe(), last_event_id)


class EventStreamResponse(Response):
    """``text/event-stream``: hello, the backlog, then live events and keepalive comments, until the
    client leaves, falls behind (``overflow``), or stops reading for ``write_timeout_s``."""

    media_type = "text/event-stream"

    def __init__(self, fanout: EventFanout, sub: Subscriber, last_event_id: str | None) -> None:
        super().__init__(headers={"cache-control": "no-store", "x-accel-buffering": "no"})
        self.raw_headers = [h for h in self.raw_headers if h[0] != b"content-length"]  # chunked, open-ended
        self.fanout, self.sub, self.last_event_id = fanout, sub, last_event_id

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        f, sub = self.fanout, self.sub
        left = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await self._send(send, {"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            backlog = f.backlog(self.last_event_id)  # sub is already subscribed: nothing falls in between
            hello = {"boot": f.boot, "backlog": len(backlog)}
            chunks = [f"retry: 1000\nevent: hello\ndata: {json.dumps(hello)}\n\n".encode()]
            chunks += [f.format(n, ev) for n, ev in backlog]
            await self._send(send, _body(b"".join(chunks)))
            sent = backlog[-1][0] if backlog else 0
            quiet_since = time.monotonic()
            while True:
                get = asyncio.ensure_future(sub.queue.get())
                done, _ = await asyncio.wait({get, left}, timeout=STOP_POLL_S, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    if left in done:
                        return
                    if f.stopping():
                        await self._send(send, _body(b'event: bye\ndata: {"reason": "the supervisor is stopping"}\n\n'))
                        await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
                        return
                    if time.monotonic() - quiet_since >= f.keepalive_s:
                        await self._send(send, _body(b": keepalive\n\n"))
                        quiet_since = time.monotonic()
                    continue
                item = get.result()
                if item is _DROPPED:
                    await self._send(send, _body(b'event: overflow\ndata: {"reason": "client fell behind"}\n\n'))
                    await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
                    return
                n, ev = item
                if n > sent:
                    await self._send(send, _body(f.format(n, ev)))
                    sent = n
                    quiet_since = time.monotonic()
        except (TimeoutError, asyncio.TimeoutError):
            log.warning("event stream: a client has not read for %gs; closing it", f.write_timeout_s)
        except OSError:  # the client went away mid-write
            pass
        finally:
            left.cancel()
            f.unsubscribe(sub)

    async def _send(self, send: Callable, message: dict) -> None:
        await asyncio.wait_for(send(message), self.fanout.write_timeout_s)


def _body(data: bytes) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": True}


async def _wait_disconnect(receive: Callable) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
