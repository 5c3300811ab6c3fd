"""Carrying out a pass's actions: the router's switch and fences first (a failover is decided and
done in the same pass), the quick ones in place, the slow ones (starts, probes, exit statuses,
re-adoption checks) as tasks whose results come back as events. After the pass: state.json and
children.json once if anything they show changed, the gauges, systemd's watchdog, orphan reaping."""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any

from supervisor.core.actions import (Action, Answer, Attach, AwaitGone, CheckAdoptable, Drain, Fence, Finish, Hold,
                                     LossCause,
                                     Measure, NextPrimary, Notify, Probe, Promote, Publish, Reap, RouterFlags, Start,
                                     Stop, Survey, SweepLinks, Tell)
from supervisor.core.events import (AdoptionChecked, DaemonAnswered, Event, ExitRead, GroupsGone, HealthChecked,
                                    LaunchFailed, Pinged, ReadyChecked, Surveyed)
from supervisor.core.model import Node
from supervisor.effects.checks import Checks, out_of_descriptors
from supervisor.effects.control import ControlChannel
from supervisor.effects.launcher import Launcher
from supervisor.effects.processes import kill_group
from supervisor.effects.publisher import Publisher
from supervisor.effects.reaper import Reaper
from supervisor.effects.sdnotify import Notifier
from supervisor.effects.survey import Surveyor
from supervisor.router.routing import RoutingTable, Upstream

log = logging.getLogger("understudy")

URGENT = (Fence, Tell, Promote, Hold)
REAP_ORPHANS_S = 1.0


class Effects:
    """The parts that act on the world, and what to call with each result (``record``)."""

    def __init__(self, *, table: RoutingTable, launcher: Launcher, reaper: Reaper, checks: Checks,
                 surveyor: Surveyor, publisher: Publisher, control: ControlChannel, notifier: Notifier,
                 record: Callable[[Event], None], answer: Callable[[Answer], None],
                 persist: Callable[[Node], None], finish: Callable[[int], Coroutine[Any, Any, None]]) -> None:
        self.table, self.launcher, self.reaper, self.checks = table, launcher, reaper, checks
        self.surveyor, self.publisher, self.control, self.notifier = surveyor, publisher, control, notifier
        self.record, self.answer, self.persist, self.finish = record, answer, persist, finish
        self.tasks: set[asyncio.Task] = set()
        self._last_watchdog = self._last_reap = 0.0
        self._reap_errors = 0
        self._quick: dict[type, Callable[[Any], object]] = {  # done in place
            Fence: lambda a: kill_group(a.pid), Stop: lambda a: kill_group(a.pid, a.sig),
            Promote: self._promote, LossCause: lambda a: self.table.note_loss(a.epoch, a.evidence), Hold: self._hold, RouterFlags: self._flags, NextPrimary: self._next,
            Tell: self._tell, Publish: self.publisher.publish, Measure: self.publisher.measure,
            Notify: self.publisher.notify, Answer: self.answer, Attach: self.launcher.attach,
            SweepLinks: self.reaper.sweep_links}
        self._slow: dict[type, Callable[[Any], Coroutine[Any, Any, Event | None]]] = {  # tasks: results as events
            Start: self.launcher.start, Probe: self.checks.probe, Reap: self.reaper.reap, Drain: self._drain,
            Survey: self.surveyor.survey, CheckAdoptable: self.surveyor.check, AwaitGone: self.surveyor.await_gone,
            Finish: lambda a: self.finish(a.exit_code)}

    def carry_out(self, actions: list[Action]) -> None:
        for a in sorted(actions, key=lambda a: not isinstance(a, URGENT)):  # (a stable sort: in order otherwise)
            if type(a) in self._quick:
                self._quick[type(a)](a)
            else:
                self._task(self._slow[type(a)](a), a)

    def _promote(self, a: Promote) -> None:
        if a.lost_epoch is not None:
            self.table.mark_lost(a.lost_epoch)  # requests in flight on the fenced primary are retried now
        self.table.set_primary(Upstream(a.url, a.name, a.epoch, self.checks.abilities_of(a.url)))
        if a.detected_at is not None:
            self.table.start_failover_clock(a.epoch, a.detected_at)  # the router observes failover_seconds

    def _hold(self, a: Hold) -> None:
        if a.lost_epoch is not None:
            self.table.mark_lost(a.lost_epoch)
        self.table.set_primary(None, a.reason)

    def _flags(self, a: RouterFlags) -> None:
        self.table.drained = a.drained
        if a.stopping:
            self.table.stop()

    def _next(self, a: NextPrimary) -> None:
        self.table.set_next_primary(a.url or None)

    def _task(self, coro: Coroutine[Any, Any, Event | None], action: Action) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=action.brief())
        self.tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, action))

    def _done(self, task: asyncio.Task, action: Action) -> None:
        """The result goes back to the loop as an event. A bug is logged and published, never silent,
        and reported as the action's failure (a child never waits for an answer that will not come)."""
        self.tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            if task.result() is not None:
                self.record(task.result())
            return
        log.error("internal error in task %s (serving goes on)", task.get_name(), exc_info=exc)
        self.publisher.bus.publish({"type": "internal_error", "task": task.get_name(), "error": repr(exc)[:300]})
        failure = failed(action, f"{type(exc).__name__}: {exc}")
        if failure is not None:
            self.record(failure)

    def _tell(self, a: Tell) -> None:
        self.control.send_now(a.name, a.incarnation, {"cmd": a.cmd})  # (a failed send: its deadline takes it)

    async def _drain(self, a: Drain) -> None:
        if not await self.control.send(a.name, a.incarnation, {"cmd": "drain"}):
            kill_group(a.pid, signal.SIGTERM)

    def after_pass(self, node: Node) -> None:
        now = time.monotonic()
        if node.dirty:
            node.dirty = False
            self.persist(node)
            self.publisher.gauges(node)
        wd = self.notifier.watchdog_interval_s
        if wd is not None and not node.stuck and now - self._last_watchdog >= wd:
            self._last_watchdog = now
            self.notifier.watchdog()
        if now - self._last_reap >= REAP_ORPHANS_S:
            self._last_reap = now
            try:
                self.reaper.orphans({c.pid for c in node.children() if c.pid})
            except OSError as e:  # e.g. EMFILE: the node keeps serving; the next round tries again
                self._reap_errors += 1
                if self._reap_errors in (1, 10, 100) or self._reap_errors % 1000 == 0:
                    log.error("reaping orphans failed (%d times so far): %r; serving goes on", self._reap_errors, e)

    def cancel(self) -> None:
        for task in list(self.tasks):
            task.cancel()


def failed(a: Action, error: str) -> Event | None:
    """What an action that raised reports: its failure, in the event it would have answered with."""
    if isinstance(a, Start):
        return LaunchFailed(a.name, a.incarnation, error)
    if isinstance(a, Reap):
        return ExitRead(a.name, a.incarnation, a.pid, None)
    if isinstance(a, Probe):
        local = out_of_descriptors()  # (e.g. EMFILE reading the golden answer: not the child's failure)
        return {"ready": ReadyChecked(a.name, a.incarnation, listening=False),
                "health": HealthChecked(a.name, a.incarnation, error, local),
                "status": DaemonAnswered(a.name, a.incarnation, None, error)}.get(
            a.what, Pinged(a.name, a.incarnation, False, error, local))
    if isinstance(a, Survey):
        return Surveyed({}, error=error)
    if isinstance(a, CheckAdoptable):
        return AdoptionChecked({}, error=error)
    if isinstance(a, AwaitGone):
        return GroupsGone(a.pids)
    return None
