"""Who serves: promote a READY standby (epoch + 1) when the primary is lost or none serves yet, hold
requests while none is READY, and tell the router what changed (once per pass)."""
from __future__ import annotations

import logging

from supervisor.core.actions import Hold, NextPrimary, Notify, Promote, Publish, RouterFlags, Tell
from supervisor.core.model import Engine, Failover, Node, Promotion
from supervisor.core.states import Role
from supervisor.core.why import roles_text

log = logging.getLogger("understudy")


def fail_over(node: Node, dead: Engine, reason: str, detected_at: float) -> None:
    """The primary is gone (already fenced): promote a READY standby now, else hold requests until
    one is READY (ensure_primary promotes it then, as this failover)."""
    if node.primary == dead.name:
        node.lost_epoch = dead.lost_epoch = node.epoch  # the router retries what was in flight there at once
    node.primary = None
    standby = node.ready_standby()
    if standby is not None:
        promote(node, standby, reason, detected_at, dead.name)
        return
    node.pending_failover = Failover(reason, detected_at, dead.name)
    node.hold_reason = f"failover after {dead.name} {reason}: no READY standby yet"
    node.dirty = True
    log.warning("failover: %s lost (%s) and no standby is READY; holding requests up to %gs",
                dead.name, reason, node.settings.failover.hold_timeout_s)


PROMOTE_TIMEOUT_S = 5.0  # shared KV: a standby that has not taken the pool by then is failed


def ensure_primary(node: Node, prefer: Engine | None = None) -> None:
    """No primary and a READY standby: it serves (the pending failover, or the boot's first primary)."""
    if node.primary is not None or node.stopping or node.promoting is not None or node.demoting is not None:
        return
    standby = prefer if prefer is not None and prefer is node.ready_standby() else node.ready_standby()
    if standby is None:
        return
    pending, node.pending_failover = node.pending_failover, None
    if pending is None:
        pending = Failover("boot", node.now, "")
    promote(node, standby, pending.reason, pending.detected_at, pending.lost, pending.detail)


def promote(node: Node, engine: Engine, reason: str, detected_at: float, old: str,
            detail: dict | None = None) -> None:
    """``engine`` serves from now on, under epoch + 1 (a failover unless ``reason`` is "boot"). On
    the shared KV pool it is first asked to take the pool (supervisor/core/kv_handover.py)."""
    if node.settings.shared_kv and not engine.kv_writer:
        ask_to_promote(node, engine, reason, detected_at, old, detail)
        return
    node.epoch += 1
    for other in node.engines.values():
        if other is not engine and other.role == Role.PRIMARY:
            other.role = Role.STANDBY
    engine.role = Role.PRIMARY
    engine.last_check = node.now
    engine.probe_progress = engine.progress()
    node.primary = engine.name
    node.dirty = True
    secs = node.now - detected_at
    log.info("%s is primary (epoch %d, %s%s)", engine.name, node.epoch, reason,
             f", {secs * 1000:.1f} ms after detection" if reason != "boot" else "")
    if reason != "boot":
        node.clock = (node.epoch, detected_at)  # the router observes failover_seconds at its first success
        ev = {"type": "failover", "reason": reason, "from": old, "to": engine.name, "epoch": node.epoch,
              "seconds": secs, "ts": node.wall, **(detail or {})}
        node.failovers.append(ev)
        node.emit(Publish(dict(ev)))
    else:
        node.emit(Publish({"type": "promoted", "engine": engine.name, "epoch": node.epoch}))
    announce(node)


def ask_to_promote(node: Node, engine: Engine, reason: str, detected_at: float, old: str,
                   detail: dict | None = None) -> None:
    """The round trip's first half: requests are held until ``engine`` says it took the pool."""
    node.promoting = Promotion(engine.name, engine.incarnation, reason, detected_at, old,
                               node.now + PROMOTE_TIMEOUT_S, dict(detail or {}))
    node.primary = None
    node.hold_reason = f"{engine.name} is taking the KV pool over ({reason})"
    node.dirty = True
    node.emit(Tell(engine.name, engine.incarnation, "promote"))


def restore_primary(node: Node, engine: Engine, epoch: int) -> None:
    """A re-adopted primary serves again under its recorded epoch (no failover). On the shared KV pool
    it is told `promote` again: a writer answers at once; one the last supervisor never heard take
    the pool takes it now."""
    node.epoch = epoch
    engine.role = Role.PRIMARY
    node.primary = engine.name
    node.dirty = True
    if node.settings.shared_kv:
        engine.kv_writer = True
        node.emit(Tell(engine.name, engine.incarnation, "promote"))
    log.info("%s is primary again (epoch %d, adopted)", engine.name, epoch)
    announce(node)


def announce(node: Node) -> None:
    """The first primary: tell systemd and the operator where to send requests."""
    if not node.announced:
        node.announced = True
        node.emit(Notify("ready", roles_text(node)))


def route(node: Node) -> None:
    """What the router must know, emitted when it changed: the primary (with a fenced epoch to give
    up on, and the failover clock), or a hold and why; then the drained and stopping flags."""
    p = node.primary_engine()
    want = ("primary", p.name, p.url, node.epoch) if p is not None else ("hold", node.hold_reason)
    if want != node.routed or node.lost_epoch is not None:
        if p is not None:
            clock = node.clock if node.clock is not None and node.clock[0] == node.epoch else None
            node.emit(Promote(p.name, p.url, node.epoch, node.lost_epoch, clock[1] if clock else None))
        else:
            node.emit(Hold(node.hold_reason, node.lost_epoch))
        node.routed, node.lost_epoch, node.clock = want, None, None
    flags = (node.drained, node.stopping)
    if flags != node.routed_flags:
        node.routed_flags = flags
        node.emit(RouterFlags(*flags))
    standby = node.ready_standby() if not node.stopping else None
    if (next_url := standby.url if standby is not None else "") != node.routed_next:
        node.routed_next = next_url
        node.emit(NextPrimary(next_url))
