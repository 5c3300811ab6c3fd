"""An engine's lifecycle (supervisor/core/lifecycle.py) with what only engines have: the failover
when the primary exits or is judged bad, boot errors that stop instead of looping, the last engine
standing retried forever, a start that waits for a spawn server being replaced."""
from __future__ import annotations

import logging
import signal

from wire.engine_config import BOOT_ERROR_EXIT
from supervisor.core import lifecycle
from supervisor.core.kv_writers import writer_down, writer_reaped
from supervisor.core.actions import Drain, Fence, LossCause, Publish, Stop
from supervisor.core.events import ExitRead, Exited, Launched, LaunchFailed
from supervisor.core.failover import fail_over
from supervisor.core.model import Engine, Node
from supervisor.core.states import RUNNING, Role, State

log = logging.getLogger("understudy")


def start(node: Node, e: Engine) -> None:
    """A new incarnation, as standby; launched at once or when the spawn server answers. From FATAL:
    its slow retry (failover.fatal_retry_s), said in the log and as a ``fatal_retry`` event."""
    if node.stopping:
        return
    e.retrying_fatal = e.state == State.FATAL
    if e.retrying_fatal:
        e.fatal_retries += 1
        log.warning("%s: FATAL for %.0fs (%s); trying it again (slow retry %d)", e.name, node.now - e.state_since,
                    e.reason, e.fatal_retries)
        node.emit(Publish({"type": "fatal_retry", "engine": e.name, "attempt": e.fatal_retries, "reason": e.reason}))
    e.drain_fenced = False
    e.last_heartbeat, e.heartbeat, e.engine_state = None, {}, ""
    e.weights_source, e.phases, e.startup_counted, e.unanswered = None, {}, False, 0
    e.kv_source, e.kv_writer, e.kv_pool_id = None, False, None
    e.role, e.url, e.port = Role.STANDBY, "", 0
    if lifecycle.begin(node, e):
        launch_if_due(node, e)


def launch_if_due(node: Node, e: Engine) -> None:
    """Launch a STARTING engine that has no process yet, through the spawn server when one answers;
    while one is being replaced, wait for it up to spawn_wait_s, then start the engine directly.
    An engine stopped before it was launched is STOPPED (or started again)."""
    if e.pid is not None or e.launching:
        return
    if e.state == State.DRAINING:
        lifecycle.transition(node, e, State.STOPPED, "stopped on request")
        if e.restart_after_stop:
            start(node, e)
        return
    if e.state != State.STARTING:
        return
    s = node.settings
    if s.external and daemon_coming(node):  # (it would load from disk, or refuse, without its daemon)
        e.started_at = node.now  # its startup timeout counts from its launch
        return
    if s.external:
        lifecycle.launch(node, e, "external")
    elif not s.spawn_server or node.spawn is None or node.spawn.state == State.FATAL:
        lifecycle.launch(node, e, "direct")
    elif node.spawn.state == State.READY:
        lifecycle.launch(node, e, "spawn")
    elif node.now - e.started_at >= s.spawn_wait_s:
        log.warning("%s: no spawn server within %gs; starting the engine directly", e.name, s.spawn_wait_s)
        lifecycle.launch(node, e, "direct")


def daemon_coming(node: Node) -> bool:
    """A daemon of the node is on its way up (starting, or restarting after an exit): an external engine
    waits for it. One FATAL (flapping) or stopped is not waited for: the engine loads without it."""
    return any(d.state not in (State.READY, State.FATAL, State.STOPPED) for d in node.daemons)


def launched(node: Node, e: Engine, ev: Launched) -> None:
    if lifecycle.take_launch(node, e, ev):
        e.url, e.port = ev.url, ev.port
        e.next_check_at = node.now  # readiness probes begin
        log.info("%s: pid %d, incarnation %d, %s", e.name, ev.pid, ev.incarnation, e.url)


def launch_failed(node: Node, e: Engine, ev: LaunchFailed) -> None:
    if lifecycle.launch_failed(node, e, ev.error, "start failed"):
        restart_later(node, e)


def exited(node: Node, e: Engine, ev: Exited) -> None:
    """Fence the group, fail over if it served, then STOPPED or EXITED; its status is read next."""
    if not lifecycle.take_exit(node, e, ev):
        return
    writer_down(node, e)
    expected = e.exit_expected
    serving = node.primary == e.name and e.role == Role.PRIMARY
    reason = e.reason if e.state == State.FAILED else ("stopped" if expected else "exit")
    seen = ev.at if ev.at is not None else node.now
    if not expected:
        e.down_since = e.down_since or seen
    if serving and not node.stopping:
        fail_over(node, e, reason.split(":")[0], e.down_since or seen)
    lifecycle.mark_down(node, e, ev.pid, "process exited without being asked to",
                        wait_group=node.settings.tp_size > 1)  # the other ranks release GPU memory first
    e.role = Role.STANDBY  # it comes back as a standby


