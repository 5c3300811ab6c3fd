"""The order of a boot, and how it stops: daemons (loaded) and the spawn server (torch imported) side
by side, then every engine slot that was not re-adopted. A daemon or spawn server that never came up
is a boot error: the node stops and says why instead of looping."""
from __future__ import annotations

from supervisor.core import daemons, engines, lifecycle, spawn
from supervisor.core.actions import SweepLinks
from supervisor.core.model import Child, Node
from supervisor.core.states import RUNNING, State


def boot(node: Node) -> None:
    """While booting: start what is not running, stop on a boot error, then start the engines."""
    if node.phase != "booting" or node.stopping:
        return
    if not node.links_swept:  # before any engine of ours starts; adopted ones keep theirs
        node.links_swept = True
        node.emit(SweepLinks(tuple(sorted(e.pid for e in node.engines.values() if e.pid))))
    for d in node.daemons:
        if d.state == State.STOPPED:  # (not re-adopted)
            daemons.start(node, d)
    if node.spawn is not None and node.spawn.state == State.STOPPED:
        spawn.start(node, node.spawn)
    why = boot_error(node)
    if why is not None:
        lifecycle.halt(node, why)
        return
    if all(d.state == State.READY for d in node.daemons) and (node.spawn is None or node.spawn.state == State.READY):
        node.phase = "serving"
        for e in node.engines.values():
            if e.state == State.STOPPED:
                engines.start(node, e)


def boot_error(node: Node) -> str | None:
    limit = node.settings.load_timeout_s
    external = node.settings.external  # (its daemons run the operator's command: the errors name its keys)
    for d in node.daemons:
        if gave_up(d) and external:
            return f"engines.external.daemon_command: {d.name} stopped before it was ready " \
                   f"({d.last_exit or d.reason}): {d.log_line}".rstrip(": ")
        if gave_up(d):
            return f"{d.name} stopped while loading the model ({d.last_exit or d.reason}): {d.log_line}"
    if node.daemons and node.now - node.boot_started > limit and not all(d.state == State.READY for d in node.daemons):
        what = "engines.external.daemon_ready not passed" if external else "daemons not loaded"
        return f"{what} after {limit:g}s (daemons.load_timeout_s)"
    s = node.spawn
    if s is not None and gave_up(s):
        return f"{s.reason} ({s.last_exit}): {s.log_line}"
    return None


def gave_up(child: Child) -> bool:
    """It never became READY and its process is gone, its exit status read."""
    return not child.ever_ready and child.state not in RUNNING and child.state != State.STOPPED \
        and not child.reaping and not child.launching
