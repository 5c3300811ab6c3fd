"""An engine while it lives: what it says on the control channel, readiness (HTTP up, then the canary
must match the golden answer), the primary's health probes (progress under load counts as healthy),
and the heartbeat, startup and drain timeouts."""
from __future__ import annotations

import logging
from typing import Any

from supervisor.core import kv_handover, lifecycle
from supervisor.core.actions import Fence, Measure, Probe, Publish
from supervisor.core.engines import fail
from supervisor.core.events import HealthChecked, ReadyChecked, Said
from supervisor.core.failover import ensure_primary
from supervisor.core.model import Engine, Node
from supervisor.core.states import RUNNING, Role, State

log = logging.getLogger("understudy")

READY_POLL_S = 0.05       # HTTP not up yet: look again after this
CANARY_RETRY_S = 0.2      # the canary was not answered yet (the engine is still starting)
STARTING = (State.STARTING, State.ATTACHING, State.WARMING)
ENGINE_STATES = {"ATTACHING": State.ATTACHING, "WARMING": State.WARMING}
HEARTBEAT_FIELDS = ("steps", "running", "waiting", "served", "kv_blocks_used", "kv_blocks_total",
                    "prefix_queried_tokens", "prefix_hit_tokens", "preemptions", "generated_tokens", "kv_mode",
                    "kv_quarantined_blocks", "continuations", "continuation_reused_tokens",
                    "continuation_recomputed_tokens", "gpu_reserved_bytes", "deterministic",
                    "kv_checked_blocks", "kv_corrupt_blocks", "cuda_graphs_pending")


# ---------------------------------------------------------------------------------- control channel
def said(node: Node, e: Engine, ev: Said) -> None:
    """Heartbeats (serving figures, progress), reported states, startup phases and their summary."""
    if ev.type == "heartbeat":
        e.last_heartbeat = node.now
        hb = {k: ev.fields.get(k) for k in HEARTBEAT_FIELDS}
        if (hb.get("served"), hb.get("steps")) != (e.heartbeat.get("served"), e.heartbeat.get("steps")):
            e.last_progress = node.now
        node.emit(Measure("heartbeat", e.name, {"heartbeat": hb, "previous": e.heartbeat, "at": node.now}))
        e.heartbeat = hb
    elif ev.type == "state":
        node.progress()
        st = str(ev.fields.get("state", ""))
        e.engine_state = st
        target = ENGINE_STATES.get(st)
        if target is not None and e.state in (State.STARTING, State.ATTACHING) and e.state != target:
            lifecycle.transition(node, e, target, "reported by engine")
        if st == "SERVING" and e.state in STARTING:
            e.next_check_at = node.now  # its HTTP is up: the canary now, not at the next poll
    elif ev.type == "phase":
        node.progress()
        e.phases[str(ev.fields.get("phase"))] = float(ev.fields.get("seconds") or 0.0)
        if ev.fields.get("source"):
            e.weights_source = str(ev.fields.get("source"))
    elif ev.type == "startup":
        record_startup(node, e, {"phases": ev.fields.get("phases") or {},
                                 "weights_source": ev.fields.get("weights_source"),
                                 "kv_source": ev.fields.get("kv_source"), "kv_pool_id": ev.fields.get("kv_pool_id")})
    elif ev.type in kv_handover.ANSWERS:
        kv_handover.said(node, e, ev)
    elif ev.type == "adopted":
        kv_handover.adopted(node, e, ev)
    elif ev.type == "continuations":  # one step's continued requests: [reused, recomputed] tokens each
        each = ev.fields.get("each")
        if not isinstance(each, list) or not all(isinstance(x, list) and len(x) == 2 and
                                                 all(type(n) is int and n >= 0 for n in x) for x in each):
            log.warning("%s: malformed continuations report ignored (want each: [[reused, recomputed], ...]): %.200r",
                        e.name, each)
            return
        node.emit(Publish({"type": "continuations", "engine": e.name, "reused": [x[0] for x in each],
                           "recomputed": [x[1] for x in each]}))


def record_startup(node: Node, e: Engine, data: dict[str, Any]) -> None:
    """The startup phases and the weights' source, counted once per incarnation."""
    if e.startup_counted:
        return
    e.phases = {str(k): float(v) for k, v in (data.get("phases") or {}).items()}
    e.weights_source = data.get("weights_source") or e.weights_source
    e.kv_source = data.get("kv_source") or e.kv_source
    e.kv_pool_id = data.get("kv_pool_id") if isinstance(data.get("kv_pool_id"), str) else None
    e.startup_counted = True
    node.dirty = True
    node.emit(Measure("startup", e.name, {"phases": dict(e.phases), "weights_source": e.weights_source}))
    if e.weights_source and e.weights_source not in ("cache_hit", "disk:off"):
        log.warning("%s: weights from %s", e.name, e.weights_source)


# ---------------------------------------------------------------------------------- readiness
def probe_ready(node: Node, e: Engine) -> None:
    e.checking = True
    node.emit(Probe("engine", e.name, e.incarnation, "ready", e.url, weights_facts(node, e)))


def weights_facts(node: Node, e: Engine) -> dict[str, Any]:
    """What the golden answer's provenance is judged from (supervisor/effects/canary.py)."""
    return {"weights_source": e.weights_source, "external": node.settings.external,
            "daemons": [{"weights_finite": d.weights_finite, "fingerprint": d.fingerprint} for d in node.daemons]}


