"""Control channel to the supervisor: a zmq DEALER to its ROUTER (docs/CONTRACTS.md).

Heartbeats are sent, and commands polled, by the scheduler loop between steps, so a stuck loop
goes silent. The main thread also sends (phases, startup, states); a lock serialises socket use.
Without a `control_endpoint` every call is a no-op.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time

import zmq

log = logging.getLogger("engines.control")


class ControlChannel:
    """Sends state/phase/startup/heartbeat messages; receives `{"cmd": ..., ...}` commands."""

    def __init__(self, endpoint: str | None, name: str, incarnation: int):
        self.name, self.incarnation = name, incarnation
        self.sock: zmq.Socket | None = None
        self._lock = threading.Lock()
        if endpoint:
            self.sock = zmq.Context.instance().socket(zmq.DEALER)
            self.sock.setsockopt(zmq.IDENTITY, f"{name}:{incarnation}".encode())
            self.sock.setsockopt(zmq.LINGER, 1000)
            self.sock.setsockopt(zmq.SNDHWM, 1000)
            self.sock.connect(endpoint)

    def send(self, msg_type: str, **fields) -> None:
        """Send one JSON message (type, fields, engine, incarnation, pid, ts); never blocks."""
        msg = {"type": msg_type, **fields, "engine": self.name, "incarnation": self.incarnation,
               "pid": os.getpid(), "ts": time.time()}
        with self._lock:
            if self.sock is None:
                return
            try:
                self.sock.send(json.dumps(msg).encode(), zmq.NOBLOCK)
            except zmq.Again:  # supervisor not reading: drop rather than block the scheduler
                log.warning("control channel full; dropped a %s message", msg_type)

    def state(self, state: str, **extra) -> None:
        self.send("state", state=state, **extra)

    def poll_commands(self) -> list[dict]:
        """Commands received since the last poll, each a dict with a string `cmd` (never blocks).
        Malformed frames are logged and skipped."""
        cmds: list[dict] = []
        while True:
            with self._lock:
                if self.sock is None or not self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return cmds  # (checked first: a recv that raises Again costs the loop ~20 µs a step)
                try:
                    raw = self.sock.recv_multipart(zmq.NOBLOCK)[-1]
                except zmq.Again:
                    return cmds
            try:
                cmd = json.loads(raw)
                if not isinstance(cmd, dict) or not isinstance(cmd.get("cmd"), str):
                    raise TypeError("not an object with a string cmd")
                cmds.append(cmd)
            except (ValueError, KeyError, TypeError) as e:
                log.warning("ignoring malformed control frame %r: %s", raw[:200], e)

    def close(self) -> None:
        with self._lock:
            if self.sock is not None:
                self.sock.close(linger=500)
                self.sock = None
