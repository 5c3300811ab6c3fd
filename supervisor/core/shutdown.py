"""Stopping the node in stages, each with a deadline: engines drain (no spawns from the start on),
then the spawn server stops, then the daemons; whatever is left is SIGKILLed; then Finish."""
from __future__ import annotations

import logging
import signal

from supervisor.core import daemons, engines, spawn
from supervisor.core.actions import Fence, Finish, Notify, Stop
from supervisor.core.engine_health import check_drain
from supervisor.core.model import Node

log = logging.getLogger("understudy")


def advance(node: Node) -> None:
    """One step of the stop, as far as the children allow in this pass."""
    sd = node.shutdown
    if sd is None or node.finished:
        return
    f = node.settings.failover
    if sd.stage == "begin":
        log.info("stopping (%s): draining engines", sd.why)
        node.emit(Notify("stopping", f"stopping ({sd.why})"))
        if node.spawn is not None and node.spawn.pid:  # no spawns from now on; let it exit while engines drain
            node.emit(Stop(node.spawn.name, node.spawn.pid))
        for e in node.engines.values():
            engines.stop(node, e)
        sd.stage, sd.deadline = "engines", node.now + f.drain_timeout_s + f.stop_timeout_s
    if sd.stage == "engines":
        for e in node.engines.values():
            check_drain(node, e)
        if not done(node, list(node.engines.values()), sd.deadline):
            return
        if node.spawn is not None:
            spawn.stop(node, node.spawn)
        sd.stage, sd.deadline = "spawn server", node.now + f.stop_timeout_s
    if sd.stage == "spawn server":
        if not done(node, [node.spawn] if node.spawn is not None else [], sd.deadline):
            return
        if node.spawn is not None and node.spawn.pid:
            node.emit(Stop(node.spawn.name, node.spawn.pid, signal.SIGKILL))
        for d in node.daemons:
            daemons.stop(node, d)
        sd.stage, sd.deadline = "daemons", node.now + f.stop_timeout_s + 2
    if sd.stage == "daemons":
        if not done(node, list(node.daemons), sd.deadline):
            return
        for child in node.children():
            if child.pid:
                node.emit(Fence(child.name, child.pid))
        node.finished = node.dirty = True
        log.info("stopped")
        node.emit(Finish(node.exit_code))


def done(node: Node, children: list, deadline: float) -> bool:
    """Every one of ``children`` has exited, or the stage's deadline passed."""
    return node.now >= deadline or not any(c.pid for c in children)