def ready_checked(node: Node, e: Engine, ev: ReadyChecked) -> None:
    e.checking = False
    if e.pid is None or e.state not in STARTING:
        return
    if ev.startup is not None:
        record_startup(node, e, ev.startup)
    if not ev.listening:
        e.next_check_at = node.now + READY_POLL_S
        return
    if e.state == State.STARTING:
        lifecycle.transition(node, e, State.WARMING, "HTTP up")
    if ev.broken:  # it answered, with non-finite logits: never promoted
        log.error("%s: canary failed: %s; never promoted", e.name, ev.error)
        mismatched(node, e, ev.error, f"canary: {ev.error}")
    elif not ev.answered:  # still starting: say so once, then only at debug level
        (log.info if not e.unanswered else log.debug)("%s: canary not answered yet: %s", e.name, ev.error)
        e.unanswered += 1
        e.next_check_at = node.now + CANARY_RETRY_S
    elif ev.mismatch:
        log.error("%s: %s (weights %s); never promoted", e.name, ev.mismatch, e.weights_source)
        mismatched(node, e, ev.mismatch, ev.mismatch)
    else:
        ready(node, e, ev.canary_s)


def mismatched(node: Node, e: Engine, reason: str, failure: str) -> None:
    node.emit(Publish({"type": "canary_mismatch", "engine": e.name, "reason": reason,
                       "fingerprint": node.settings.fingerprint, "weights_source": e.weights_source}))
    fail(node, e, failure)


def ready(node: Node, e: Engine, canary_s: float) -> None:
    """The canary passed: READY (a recovery if it replaces a failed engine), primary if none serves."""
    e.policy.record_success()
    e.crash_loop = e.retrying_fatal = False
    e.fatal_retries = 0
    e.ever_ready = True
    e.last_progress = e.last_check = node.now
    e.probe_progress = e.progress()
    lifecycle.transition(node, e, State.READY, f"canary passed in {node.now - e.started_at:.2f}s after spawn"
                         f" (its answer took {canary_s * 1e3:.0f} ms)"
                         + (f", weights {e.weights_source}" if e.weights_source else ""))
    if e.down_since is not None:
        secs, e.down_since = node.now - e.down_since, None
        node.emit(Publish({"type": "recovered", "engine": e.name, "incarnation": e.incarnation, "seconds": secs,
                           "weights_source": e.weights_source}))
    ensure_primary(node, prefer=e)


# ---------------------------------------------------------------------------------- health
def maybe_probe(node: Node, e: Engine) -> None:
    """Probe the primary unless it made progress since the last probe (steps or requests served:
    an engine producing tokens is alive, however full its slots; a hang stops its heartbeats)."""
    progress = e.progress()
    progressed = progress > e.probe_progress >= 0
    e.last_check, e.probe_progress = node.now, progress
    if progressed:
        e.check_failures = 0
        return
    e.checking = True
    node.emit(Probe("engine", e.name, e.incarnation, "health", e.url))


def health_checked(node: Node, e: Engine, ev: HealthChecked) -> None:
    e.checking = False
    if e.state != State.READY or e.pid is None:
        return
    if ev.problem is None:
        e.check_failures = 0
        return
    if ev.local:  # the supervisor could not make the probe (out of descriptors): never the engine's failure
        log.warning("%s: probe not made (%s): the supervisor is out of file descriptors; not counted", e.name,
                    ev.problem)
        return
    if e.progress() > e.probe_progress >= 0:  # queued behind full slots while it stepped: busy, not broken
        log.info("%s: probe unanswered (%s) while the engine stepped; not counted", e.name, ev.problem)
        e.probe_progress = e.progress()
        return
    e.check_failures += 1
    limit = node.settings.failover.probe_failures
    log.warning("%s: probe failed (%d/%d): %s", e.name, e.check_failures, limit, ev.problem)
    if e.check_failures >= limit:
        fail(node, e, f"probe: {ev.problem}")


# ---------------------------------------------------------------------------------- timers
def check(node: Node, e: Engine) -> None:
    """Timeouts (heartbeat, startup, drain) and the probes that are due."""
    f = node.settings.failover
    now = node.now
    if e.state not in RUNNING or e.pid is None:
        return
    if e.state == State.DRAINING:
        check_drain(node, e)
    elif e.last_heartbeat is not None and now - e.last_heartbeat > f.heartbeat_timeout_s:
        fail(node, e, f"hang: no heartbeat for {now - e.last_heartbeat:.1f}s")
    elif e.state != State.READY and now - e.started_at > f.startup_timeout_s:
        fail(node, e, f"startup timeout: not READY after {f.startup_timeout_s:g}s")
    elif e.checking:
        return
    elif e.state in STARTING and now >= e.next_check_at:
        probe_ready(node, e)
    elif e.state == State.READY and e.role == Role.PRIMARY and now - e.last_check >= f.probe_interval_s:
        maybe_probe(node, e)


def check_drain(node: Node, e: Engine) -> None:
    """Still draining after drain_timeout_s: SIGKILL (once per timeout)."""
    if e.state == State.DRAINING and e.pid and node.now - e.state_since > node.settings.failover.drain_timeout_s:
        log.warning("%s: still draining after %.0fs, SIGKILL", e.name, node.now - e.state_since)
        node.emit(Fence(e.name, e.pid))
        e.drain_fenced = True
        e.state_since = node.now
