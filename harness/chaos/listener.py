"""Subscribe to the supervisor's events socket and collect parsed events until told to stop."""
from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio

from .events import Event, EventParseError, parse_event


class EventListener:
    """zmq SUB on `endpoint`; `events` grows as frames arrive, `errors` keeps malformed ones."""

    def __init__(self, endpoint: str, max_events: int = 1_000_000) -> None:
        self.endpoint = endpoint
        self.max_events = max_events
        self.events: list[Event] = []
        self.errors: list[str] = []
        self.frames = 0
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)  # connects lazily: a missing socket file is not an error yet

    async def run(self, stop: asyncio.Event, poll_s: float = 0.1) -> None:
        """Receive until `stop` is set or max_events is reached; never blocks longer than poll_s."""
        try:
            while not stop.is_set() and len(self.events) < self.max_events:
                if not await self._sock.poll(int(poll_s * 1000)):
                    continue
                parts = await self._sock.recv_multipart()
                self.frames += 1
                try:
                    event = parse_event(parts[-1], time.time())
                except EventParseError as exc:
                    if len(self.errors) < 100:
                        self.errors.append(str(exc))
                    continue
                if event is not None:
                    self.events.append(event)
        finally:
            self.close()

    def close(self) -> None:
        """Close the socket and context (idempotent)."""
        if not self._sock.closed:
            self._sock.close(linger=0)
        if not self._ctx.closed:
            self._ctx.term()
