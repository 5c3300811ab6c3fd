"""What an admin asks (promote, drain, undrain, restart, rollout) as decisions; each request gets one
Answer (a rollout's when every engine was replaced, or when it stopped)."""
from __future__ import annotations

import logging
from typing import Any

from supervisor.core import engines, kv_handover, spawn
from supervisor.core.actions import Answer, Publish
from supervisor.core.events import Asked
from supervisor.core.failover import promote
from supervisor.core.model import Node, Rollout
from supervisor.core.states import Role, State

log = logging.getLogger("understudy")

Reply = tuple[int, dict[str, Any]]


def asked(node: Node, ev: Asked) -> None:
    if ev.intent in ("drain", "undrain"):
        status, body = set_drained(node, ev.intent == "drain")
    elif node.stopping:
        status, body = 409, {"error": "the supervisor is stopping"}
    elif ev.intent == "promote":
        status, body = switch_over(node)
    elif ev.intent == "restart":
        status, body = restart(node, ev.engine, ev.force)
    elif ev.intent == "rollout":
        status, body = begin_rollout(node, ev.request)
        if status == 0:
            return  # answered when it ends (advance_rollout)
    else:
        status, body = 404, {"error": f"unknown admin request {ev.intent!r}"}
    node.emit(Answer(ev.request, status, body))


def set_drained(node: Node, drained: bool) -> Reply:
    """Node drain: /readyz fails so the load balancer moves away; requests still get served."""
    node.drained = drained
    node.dirty = True
    log.info("node %s by admin", "drained" if drained else "undrained")
    node.emit(Publish({"type": "drained", "drained": drained}))
    return 200, {"drained": drained}


def switch_over(node: Node) -> Reply:
    """Planned switchover: the READY standby serves; the old primary drains and comes back as standby."""
    standby = node.ready_standby()
    if standby is None:
        return 409, {"error": "no READY standby to promote (" + ", ".join(
            f"{s.name}: {s.role.value} {s.state.value}" for s in node.engines.values()) + ")"}
    if node.promoting is not None or node.demoting is not None:
        return 409, {"error": "a switch of primary is already under way"}
    old = node.primary_engine()
    if old is not None and old.kv_writer and old.pid:  # it hands its requests off first (kv_handover.py)
        kv_handover.switch_over(node, old, standby)
        return 200, {"primary": standby.name, "epoch": node.epoch + 1, "previous": old.name}
    promote(node, standby, "promote", node.now, old.name if old else "")
    if old is not None and old is not standby:
        engines.stop(node, old, restart=True)
    epoch = node.epoch + (node.promoting is not None)  # (a promotion under way: the epoch it will have)
    return 200, {"primary": standby.name, "epoch": epoch, "previous": old.name if old else None}


def restart(node: Node, name: str, force: bool) -> Reply:
    """Restart one engine (resets FATAL); the primary is switched over first."""
    e = node.engines.get(name)
    if e is None:
        return 404, {"error": f"unknown engine {name!r} (engines: {', '.join(node.engines)})"}
    e.policy.reset()
    if e.role == Role.PRIMARY and node.primary == name:
        if node.ready_standby() is not None:
            status, body = switch_over(node)
            return status, {"restarting": name, **body}
        if not force:
            return 409, {"error": f"{name} is the primary and no standby is READY: a restart would hold traffic; "
                                  "retry when a standby is READY, or pass force=true"}
    was = e.state.value
    engines.stop(node, e, restart=True)
    return 200, {"restarting": name, "was": was}


def begin_rollout(node: Node, request: int) -> Reply:
    """Restart every engine in turn (a new spawn server first, standbys next, then a switchover and
    the old primary), never dropping traffic. Status 0: under way."""
    if node.rollout is not None and node.rollout.running:
        return 409, {"error": "a rollout is already running"}
    if node.ready_standby() is None:
        return 409, {"error": "rollout needs a READY standby so that traffic never waits"}
    steps = ["spawn-server"] if node.spawn is not None and node.spawn.state == State.READY else []
    steps += [e.name for e in node.engines.values() if e.role == Role.STANDBY] + ["promote"]
    node.rollout = Rollout(request, steps, started=node.wall,
                           incarnations={e.name: e.incarnation for e in node.engines.values()})
    node.dirty = True
    advance_rollout(node)
    return 0, {}


def advance_rollout(node: Node) -> None:
    """Wait for the child being replaced to be READY again, then take the next step."""
    r = node.rollout
    while r is not None and r.running:
        if node.promoting is not None or node.demoting is not None:
            return  # a switch of primary is under way (shared KV): the next step waits for it
        if r.waiting is not None:
            c = node.child(r.waiting)
            if node.stopping or c.state == State.FATAL or node.now > r.deadline:
                end_rollout(node, 500, {"error": f"rollout stopped: {c.name} is {c.state.value} ({c.reason})"})
                return
            if c.state != State.READY or c.stop_requested:
                return
            if c.kind == "engine":
                r.done.append(c.name)
            r.waiting = None
        if not r.steps:
            end_rollout(node, 200, {"restarted": list(r.done), "primary": node.primary, "epoch": node.epoch})
            return
        step = r.steps.pop(0)
        if step == "spawn-server":  # new engine code is picked up by a fresh spawn server
            spawn.stop(node, node.spawn, restart=True)
            r.waiting, r.deadline = node.spawn.name, node.now + node.settings.spawn_ready_s
            continue
        target = node.primary_engine() if step == "promote" else node.engines[step]
        if target is None:
            continue
        if step == "promote":
            status, body = switch_over(node)
            if status != 200:
                end_rollout(node, status, body)
                return
        elif target.incarnation == r.incarnations.get(target.name):
            engines.stop(node, target, restart=True)
        # (else it was restarted since the rollout began, e.g. after a crash: it runs the new code
        # already, and a stop while it starts would only kill it: it is waited for instead)
        r.waiting, r.deadline = target.name, node.now + node.settings.failover.startup_timeout_s


def end_rollout(node: Node, status: int, body: dict[str, Any]) -> None:
    r = node.rollout
    r.running = False
    node.dirty = True
    node.emit(Answer(r.request, status, body))
