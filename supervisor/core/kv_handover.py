"""The shared KV pool's writer role as the supervisor moves it (DESIGN.md §2 "The KV pool"; the
engine's side: engines/core/shared_pool.py). Only on a node whose engines run on the daemons' pools.

- A promotion is a round trip (failover.ask_to_promote sends `promote`): the standby takes the pool's
  writer role and says `promoted`, and only then does the router send to it (requests are held
  meanwhile); it reads the pool meanwhile, before its next step, and says `adopted` with what it found. An
  answer `promote_failed`, none within PROMOTE_TIMEOUT_S, or the engine lost meanwhile, fails it;
  the next READY standby is asked, for the same failover.
- A planned switchover (admin promote, restart of the primary, rollout) first tells the primary
  `demote`: it hands its requests off (the router continues them on the successor, from the pool)
  and parks; then the successor is promoted. No answer within DEMOTE_TIMEOUT_S: it is fenced, and
  the switchover goes on as a failover.
- Once a writer's process group is gone, the primary hears `fenced` (supervisor/core/kv_writers.py)."""
from __future__ import annotations

import logging

from supervisor.core import engines
from supervisor.core.actions import Fence, Measure, Publish, Tell
from supervisor.core.events import Said
from supervisor.core.failover import PROMOTE_TIMEOUT_S, promote
from supervisor.core.kv_writers import others_gone
from supervisor.core.model import Demotion, Engine, Failover, Node
from supervisor.core.states import State

log = logging.getLogger("understudy")

DEMOTE_TIMEOUT_S = 5.0
ANSWERS = ("promoted", "promote_failed", "demoted")


def said(node: Node, e: Engine, ev: Said) -> None:
    """An engine's answer to `promote` or `demote`."""
    p, d = node.promoting, node.demoting
    if ev.type == "demoted":
        if d is not None and (d.name, d.incarnation) == (e.name, e.incarnation):
            log.info("%s demoted: %s requests handed off", e.name, ev.fields.get("handed_off"))
            e.kv_writer = False  # it gave the pool up (fenced or dead, it stays a writer until reaped)
            e.heartbeat = {**e.heartbeat, "kv_mode": "parked"}  # (what its next heartbeat says: status need not wait)
            handed_over(node, e)
        return
    if p is None or (p.name, p.incarnation) != (e.name, e.incarnation):
        log.debug("%s: %s with no promotion of it pending", e.name, ev.type)  # (a re-adopted primary's)
        return
    if ev.type == "promote_failed":
        failed(node, e, f"promotion failed: {ev.fields.get('error')}")
        return
    node.promoting = None
    e.kv_writer = True
    e.heartbeat = {**e.heartbeat, "kv_mode": ev.fields.get("kv_mode", "writer")}  # (what its next heartbeat says)
    log.info("%s took the KV pool's writer role (%.1f ms in the engine; it reads the pool as we route to it)",
             e.name, 1e3 * float(ev.fields.get("seconds") or 0))
    promote(node, e, p.reason, p.detected_at, p.lost, {**p.detail,  # how fast it took the role
                                                      "promotion_s": ev.fields.get("seconds")})
    if others_gone(node, e):
        node.emit(Tell(e.name, e.incarnation, "fenced"))


def adopted(node: Node, e: Engine, ev: Said) -> None:
    """What the new writer found in the pool, once read (after it said `promoted`): logged, measured
    and published (`kv_adopted`)."""
    f = ev.fields
    node.emit(Measure("promotion", e.name, dict(f)))
    node.emit(Publish({"type": "kv_adopted", "engine": e.name, "adopted_blocks": f.get("adopted_blocks"),
                       "quarantined_blocks": f.get("quarantined_blocks"), "tails": f.get("tails"),
                       "index_reset": f.get("index_reset"), "seconds": f.get("seconds"),
                       "take_seconds": f.get("take_seconds")}))
    log.info("%s took the KV pool: %s keyed blocks adopted%s, %s quarantined, %s tails (%.1f ms in the engine)",
             e.name, f.get("adopted_blocks"), why_none({"kv_mode": e.heartbeat.get("kv_mode", "writer"), **f}),
             f.get("quarantined_blocks"), f.get("tails"), 1e3 * float(f.get("seconds") or 0))


