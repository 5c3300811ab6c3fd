"""A weight cache daemon's lifecycle (supervisor/core/lifecycle.py) with its load (status polled until
the arena is resident) and its pings once READY (a hung daemon is fenced and restarted). Engines
keep serving from their mappings meanwhile: a daemon is never the last one standing. An external
engine's own daemon (engines.external.daemon_command) has the same lifecycle; it is READY once its
readiness check passes (``came_up``)."""
from __future__ import annotations

import logging
from typing import Any

from supervisor.core import lifecycle
from supervisor.core.actions import Fence, Measure, Probe, Stop
from supervisor.core.events import DaemonAnswered, ExitRead, Exited, Launched, LaunchFailed, Pinged
from supervisor.core.model import Daemon, Node
from supervisor.core.states import State

log = logging.getLogger("understudy")

STATUS_POLL_S = 0.1
EXTERNAL_POLL_S = 0.2  # an external daemon's readiness check (a connect, a GET, its log read)
PING_INTERVAL_S = 2.0
PING_FAILURES = 3  # a daemon that does not answer this many pings in a row is hung: fenced, restarted


def start(node: Node, d: Daemon) -> None:
    d.load_bytes, d.load_pct = None, -1
    if lifecycle.begin(node, d):
        lifecycle.launch(node, d)


def launched(node: Node, d: Daemon, ev: Launched) -> None:
    if lifecycle.take_launch(node, d, ev):
        d.next_check_at = node.now  # status polls begin


def launch_failed(node: Node, d: Daemon, ev: LaunchFailed) -> None:
    if lifecycle.launch_failed(node, d, ev.error, "cannot start"):
        restart_later(node, d)


def check(node: Node, d: Daemon) -> None:
    """A (re)started daemon must load within daemons.load_timeout_s; a READY one is pinged now and then."""
    now, limit = node.now, node.settings.load_timeout_s
    if d.state == State.STARTING and d.pid and now - d.started_at > limit:
        what = f"engines.external.daemon_ready ({d.socket_path}) not passed" if node.settings.external \
            else "not loaded"
        lifecycle.transition(node, d, State.FAILED, f"{what} within daemons.load_timeout_s={limit:g}s")
        node.emit(Fence(d.name, d.pid))
    elif d.checking or d.pid is None:
        return
    elif d.state == State.STARTING and now >= d.next_check_at:
        d.checking = True
        node.emit(Probe("daemon", d.name, d.incarnation, "up" if node.settings.external else "status", d.socket_path))
    elif d.state == State.READY and now - d.last_check >= PING_INTERVAL_S and not node.settings.external:
        d.checking, d.last_check = True, now
        node.emit(Probe("daemon", d.name, d.incarnation, "ping", d.socket_path))


def answered(node: Node, d: Daemon, ev: DaemonAnswered) -> None:
    """A loading daemon's status: READY once its arena is loaded; its progress counts for the watchdog."""
    d.checking = False
    if d.state != State.STARTING or d.pid is None:
        return
    d.next_check_at = node.now + STATUS_POLL_S
    if ev.reply is None:
        log.debug("%s: not answering yet: %s", d.name, ev.error)
        return
    info = ev.reply.get("daemon") or {}
    prog = ev.reply.get("progress") or info.get("progress") or {}
    if ev.reply.get("type") == "ok" and info.get("state") == "ready":
        ready(node, d, info)
    elif ev.reply.get("type") == "error" or info.get("state") == "failed":
        log.error("%s: %s", d.name, ev.reply.get("message") or info.get("error"))
    elif prog.get("bytes_total"):
        pct = int(100 * prog.get("bytes_done", 0) / prog["bytes_total"])
        if prog.get("bytes_done") != d.load_bytes:  # the load advances: not stuck
            d.load_bytes = prog.get("bytes_done")
            node.progress()
        if pct // 25 != d.load_pct // 25:
            d.load_pct = pct
            log.info("%s: loading %d%% (%.2f GB/s)", d.name, pct, prog.get("gbps", 0.0))


