"""One child lifecycle for engines, daemons and the spawn server: start a new incarnation, take its
launch, fence it when it exits and read the exit status, restart it with backoff (or FATAL when it
flaps), stop it on request. What differs by kind (an engine's failover and boot errors, a daemon's
load) is in engines.py, daemons.py and spawn.py, which call these."""
from __future__ import annotations

import logging
import signal

from supervisor.core.actions import Fence, Notify, Publish, Reap, Start, Stop
from supervisor.core.events import ExitRead, Exited, Launched
from supervisor.core.exitstatus import describe_returncode
from supervisor.core.model import Child, Node, Shutdown
from supervisor.core.states import RUNNING, Intent, State, check_transition
from supervisor.lograte import KEEP

log = logging.getLogger("understudy")
NEVER_DROPPED = {KEEP: True}  # transitions are never rate-limited


def transition(node: Node, child: Child, new: State, reason: str = "") -> None:
    """Apply, log and publish one state transition (the spawn server's are not published)."""
    if child.state == new:
        return
    check_transition(child.state, new)
    old, child.state = child.state, new
    child.state_since = node.now
    if reason:
        child.reason = reason
    if new != State.FATAL:
        node.progress()
    node.dirty = True
    role = getattr(child, "role", None)
    text = f"{child.name}{f' ({role.value})' if role else ''}: {old.value} -> {new.value}" + (f": {reason}" if reason else "")
    if child.kind == "spawn_server":
        log.debug("%s", text, extra=NEVER_DROPPED)
        return
    log.info("%s", text, extra=NEVER_DROPPED)
    node.emit(Publish({"type": "transition", "engine": child.name, "from": old.value, "to": new.value,
                       "role": role.value if role else None, "epoch": node.epoch, "reason": reason,
                       "kind": child.kind}))


def begin(node: Node, child: Child) -> bool:
    """A new incarnation of ``child`` (STARTING); False while the node stops."""
    if node.stopping:
        return False
    child.retry_at = None
    child.incarnation += 1
    child.pid = None
    child.intent, child.exit_expected = Intent.RUN, False
    child.spawned = child.launching = child.checking = False
    child.check_failures = 0
    child.started_at = child.next_check_at = child.last_check = node.now
    transition(node, child, State.STARTING, f"incarnation {child.incarnation}")
    return True


def launch(node: Node, child: Child, via: str = "") -> None:
    """Start the process of the current incarnation (Launched or LaunchFailed comes back)."""
    child.launching = True
    node.emit(Start(child.kind, child.name, child.incarnation, via))


def take_launch(node: Node, child: Child, ev: Launched) -> bool:
    """A process was started: True if it is the child's current one and runs on; a superseded one
    is fenced, one that was asked to stop meanwhile is stopped."""
    if ev.incarnation != child.incarnation or not child.launching or child.state not in RUNNING:
        log.warning("%s: incarnation %d started after being superseded; killing pid %d", child.name,
                    ev.incarnation, ev.pid)
        node.emit(Fence(child.name, ev.pid))
        return False
    child.launching = False
    child.pid, child.spawned = ev.pid, ev.spawned
    node.dirty = True  # its pid in children.json at once: a restarted supervisor must not leak it
    if child.state == State.DRAINING or node.stopping:
        node.emit(Stop(child.name, ev.pid, signal.SIGKILL if node.stopping else signal.SIGTERM))
        return False
    return True


def launch_failed(node: Node, child: Child, error: str, what: str) -> bool:
    """The start failed (spawn refused, bad template...): True if the child is now FAILED."""
    child.launching = False
    log.error("%s: could not start: %s", child.name, error)
    if child.state not in RUNNING:
        return False
    transition(node, child, State.FAILED, f"{what}: {error}")
    return True


def take_exit(node: Node, child: Child, ev: Exited) -> bool:
    """The process is exiting: fence its group (the other ranks, its children die with it); True if
    it was the child's process. ``exit_expected``: a stop had been asked for."""
    if child.pid != ev.pid:
        return False
    node.emit(Fence(child.name, ev.pid))
    child.pid = None
    child.exit_expected = child.stop_requested or node.stopping
    node.dirty = True
    return True


