"""Where a request's time to its first output goes, as the engine's HTTP front end sees it:
Prometheus histograms on the engine's `GET /metrics`, beside its serving gauges.

queue: arrival in the core -> first scheduled; core: arrival in the core -> first output (queue,
prefill, sampling, read-back, detokenizing); front end: handed to the core -> first output back
in the front end (the core plus both hops of the link and the front end's own event loop)."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from .sequence import Output

BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class FirstOutputLatency:
    """The three histograms; `observe` takes every Output and uses the first one of a request."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=BUCKETS, registry=self.registry)
        self.queue = histogram("understudy_engine_queue_seconds", "Arrival in the engine core -> first scheduled")
        self.core = histogram("understudy_engine_core_first_output_seconds",
                              "Arrival in the engine core -> the request's first output")
        self.frontend = histogram("understudy_engine_first_output_seconds",
                                  "Handed to the core by the HTTP front end -> first output back there")

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