def ready(node: Node, d: Daemon, info: dict[str, Any]) -> None:
    d.resident_bytes = int(info.get("resident_bytes") or 0)
    d.fingerprint = info.get("fingerprint")
    d.weights_finite = info.get("weights_finite")
    d.kv_pool = info.get("kv_pool")
    d.kv_pool_id = info.get("kv_pool_id") if isinstance(info.get("kv_pool_id"), str) else None
    d.ever_ready = True
    d.policy.record_success()
    d.last_check = node.now
    node.emit(Measure("resident", d.name, {"rank": d.rank, "bytes": d.resident_bytes}))
    lifecycle.transition(node, d, State.READY, f"{d.resident_bytes / 1e6:.1f} MB resident, "
                         f"load {info.get('load_seconds') or 0:.2f}s")


def came_up(node: Node, d: Daemon, ev: Pinged) -> None:
    """An external engine's daemon (engines.external.daemon_command): READY once its readiness check
    (daemon_ready) passes; polled until then. Once READY it is watched by its process only (its
    protocol is not ours: no pings), as the engines watch it themselves."""
    if d.pid is None:
        return
    if not ev.ok:
        d.next_check_at = node.now + EXTERNAL_POLL_S
        log.debug("%s: not ready yet: %s", d.name, ev.error)
        return
    d.ever_ready = True
    d.policy.record_success()
    d.last_check = node.now
    lifecycle.transition(node, d, State.READY, f"engines.external.daemon_ready passed ({d.socket_path}) after "
                                               f"{node.now - d.started_at:.2f}s")


def pinged(node: Node, d: Daemon, ev: Pinged) -> None:
    """A READY daemon that does not answer PING_FAILURES status requests in a row is hung (SIGSTOP,
    deadlock): FAILED and fenced; its exit restarts it."""
    d.checking = False
    if d.state == State.STARTING:
        came_up(node, d, ev)
        return
    if ev.ok:
        d.check_failures = 0
        return
    if d.state != State.READY:
        return
    if ev.local:
        log.warning("%s: status not asked (%s): the supervisor is out of file descriptors; not counted", d.name,
                    ev.error)
        return
    d.check_failures += 1
    log.warning("%s: no answer to status (%d/%d): %s", d.name, d.check_failures, PING_FAILURES, ev.error)
    if d.check_failures >= PING_FAILURES and d.pid:
        lifecycle.transition(node, d, State.FAILED, f"hang: {PING_FAILURES} status requests unanswered")
        node.emit(Fence(d.name, d.pid))


def exited(node: Node, d: Daemon, ev: Exited) -> None:
    """Engines keep their mappings; the daemon is restarted with backoff once its status is read."""
    if lifecycle.take_exit(node, d, ev):
        lifecycle.mark_down(node, d, ev.pid, "daemon exited without being asked to")
        node.emit(Measure("resident", d.name, {"rank": d.rank, "bytes": 0}))


def exit_read(node: Node, d: Daemon, ev: ExitRead) -> None:
    text, expected = lifecycle.exit_outcome(d, ev)
    (log.info if expected else log.warning)("%s: pid %d %s", d.name, ev.pid, text)
    if not lifecycle.take_exit_status(node, d, ev, text) or expected or not d.ever_ready:
        return  # (a daemon that never loaded: supervisor/core/boot.py says why the boot failed)
    restart_later(node, d)


def restart_later(node: Node, d: Daemon) -> None:
    if not lifecycle.schedule_restart(node, d):  # flapping: engines keep serving from their mappings
        lifecycle.transition(node, d, State.FATAL, f"flapping (last: {d.reason}); engines keep their "
                                                   "mappings, restarts load from disk")


def stop(node: Node, d: Daemon) -> None:
    if lifecycle.request_stop(node, d, restart=False, asked="stop requested"):
        node.emit(Stop(d.name, d.pid))
