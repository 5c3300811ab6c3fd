"""The watchdog's verdict, once per pass: stuck (no READY primary and no progress for stuck_after_s:
said once, at ERROR and in systemd's STATUS, and WATCHDOG=1 stops) or fed."""
from __future__ import annotations

import logging

from supervisor.core.actions import Notify
from supervisor.core.model import Node
from supervisor.core.why import not_ready_reason

log = logging.getLogger("understudy")


def judge(node: Node) -> None:
    """Stuck or fed, as of ``node.now``."""
    now = node.now
    feed = node.stopping or node.watchdog.should_feed(now, node.serving())
    if not feed and not node.stuck:
        secs = node.watchdog.stuck_for(now, False)
        why = f"stuck: no READY primary and no progress for {secs:.0f}s ({not_ready_reason(node, now)})"
        log.error("%s; no longer feeding the systemd watchdog", why)
        node.emit(Notify("stuck", why[:400]))
    if node.stuck != (not feed):
        node.stuck = not feed
        node.dirty = True