def mark_down(node: Node, child: Child, pid: int, unasked: str, wait_group: bool = False) -> None:
    """After take_exit: STOPPED if asked for, else EXITED (``unasked`` says so); then read the status."""
    if child.exit_expected:
        if child.state in RUNNING and child.state != State.DRAINING:
            transition(node, child, State.DRAINING, "stop requested")
        transition(node, child, State.STOPPED, "stopped on request")
    elif child.state in RUNNING:
        transition(node, child, State.EXITED, unasked)
    child.reaping = True
    node.emit(Reap(child.kind, child.name, child.incarnation, pid, wait_group))


def exit_outcome(child: Child, ev: ExitRead) -> tuple[str, bool]:
    """The decoded exit status, and whether the exit was asked for (an earlier incarnation's: taken so)."""
    expected = child.exit_expected if ev.incarnation == child.incarnation else True
    text = describe_returncode(ev.returncode)
    if ev.returncode == 0 and not expected:
        text += " (not requested: counted as a failure)"
    return text, expected


def take_exit_status(node: Node, child: Child, ev: ExitRead, text: str) -> bool:
    """Record the exit status; True if ``ev`` is of the current incarnation."""
    if ev.incarnation != child.incarnation:
        return False
    child.reaping = False
    child.last_exit = text
    child.log_line = ev.log_line
    node.dirty = True
    if child.state == State.EXITED:
        child.reason = text
    return True


def schedule_restart(node: Node, child: Child, last_standing: bool = False) -> bool:
    """Backoff restart (BACKOFF until ``retry_at``); False if the child flaps and is not the last one
    standing: the caller makes it FATAL. The last one standing is retried with the capped delay."""
    if node.stopping:
        return True
    delay = child.policy.record_failure(node.now)
    child.crash_loop = False
    f = node.settings.failover
    if child.policy.flapping and not last_standing:
        return False
    if child.policy.flapping:
        child.crash_loop = True
        why = (f"crash loop ({len(child.policy.failures)} failures within {f.flap_window_s:g}s), last engine "
               f"standing: retried with backoff up to {f.backoff_max_s:g}s; restart in {delay:.2f}s "
               f"(last: {child.reason})")
        (log.warning if child.policy.consecutive <= child.policy.max_failures else log.info)("%s: %s", child.name,
                                                                                             why)
    else:
        why = f"restart in {delay:.2f}s (last: {child.reason})"
    child.retry_at = node.now + delay  # before the transition: state.json and STATUS show it
    transition(node, child, State.BACKOFF, why)
    return True


def restart_due(node: Node, child: Child) -> bool:
    """Its backoff is over (or a FATAL engine slot's slow retry is due): start it now."""
    return child.state in (State.BACKOFF, State.FATAL) and child.retry_at is not None \
        and node.now >= child.retry_at and not node.stopping


def request_stop(node: Node, child: Child, restart: bool, asked: str = "drain requested") -> bool:
    """DRAINING until it exits (then STOPPED, or a fresh start if ``restart``); True if a running
    process must be asked to stop. A child without a process is STOPPED at once (the caller starts it
    again if ``restart``)."""
    child.retry_at = None
    if child.state not in RUNNING or (child.pid is None and child.state != State.STARTING):
        if child.state != State.STOPPED:
            transition(node, child, State.STOPPED, "stopped on request")
        return False
    child.intent = Intent.RESTART if restart else Intent.STOP
    if child.state != State.DRAINING:
        transition(node, child, State.DRAINING, asked)
    return child.pid is not None  # (still launching: take_launch sees DRAINING and stops it)


def halt(node: Node, why: str) -> None:
    """Boot failed in a way retrying cannot fix: say why, stop everything, exit 1."""
    if node.stopping:
        return
    log.error("boot failed: %s", why)
    node.emit(Notify("boot failed", why))
    node.exit_code = 1
    begin_stop(node, "error")


def begin_stop(node: Node, why: str, exit_code: int | None = None) -> None:
    """Stop the node: supervisor/core/shutdown.py takes it from here in the same pass."""
    if node.stopping:
        return
    if exit_code is not None:
        node.exit_code = exit_code
    node.shutdown = Shutdown(why, stage="begin")
    node.dirty = True
