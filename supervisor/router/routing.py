"""Who gets the traffic: the current primary (URL, name, epoch), the drained flag, and a way for
requests to wait for a primary instead of failing during a failover."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from wire.interrupt import Interrupt
from supervisor.router.abilities import Abilities
from supervisor.router.collector_hold import CollectorHold

T = TypeVar("T")
log = logging.getLogger("understudy.router")


class PrimaryLost(Exception):
    """The primary a request was sent to was fenced before it answered."""


@dataclass(frozen=True)
class Upstream:
    url: str
    name: str
    epoch: int
    abilities: Abilities | None = None  # an external engine's (None: ours)


class RoutingTable:
    """Written by the supervisor loop, read by the router; both run in the same loop."""

    def __init__(self) -> None:
        self.primary: Upstream | None = None
        self.drained = False
        self.stopping = False
        self._not_ready = "starting: no engine READY yet"
        self.explain: Callable[[], str] | None = None  # what each engine is doing (supervisor/core/why.py)
        self._waiting: set[asyncio.Future[None]] = set()  # wait_primary's, each resolved at the next change
        # Called at each change (a primary, a hold, the router stopping), before the waiting requests
        # wake: a failover's continuations are sent from here (supervisor/router/batching.py).
        self.on_change: list[Callable[[], None]] = []
        self.next_primary: str | None = None  # the URL of the engine a failover would promote now
        self.on_next: list[Callable[[], None]] = []  # called when it changes (batching.Batcher keeps it warm)
        self._failover_clock: tuple[int, float, float] | None = None  # (new epoch, failure detected at, promoted at)
        self.on_failover_seconds: Callable[[float], None] = lambda secs: None  # (the metric: attempts.Upstreams)
        self.requests_in_progress = 0  # received, not yet answered (supervisor/router/proxy.py)
        self._lost: set[int] = set()  # recent epochs whose primary was fenced
        self._evidence: dict[int, bool] = {}  # recent lost epochs: did the primary die of something a request can cause
        self._evidence_waiters: dict[int, list[asyncio.Future[bool]]] = {}
        self._calls: dict[int, set[Interrupt]] = {}  # epoch -> calls in flight to that primary
        self.on_lost: list[Callable[[int, set[Interrupt]], None]] = []  # (epoch, the calls interrupted) at a fence
        self.collector = CollectorHold()

    @property
    def not_ready_reason(self) -> str:
        """Why there is no primary: the last event (boot, failover), then each engine's obstacle."""
        detail = self.explain() if self.explain is not None else ""
        return f"{self._not_ready}; {detail}" if detail else self._not_ready

    @not_ready_reason.setter
    def not_ready_reason(self, reason: str) -> None:
        self._not_ready = reason

    def mark_lost(self, epoch: int) -> None:
        """The primary of `epoch` was fenced: requests still waiting on it are retried elsewhere
        now, instead of when its sockets close (after the kernel has torn its GPU context down).
        No collection pauses the loop while they are (supervisor/router/collector_hold.py)."""
        self.collector.hold()
        self._lost = {e for e in self._lost if e >= epoch - 4} | {epoch}
        calls = self._calls.pop(epoch, ())
        for call in calls:
            call.fire()
        # (the count: the streams not among them had lost this primary already, their sockets closed
        # first; one with an attempt still in flight there is warned of by migrating.Migrator)
        log.info("epoch %d fenced: %d calls to its primary interrupted (requests and batches)", epoch, len(calls))
        _tell(self.on_lost, epoch, set(calls))

    def note_loss(self, epoch: int, evidence: bool) -> None:
        """How the primary of `epoch` died (the supervisor read its exit status): `evidence` unless it
        was SIGKILLed from outside, which no request causes."""
        self._evidence = {e: v for e, v in self._evidence.items() if e >= epoch - 8} | {epoch: evidence}
        for waiter in self._evidence_waiters.pop(epoch, ()):
            if not waiter.done():
                waiter.set_result(evidence)

    async def loss_evidence(self, epoch: int, timeout_s: float) -> bool:
        """Whether the loss of `epoch` may be the request's doing: its cause once known (waiting up to
        `timeout_s` for the exit status), True when still unknown (the safe side of a quarantine)."""
        if epoch in self._evidence:
            return self._evidence[epoch]
        waiter = asyncio.get_running_loop().create_future()
        self._evidence_waiters.setdefault(epoch, []).append(waiter)
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            return True

    def is_lost(self, epoch: int) -> bool:
        """The primary of `epoch` was fenced (a recent epoch)."""
        return epoch in self._lost

    async def unless_lost(self, epoch: int, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` (a call to the primary of `epoch`) in this task; raise PrimaryLost if that
        primary is fenced first (mark_lost interrupts the call)."""
        if self.is_lost(epoch):
            coro.close()
            raise PrimaryLost(f"epoch {epoch} primary fenced")
        interrupt = Interrupt()
        calls = self._calls.setdefault(epoch, set())
        calls.add(interrupt)
        try:
            with interrupt:
                return await coro
            raise PrimaryLost(f"epoch {epoch} primary fenced")  # (reached only when interrupted)
        finally:
            calls.discard(interrupt)
            if not calls and self._calls.get(epoch) is calls:
                del self._calls[epoch]

    def start_failover_clock(self, epoch: int, detected_at: float) -> None:
        """A failover promoted epoch `epoch`: its clock stops at that epoch's first success, or at once
        when no request is in progress (no client waits: the node serves again from now, and a quiet
        node's idle time is no failover's). A clock still running at the next failover stops at its
        own promotion (every failover is observed once)."""
        now = time.monotonic()
        if self._failover_clock is not None:
            self.on_failover_seconds(self._failover_clock[2] - self._failover_clock[1])
        self._failover_clock = None
        if self.requests_in_progress:
            self._failover_clock = (epoch, detected_at, now)
        else:
            self.on_failover_seconds(now - detected_at)

    def first_success(self, epoch: int, began_at: float | None = None) -> None:
        """A response of the primary of `epoch` began going to its client at `began_at` (default now):
        the end of that epoch's failover clock, if it still runs."""
        clock = self._failover_clock
        if clock is not None and clock[0] == epoch:
            self._failover_clock = None
            self.on_failover_seconds((time.monotonic() if began_at is None else began_at) - clock[1])

    def set_primary(self, up: Upstream | None, reason: str = "") -> None:
        """Switch traffic (None = hold requests); wakes every waiting request."""
        self.primary = up
        if up is None:
            self.not_ready_reason = reason or "no primary"
        self._wake()

    def set_next_primary(self, url: str | None) -> None:
        """The engine a failover would promote now (None: none is ready)."""
        self.next_primary = url
        _tell(self.on_next)

    def stop(self) -> None:
        """The supervisor is stopping: held requests get their 503 now instead of at the deadline."""
        self.stopping = True
        self._wake()

    def _wake(self) -> None:
        """Tell the listeners, then wake every request waiting in wait_primary. (The supervisor's pass
        calls this: a listener's failure is logged, never the pass's.)"""
        _tell(self.on_change)
        for waiter in self._waiting:
            _settle(waiter)
        self._waiting.clear()

    async def wait_primary(self, deadline: float, not_epoch: int | None = None,
                           settle_s: float | None = None) -> Upstream | None:
        """The primary once there is one (with an epoch other than ``not_epoch``, or the same one
        after ``settle_s``); None at ``deadline`` (monotonic)."""
        retry_same_at = time.monotonic() + settle_s if settle_s is not None else None
        while True:
            if self.stopping:
                return None
            p = self.primary
            now = time.monotonic()
            if p is not None and (not_epoch is None or p.epoch != not_epoch
                                  or (retry_same_at is not None and now >= retry_same_at)):
                return p
            wake = min(deadline, retry_same_at) if retry_same_at is not None else deadline
            if now >= deadline:
                return None
            await self._change(max(wake - now, 0.001))

    async def _change(self, timeout_s: float) -> None:
        """Until the primary changes (`_wake`), or `timeout_s`. A future and a timer of its own, not
        `asyncio.wait_for` (a task each, and two more loop rounds before a woken request runs: a
        failover wakes 256 at once, and their continuations go out once the last has run)."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiting.add(waiter)
        timer = loop.call_later(timeout_s, _settle, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiting.discard(waiter)


def _tell(listeners: list[Callable[..., None]], *args: Any) -> None:
    """Call each listener with ``args``; one that fails is logged (the supervisor's pass calls this: never
    its failure)."""
    for listener in listeners:
        try:
            listener(*args)
        except Exception:  # noqa: BLE001
            log.exception("the router's listener %r failed", listener)


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
