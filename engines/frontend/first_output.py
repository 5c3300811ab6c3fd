"""Where a request's time to its first output goes, as the engine's HTTP front end sees it:
Prometheus histograms on the engine's `GET /metrics`, beside its serving gauges.

ingress: the request's HTTP call in the front end -> handed to the core (body, parsing,
validation, the response head); queue: arrival in the core -> first scheduled; core: arrival in the
core -> first output (queue, prefill, sampling, read-back, detokenizing); front end: handed to the
core -> first output back in the front end (the core plus both hops of the link and the front end's
own event loop)."""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from wire.stream_timing import FIRST_OUTPUT_BUCKETS
from engines.core.sequence import Output

ARRIVED: ContextVar[float | None] = ContextVar("understudy_request_arrived", default=None)


class FirstOutputLatency:
    """The four histograms; `submitted` times a request's ingress, `observe` takes every Output and
    uses the first one of a request."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=FIRST_OUTPUT_BUCKETS, registry=self.registry)
        self.ingress = histogram("understudy_engine_ingress_seconds",
                                 "HTTP request in the front end -> handed to the engine core")
        self.queue = histogram("understudy_engine_queue_seconds", "Arrival in the engine core -> first scheduled")
        self.core = histogram("understudy_engine_core_first_output_seconds",
                              "Arrival in the engine core -> the request's first output")
        self.frontend = histogram("understudy_engine_first_output_seconds",
                                  "Handed to the core by the HTTP front end -> first output back there")

    def submitted(self) -> float:
        """The request is being handed to the core: time.monotonic(), its ingress observed."""
        now = time.monotonic()
        if (arrived := ARRIVED.get()) is not None:
            self.ingress.observe(now - arrived)
        return now

    def observe(self, submitted: float, out: Output) -> None:
        """`submitted`: time.monotonic() when the front end handed the request to the core."""
        if out.timing is None:
            return
        queued, core = out.timing
        self.queue.observe(queued)
        self.core.observe(core)
        self.frontend.observe(time.monotonic() - submitted)

    def render(self) -> str:
        return generate_latest(self.registry).decode()


def stamp_arrival(app: Callable[[dict, Callable, Callable], Awaitable[None]]):
    """ASGI wrapper: each HTTP request's arrival, for `FirstOutputLatency.submitted` (a context
    variable: set in the request's task, read where its endpoint hands it to the core, without
    passing the ASGI scope down to the endpoints)."""
    async def stamped(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            ARRIVED.set(time.monotonic())
        await app(scope, receive, send)
    return stamped