def why_none(promoted: dict) -> str:
    """Why a promotion adopted no keyed block, as a parenthesis for its log line ("" if it adopted some)."""
    if promoted.get("adopted_blocks"):
        return ""
    if promoted.get("index_reset"):
        return f" (the pool's index was rejected: {promoted['index_reset']}; the pool starts empty)"
    if promoted.get("kv_mode", "writer") != "writer":
        return f" (the engine runs on its own KV cache, kv_mode {promoted['kv_mode']}: there is no pool to adopt)"
    return " (the pool held no keyed block: nothing was sealed in it yet, or its blocks were all free)"


def switch_over(node: Node, old: Engine, successor: Engine) -> None:
    """Planned: hold new requests, ask the primary to hand its requests off and give the pool up."""
    node.demoting = Demotion(old.name, old.incarnation, successor.name, node.now + DEMOTE_TIMEOUT_S)
    node.primary = None
    node.hold_reason = f"planned switchover from {old.name} to {successor.name}"
    node.dirty = True
    node.emit(Tell(old.name, old.incarnation, "demote"))


def handed_over(node: Node, old: Engine, crashed: bool = False) -> None:
    """The old primary parked (or is gone): what it still had in flight is retried or continued
    on the successor, which is promoted now; the old one restarts as a standby. ``crashed``: it
    exited unasked before it answered (a crash just before or during the switchover): that is a
    failover for its exit, from when it was seen exiting, and its exit path restarts it."""
    d, node.demoting = node.demoting, None
    node.lost_epoch = node.epoch
    reason, since = ("exit", old.down_since or node.now) if crashed else ("promote", node.now)
    successor = node.engines[d.successor]
    detail = {"during": "promote"} if crashed else {}
    if successor.state == State.READY and successor.pid:
        promote(node, successor, reason, since, old.name, detail)
    else:
        node.pending_failover = Failover(reason, since, old.name, detail)
    if crashed:
        log.warning("%s exited before it answered `demote`: the switchover to %s is a failover (exit)", old.name,
                    d.successor)
    else:
        engines.stop(node, old, restart=True)


def check(node: Node) -> None:
    """Deadlines, and an engine lost while it was being promoted or demoted."""
    p, d = node.promoting, node.demoting
    if p is not None:
        e = node.engines[p.name]
        if e.incarnation != p.incarnation or e.pid is None or e.state != State.READY:
            lost(node, f"{p.name} was lost while taking the KV pool over")
        elif node.now > p.deadline:
            failed(node, e, f"promotion failed: no answer to `promote` within {PROMOTE_TIMEOUT_S:g}s")
    if d is not None:
        old = node.engines[d.name]
        if old.incarnation != d.incarnation or old.pid is None:
            handed_over(node, old, crashed=old.state in (State.EXITED, State.FAILED, State.BACKOFF, State.FATAL))
        elif node.now > d.deadline:
            log.warning("%s did not answer `demote` within %gs: fenced", old.name, DEMOTE_TIMEOUT_S)
            node.emit(Fence(old.name, old.pid))
            handed_over(node, old)


def failed(node: Node, e: Engine, why: str) -> None:
    lost(node, why)
    engines.fail(node, e, why)


def lost(node: Node, why: str) -> None:
    """The promotion ends without a primary: the failover it answered waits for the next READY one."""
    p, node.promoting = node.promoting, None
    log.error("%s; promoting the next READY standby", why)
    node.pending_failover = Failover(p.reason, p.detected_at, p.lost, p.detail)
    node.hold_reason = f"{why}; waiting for another READY standby"
    node.dirty = True
