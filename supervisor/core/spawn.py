"""The spawn server's lifecycle (supervisor/core/lifecycle.py): READY once it answers a ping. Engines
it forked live on when it dies (they are re-adopted by us as subreaper); a new one takes the next
spawns, and while none answers engines wait for it or start directly."""
from __future__ import annotations

import logging

from supervisor.core import lifecycle
from supervisor.core.actions import Fence, Probe, Stop
from supervisor.core.events import ExitRead, Exited, Launched, LaunchFailed, Pinged
from supervisor.core.model import Node, SpawnServer
from supervisor.core.states import State

log = logging.getLogger("understudy")

PING_POLL_S = 0.05


def start(node: Node, s: SpawnServer) -> None:
    if lifecycle.begin(node, s):
        lifecycle.launch(node, s)


def launched(node: Node, s: SpawnServer, ev: Launched) -> None:
    if lifecycle.take_launch(node, s, ev):
        s.next_check_at = node.now


def launch_failed(node: Node, s: SpawnServer, ev: LaunchFailed) -> None:
    if lifecycle.launch_failed(node, s, ev.error, "cannot start"):
        restart_later(node, s)


def check(node: Node, s: SpawnServer) -> None:
    """Ping a starting spawn server until it answers, within spawn_ready_s."""
    if s.state != State.STARTING or s.pid is None:
        return
    limit = node.settings.spawn_ready_s
    if node.now - s.started_at > limit:
        lifecycle.transition(node, s, State.FAILED, f"spawn server did not answer within {limit:.0f}s")
        node.emit(Fence(s.name, s.pid))
    elif not s.checking and node.now >= s.next_check_at:
        s.checking = True
        node.emit(Probe("spawn_server", s.name, s.incarnation, "ping"))


def pinged(node: Node, s: SpawnServer, ev: Pinged) -> None:
    """A starting one's ping; or a READY one that did not answer a spawn: hung (stopped, stuck), it is
    killed and replaced, so that the request it holds never forks an engine nobody tracks."""
    s.checking = False
    if s.state == State.READY and s.pid is not None and not ev.ok:
        log.warning("spawn server (pid %d) %s: killed and replaced (a spawn it holds could fork an engine nobody "
                    "tracks); engines start directly until a new one answers", s.pid, ev.error)
        lifecycle.transition(node, s, State.FAILED, ev.error)
        node.emit(Fence(s.name, s.pid))
        return
    if s.state != State.STARTING or s.pid is None:
        return
    if not ev.ok:
        s.next_check_at = node.now + PING_POLL_S
        return
    s.ever_ready = True
    s.policy.record_success()
    lifecycle.transition(node, s, State.READY, "answers")
    log.info("spawn server ready (pid %d)", s.pid)


def exited(node: Node, s: SpawnServer, ev: Exited) -> None:
    if lifecycle.take_exit(node, s, ev):
        lifecycle.mark_down(node, s, ev.pid, "spawn server exited during start" if s.state == State.STARTING
                            else "spawn server exited")


def exit_read(node: Node, s: SpawnServer, ev: ExitRead) -> None:
    text, expected = lifecycle.exit_outcome(s, ev)
    if not lifecycle.take_exit_status(node, s, ev, text):
        return
    if expected:
        if s.restart_after_stop and s.state == State.STOPPED and not node.stopping:
            start(node, s)  # (a rollout replaces it: new engine code is picked up)
        return
    if not s.ever_ready:
        return  # at boot: supervisor/core/boot.py says why the boot failed
    log.warning("spawn server (pid %d) exited (%s); starting a new one", ev.pid, text)
    restart_later(node, s)


def restart_later(node: Node, s: SpawnServer) -> None:
    if not lifecycle.schedule_restart(node, s):
        lifecycle.transition(node, s, State.FATAL, f"flapping (last: {s.reason}); engines are started directly")


def stop(node: Node, s: SpawnServer, restart: bool = False) -> None:
    if lifecycle.request_stop(node, s, restart, asked="stop requested"):
        node.emit(Stop(s.name, s.pid))
    elif restart and s.state == State.STOPPED:
        start(node, s)
