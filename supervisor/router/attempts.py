"""One request's attempts, for plain requests (proxy.py) and continued ones (migrating.py) alike: each
attempt goes to the current primary; with none (a failover), the request waits for one instead of
failing, up to hold_timeout_s; after a failed attempt it waits for a primary of a new epoch (or the
same one, once it had SAME_PRIMARY_RETRY_S to settle). A call whose primary is fenced meanwhile is
interrupted (PrimaryLost) and tried again at once."""
from __future__ import annotations

import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from supervisor.metrics import Metrics
from supervisor.router.routing import RoutingTable, Upstream
from supervisor.router.upstream import Client

T = TypeVar("T")

RETRY_STATUSES = frozenset({502, 503})  # engine refusing (draining) or not there: another primary may serve
SAME_PRIMARY_RETRY_S = 0.25


class Upstreams:
    """What every request shares: the routing table, the upstream client, the metrics, the hold policy."""

    def __init__(self, table: RoutingTable, metrics: Metrics, client: Client, *, hold_timeout_s: float,
                 retry_after_s: int, upstream_timeout_s: float) -> None:
        self.table, self.metrics, self.client = table, metrics, client
        table.on_failover_seconds = metrics.failover_seconds.observe  # failure detected -> new primary serving
        self.hold_timeout_s, self.retry_after_s = hold_timeout_s, retry_after_s
        self.upstream_timeout_s = upstream_timeout_s
        self._by_code: dict[int, Any] = {}  # status -> router_requests child (labels() is not free)

    def attempts(self) -> "Attempts":
        return Attempts(self)

    def count_status(self, status: int) -> None:
        counter = self._by_code.get(status)
        if counter is None:
            counter = self._by_code[status] = self.metrics.router_requests.labels(code=str(status))
        counter.inc()

    def served(self, epoch: int, status: int, began_at: float | None = None) -> None:
        """A response succeeded: the first success of a new primary ends its failover clock at the
        moment the response began going to the client (a stream's first chunk: as clients time it)."""
        if status < 500:
            self.table.first_success(epoch, began_at)

    def timed_out(self, engine: str) -> str:
        return f"engine {engine} did not answer within router.upstream_timeout_s={self.upstream_timeout_s:g}s"


class Attempts:
    """``while (up := await attempts.primary()) is not None``: send to ``up`` through ``call``, say
    ``failed`` when it did not work, and after the loop ``unavailable()`` says why none was left."""

    def __init__(self, upstreams: Upstreams) -> None:
        self.u = upstreams
        self.deadline = time.monotonic() + upstreams.hold_timeout_s
        self.failed_epoch: int | None = None
        self.last_error = "no primary"

    async def primary(self) -> Upstream | None:
        """The primary for the next attempt, waiting for one if need be; None when the hold ends."""
        table = self.u.table
        up = table.primary
        if up is None or (self.failed_epoch is not None and up.epoch == self.failed_epoch):
            held_at = time.monotonic()
            up = None if table.stopping else await table.wait_primary(
                self.deadline, not_epoch=self.failed_epoch,
                settle_s=SAME_PRIMARY_RETRY_S if self.failed_epoch is not None else None)
            self.u.metrics.router_hold.observe(time.monotonic() - held_at)
        if up is not None and self.failed_epoch is not None:
            self.u.metrics.router_retries.inc()
        return up

    def held(self, seconds: float) -> None:
        """The next attempt went without ``primary()`` (a continuation sent as the next primary came,
        supervisor/router/batching.py), after ``seconds`` on hold."""
        self.u.metrics.router_hold.observe(seconds)
        self.u.metrics.router_retries.inc()

    async def call(self, up: Upstream, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` (a call to ``up``); PrimaryLost if ``up`` is fenced first."""
        return await self.u.table.unless_lost(up.epoch, coro)

    def failed(self, up: Upstream, what: str | Exception) -> None:
        """The attempt on ``up`` failed: the next goes to a new primary."""
        why = what if isinstance(what, str) else f"{type(what).__name__} {what}".strip()
        self.failed_epoch, self.last_error = up.epoch, f"{up.name}: {why}"

    def may_retry(self, status: int) -> bool:
        """An engine answered ``status``: may the request go to another primary?"""
        return status in RETRY_STATUSES and time.monotonic() < self.deadline

    def hold_again(self) -> None:
        """A new hold (a continuation after a lost primary): the request waits up to hold_timeout_s more."""
        self.deadline = time.monotonic() + self.u.hold_timeout_s

    def unavailable(self) -> str:
        """Why no primary took the request."""
        table = self.u.table
        reason = "the supervisor is stopping" if table.stopping else (
            self.last_error if self.failed_epoch is not None else table.not_ready_reason)
        return f"no engine available within {self.u.hold_timeout_s:g}s: {reason}"
