"""Chaos's load: requests at a fixed arrival rate through the data port (harness/load's OpenRate, at
most `concurrency` in flight), a seeded mix of endpoints and of streaming; every request becomes a
record, with wall-clock times (those of the faults, events and status polls)."""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

from harness.load.client import Client
from harness.load.request import CHAT, COMPLETIONS, Request
from harness.load.result import RequestResult, longest_wait
from harness.load.schedules import OpenRate

from .records import RequestRecord

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
PATHS = {"completion": COMPLETIONS, "chat": CHAT}
MAX_CHUNK_TIMES = 4096  # per record
ERRORS = {"refused": "connect", "connect": "connect", "timeout": "timeout", "bad_body": "bad_body",
          "bad_event": "bad_chunk", "error_event": "stream_error", "cut": "stream_broken",
          "cancelled": "cancelled_at_stop"}  # the load's failures as the report counts them


class LoadGenerator:
    """Sends `rate` requests/s (at most `concurrency` in flight) until stopped or the deadline."""

    def __init__(
        self,
        data_url: str,
        model: str,
        *,
        rate: float,
        concurrency: int,
        mix: dict[str, float],
        stream_fraction: float,
        max_tokens: int,
        timeout_s: float,
        seed: int = 0,
    ) -> None:
        self.model, self.mix, self.stream_fraction, self.max_tokens = model, mix, stream_fraction, max_tokens
        self.timeout_s = timeout_s
        self._rng = random.Random(seed)
        self._client = Client(data_url, timeout_s, connect_timeout_s=timeout_s, clock=time.time, keep_text=True,
                              every_event=True)
        self._rate = OpenRate(self._client, rate, concurrency=concurrency)

    @property
    def records(self) -> list[RequestRecord]:
        """Every request sent, in order (its id)."""
        return [record(i, r) for i, r in enumerate(self._client.results)]

    @property
    def not_sent(self) -> int:
        """Arrivals not sent: `concurrency` requests were in flight."""
        return self._rate.not_sent

    async def run(self, stop: asyncio.Event, deadline: float) -> None:
        """Send until `stop` is set or time.time() passes `deadline`; then let in-flight finish."""
        await self._rate.run(self._requests(), stop, deadline, drain_s=self.timeout_s + 2.0)

    def _requests(self) -> Iterator[Request]:
        endpoints = list(self.mix)
        while True:
            endpoint = self._rng.choices(endpoints, weights=[self.mix[e] for e in endpoints])[0]
            body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0,
                    "stream": self._rng.random() < self.stream_fraction}
            if endpoint == "chat":
                body["messages"] = [{"role": "user", "content": PROMPT}]
            else:
                body["prompt"] = PROMPT
            yield Request.of(body, PATHS[endpoint])


def record(i: int, r: RequestResult) -> RequestRecord:
    """Request number `i` as the report reads it: its first byte (a stream's first event, else the
    answer's head), whether a stream was cut after its 200, its longest wait for an event."""
    answered = r.status == 200
    events = r.event_times or []
    return RequestRecord(
        id=i, endpoint="chat" if r.path == CHAT else "completion", stream=r.stream, t_start=r.sent,
        t_end=r.end or 0.0, t_first=(events[0] if events else None) if r.stream else r.head if answered else None,
        ok=r.ok, status=r.status, error=error_kind(r), engine=r.engine, epoch=r.epoch, retries=r.retries,
        response_id=r.response_id, text=r.text, cut=r.stream and answered and not r.ok,
        max_gap_s=longest_wait(r.sent, events) if r.stream and answered else None,
        chunk_times=events[:MAX_CHUNK_TIMES])


def error_kind(r: RequestResult) -> str | None:
    """The failure's kind, e.g. "connect", "timeout", "http_503", "stream_broken"."""
    if r.failure is None:
        return None
    if r.failure == "http":
        return f"http_{r.status}"
    if r.failure == "broken":
        return "stream_broken" if r.status == 200 else "disconnected"
    return ERRORS[r.failure]