def exit_read(node: Node, e: Engine, ev: ExitRead) -> None:
    """Restart (backoff), stop, or FATAL on a boot error (unless it is the last engine of a node that
    served: that one is retried until the cause is fixed)."""
    writer_reaped(node, e.name, ev.incarnation)
    text, expected = lifecycle.exit_outcome(e, ev)
    if e.lost_epoch is not None and ev.incarnation == e.incarnation:  # it died as primary: how, for the router
        outside = ev.returncode == -signal.SIGKILL and e.state == State.EXITED  # (our fences leave it FAILED)
        node.emit(LossCause(e.lost_epoch, not outside, text))
        e.lost_epoch = None
    (log.info if expected else log.warning)("%s: pid %d (incarnation %d) %s%s", e.name, ev.pid, ev.incarnation,
                                            text, "" if expected else f"; log: {ev.log_path}")
    if not lifecycle.take_exit_status(node, e, ev, text):
        return
    if expected:
        if crashed_while_stopping(node, e, ev):  # e.g. it died just before an admin promote drained it
            e.policy.record_failure(node.now)
            e.reason = e.last_exit = f"{text} while asked to drain: a crash, not the drain (counted as a failure)"
            log.warning("%s: %s", e.name, e.reason)
        if e.restart_after_stop and not node.stopping and e.state == State.STOPPED:
            start(node, e)
        return
    if ev.returncode == BOOT_ERROR_EXIT and not node.settings.external \
            and not (node.epoch > 0 and last_standing(node, e)):
        go_fatal(node, e, f"boot error ({text}): a configuration or checkpoint problem; {e.log_line}")
        check_all_fatal(node)
        return
    restart_later(node, e)


def crashed_while_stopping(node: Node, e: Engine, ev: ExitRead) -> bool:
    """A drain (exit 0) was asked for, and it exited otherwise: not by our SIGTERM (an engine still
    starting has no handler for it yet), not by our SIGKILL after the drain timeout or at shutdown.
    (External engines' SIGTERM statuses vary: not judged.)"""
    return ev.returncode not in (0, None, -signal.SIGTERM) and not e.drain_fenced and not node.stopping \
        and not node.settings.external


def restart_later(node: Node, e: Engine) -> None:
    """Backoff restart; a slot that flaps goes FATAL, unless it is the last engine standing; a slow
    retry of a FATAL slot that fails is FATAL again at once (one try per fatal_retry_s)."""
    if node.stopping:
        return
    standing = last_standing(node, e)
    if e.retrying_fatal and not standing:
        e.policy.record_failure(node.now)
        go_fatal(node, e, f"still failing at slow retry {e.fatal_retries} (last: {e.reason})")
    elif not lifecycle.schedule_restart(node, e, last_standing=standing):
        n, w = len(e.policy.failures), node.settings.failover.flap_window_s
        go_fatal(node, e, f"flapping: {n} failures within {w:g}s (last: {e.reason})")


def go_fatal(node: Node, e: Engine, why: str) -> None:
    """FATAL, tried once again after failover.fatal_retry_s (null: only an admin restart): a node
    never runs without a standby silently, nor for good."""
    wait = node.settings.failover.fatal_retry_s
    e.retry_at = node.now + wait if wait is not None else None  # (before the transition: state.json shows it)
    then = f"tried again in {wait:g}s" if wait is not None else "not tried again"
    lifecycle.transition(node, e, State.FATAL, f"{why}; {then}, `understudy restart {e.name}` resets it now")
    node.emit(Publish({"type": "fatal", "engine": e.name, "reason": e.reason, "retry_in_s": wait}))


def last_standing(node: Node, e: Engine) -> bool:
    """Every other engine slot is FATAL: nothing else would ever serve if this one stopped."""
    return all(o.state == State.FATAL for o in node.engines.values() if o is not e)


def fail(node: Node, e: Engine, reason: str) -> None:
    """A live engine judged bad: FAILED, fenced (SIGKILL its group), failed over now if it served;
    its exit does the rest."""
    if e.state not in RUNNING:
        return
    e.down_since = e.down_since or node.now
    lifecycle.transition(node, e, State.FAILED, reason)
    if e.pid:
        node.emit(Fence(e.name, e.pid))
        if node.primary == e.name and not node.stopping:
            fail_over(node, e, reason.split(":")[0], e.down_since)
    else:  # not launched yet (a launch still in flight is fenced when it comes back)
        restart_later(node, e)


def stop(node: Node, e: Engine, restart: bool = False) -> None:
    """Drain (finish in-flight, exit 0), then STOPPED, or a fresh start if ``restart``."""
    if lifecycle.request_stop(node, e, restart):
        if node.settings.external or e.last_heartbeat is None:  # not on the control channel: SIGTERM
            node.emit(Stop(e.name, e.pid))
        else:
            node.emit(Drain(e.name, e.incarnation, e.pid))
    elif restart and e.state == State.STOPPED:
        e.policy.reset()
        e.fatal_retries = 0
        start(node, e)


def check_all_fatal(node: Node) -> None:
    """Boot errors stop instead of looping: every slot FATAL from a boot error before anything served
    = halt (a flapping slot stays FATAL in status instead, for an admin to reset)."""
    slots = node.engines.values()
    if node.epoch == 0 and all(s.state == State.FATAL and s.reason.startswith("boot error") for s in slots):
        reasons = {s.log_line or s.reason for s in slots}
        lifecycle.halt(node, f"no engine could start ({', '.join(node.engines)}, boot error exit code "
                             f"{BOOT_ERROR_EXIT}): {' | '.join(sorted(reasons))}")
