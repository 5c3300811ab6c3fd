"""One pass: take in the events recorded since the last one, then turn the observed and the wanted
state into actions (supervisor/core/actions.py) for supervisor/effects/ to carry out. Deterministic
and free of I/O: the node is data and the clock is given, so table tests drive it with events and
read the actions (tests/supervisor/decisions/test_supervisor_decisions.py). Re-adoption is the first pass's work."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from supervisor.core import (adoption, admin, boot, daemons, engine_health, engines, healing, kv_handover, lifecycle,
                             shutdown, spawn)
from supervisor.core.actions import Action, Publish
from supervisor.core.events import (CHILD_EVENTS, AdoptionChecked, Asked, DaemonAnswered, Event, ExitRead, Exited,
                                    GroupsGone, HealthChecked, Launched, LaunchFailed, Pinged, ReadyChecked, Said,
                                    StopAsked, Surveyed)
from supervisor.core.failover import ensure_primary, route
from supervisor.core.model import Node
from supervisor.core.states import State
from supervisor.core.stuck import judge

log = logging.getLogger("understudy")

TICK_S = 0.1  # a pass at least this often: heartbeat, startup, drain and load timeouts, periodic probes
POLLED = (State.STARTING, State.ATTACHING, State.WARMING)  # states whose probes are scheduled by next_check_at

CHILD_RULES: dict[tuple[str, type], Callable[..., None]] = {
    ("engine", Launched): engines.launched, ("engine", LaunchFailed): engines.launch_failed,
    ("engine", Exited): engines.exited, ("engine", ExitRead): engines.exit_read,
    ("engine", Said): engine_health.said, ("engine", ReadyChecked): engine_health.ready_checked,
    ("engine", HealthChecked): engine_health.health_checked,
    ("daemon", Launched): daemons.launched, ("daemon", LaunchFailed): daemons.launch_failed,
    ("daemon", Exited): daemons.exited, ("daemon", ExitRead): daemons.exit_read,
    ("daemon", DaemonAnswered): daemons.answered, ("daemon", Pinged): daemons.pinged,
    ("spawn_server", Launched): spawn.launched, ("spawn_server", LaunchFailed): spawn.launch_failed,
    ("spawn_server", Exited): spawn.exited, ("spawn_server", ExitRead): spawn.exit_read,
    ("spawn_server", Pinged): spawn.pinged,
}
NODE_RULES: dict[type, Callable[..., None]] = {
    Asked: admin.asked, Surveyed: adoption.surveyed, AdoptionChecked: adoption.checked, GroupsGone: adoption.gone,
    StopAsked: lambda node, ev: lifecycle.begin_stop(node, ev.why, ev.exit_code or None),
}
STARTS: dict[str, Callable[..., None]] = {"engine": engines.start, "daemon": daemons.start,
                                          "spawn_server": spawn.start}


def reconcile(node: Node, events: Iterable[Event], now: float, wall: float) -> list[Action]:
    """Apply ``events`` (oldest first) at monotonic ``now`` (wall time ``wall``); the actions decided."""
    node.now, node.wall = now, wall
    for ev in events:
        _guarded(node, take, ev)
    _guarded(node, decide)
    out, node.out = node.out, []
    return out


def take(node: Node, ev: Event) -> None:
    """One event into the node. Events of an earlier incarnation are dropped here, except a launch
    (a superseded process must be fenced) and an exit status (logged)."""
    if isinstance(ev, CHILD_EVENTS):
        child = node.child(ev.name)
        if child is None:
            return
        if not isinstance(ev, (Launched, ExitRead)) and ev.incarnation != child.incarnation:
            return
        rule = CHILD_RULES.get((child.kind, type(ev)))
        if rule is not None:
            rule(node, child, ev)
    else:
        NODE_RULES[type(ev)](node, ev)


def decide(node: Node) -> None:
    """The level-triggered rules: what the node should be doing now, whatever brought this pass."""
    adoption.advance(node)
    boot.boot(node)
    if node.stopping:
        shutdown.advance(node)
    else:
        for child in node.children():
            if lifecycle.restart_due(node, child):
                STARTS[child.kind](node, child)
        for d in node.daemons:
            daemons.check(node, d)
        if node.spawn is not None:
            spawn.check(node, node.spawn)
        for e in list(node.engines.values()):
            engines.launch_if_due(node, e)
            engine_health.check(node, e)
        kv_handover.check(node)
        ensure_primary(node)
        healing.heal(node)
    admin.advance_rollout(node)
    judge(node)
    route(node)


def _guarded(node: Node, fn: Callable[..., None], *args: Any) -> None:
    """A bug in one rule must not stop the node: logged and published, the pass goes on."""
    try:
        fn(node, *args)
    except Exception as e:  # noqa: BLE001
        what = type(args[0]).__name__ if args else fn.__name__
        log.exception("supervisor bug while taking %s (serving goes on)", what)
        node.emit(Publish({"type": "internal_error", "task": what, "error": repr(e)[:300]}))


def wake_in(node: Node) -> float:
    """Seconds until the next timed decision (a backoff restart, a probe that is due), at most TICK_S:
    the resolution of the timeouts, which every pass checks."""
    due = [c.retry_at for c in node.children() if c.retry_at is not None]
    due += [c.next_check_at for c in node.children() if c.pid and not c.checking and c.state in POLLED]
    return max(0.0, min([TICK_S] + [t - node.now for t in due]))
