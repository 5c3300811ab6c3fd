"""Event publication: every transition, failover and recovery as one JSON frame on a zmq PUB."""
from __future__ import annotations

import json
import logging
import time
from typing import Any

import zmq

from supervisor.effects.zmq_ipc import bind_private_ipc

log = logging.getLogger("understudy.events")


class EventBus:
    """PUB socket at ``ipc://{runtime_dir}/events.sock`` (0600); also logs each event."""

    def __init__(self, ctx: zmq.Context, path: str) -> None:
        self.endpoint = f"ipc://{path}"
        self._sock = bind_private_ipc(ctx, zmq.PUB, path, SNDHWM=10000)
        self.recent: list[dict[str, Any]] = []

    def publish(self, event: dict[str, Any]) -> None:
        """Send without blocking; a slow subscriber loses events, never stalls the supervisor."""
        event.setdefault("ts", time.time())
        self.recent.append(event)
        del self.recent[:-200]
        try:
            self._sock.send(json.dumps(event).encode(), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.debug("event dropped: %s", e)

    def close(self) -> None:
        self._sock.close(0)
