"""Control channel to the supervisor: a zmq DEALER to its ROUTER (docs/CONTRACTS.md).

One I/O thread owns the DEALER: it forwards what any thread sends (state, phase, startup and the
scheduler loop's heartbeats, through an inproc PUSH/PULL pair) and hands each command it receives to
the handler at once (the engine puts it in the scheduler's inbox, which wakes an idle loop: a
promotion is not delayed by the loop's idle wait). Heartbeats come from the scheduler loop itself, so
a stuck loop goes silent. Without a `control_endpoint` every call is a no-op.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from typing import Callable

import zmq

log = logging.getLogger("engines.core.control")

_ids = itertools.count()
_STOP = b"\0stop"


class ControlChannel:
    """Sends state/phase/startup/heartbeat messages; hands `{"cmd": ..., ...}` commands to a handler."""

    def __init__(self, endpoint: str | None, name: str, incarnation: int):
        self.name, self.incarnation = name, incarnation
        self._lock = threading.Lock()  # the senders' PUSH socket
        self._push: zmq.Socket | None = None
        self._handler: Callable[[dict], None] | None = None
        self._early: list[dict] = []  # commands that came before a handler was set
        self._thread: threading.Thread | None = None
        if endpoint:
            ctx = zmq.Context.instance()
            inproc = f"inproc://engine-control-{next(_ids)}"
            pull = ctx.socket(zmq.PULL)
            pull.bind(inproc)
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, f"{name}:{incarnation}".encode())
            dealer.setsockopt(zmq.LINGER, 1000)
            dealer.setsockopt(zmq.SNDHWM, 1000)
            dealer.connect(endpoint)
            self._push = ctx.socket(zmq.PUSH)
            self._push.connect(inproc)
            self._thread = threading.Thread(target=self._io, args=(dealer, pull), name="control", daemon=True)
            self._thread.start()

    def send(self, msg_type: str, **fields) -> None:
        """Send one JSON message (type, fields, engine, incarnation, pid, ts); never blocks."""
        msg = {"type": msg_type, **fields, "engine": self.name, "incarnation": self.incarnation,
               "pid": os.getpid(), "ts": time.time()}
        with self._lock:
            if self._push is not None:
                self._push.send(json.dumps(msg).encode())

    def state(self, state: str, **extra) -> None:
        self.send("state", state=state, **extra)

    def on_command(self, handler: Callable[[dict], None]) -> None:
        """Call `handler(cmd)` (from the I/O thread) for every command, those already received first."""
        with self._lock:
            early, self._early, self._handler = self._early, [], handler
        for cmd in early:
            handler(cmd)

    def _io(self, dealer: zmq.Socket, pull: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        try:
            while True:
                for sock, _ in poller.poll():
                    if sock is pull:
                        out = pull.recv()
                        if out == _STOP:
                            return
                        try:
                            dealer.send(out, zmq.NOBLOCK)
                        except zmq.Again:  # supervisor not reading: drop rather than stall every sender
                            log.warning("control channel full; dropped a message")
                    else:
                        self._received(dealer.recv_multipart()[-1])
        finally:
            dealer.close(linger=500)
            pull.close(linger=0)

    def _received(self, raw: bytes) -> None:
        try:
            cmd = json.loads(raw)
            if not isinstance(cmd, dict) or not isinstance(cmd.get("cmd"), str):
                raise TypeError("not an object with a string cmd")
        except (ValueError, TypeError) as e:
            log.warning("ignoring malformed control frame %r: %s", raw[:200], e)
            return
        with self._lock:
            handler = self._handler
            if handler is None:
                self._early.append(cmd)
                return
        handler(cmd)

    def close(self) -> None:
        """Send what is queued, then stop the I/O thread."""
        with self._lock:
            push, self._push = self._push, None
        if push is not None:
            push.send(_STOP)
            push.close(linger=1000)
            self._thread.join(timeout=2)
