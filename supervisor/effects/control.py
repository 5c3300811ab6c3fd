"""Control channel to engines: a zmq ROUTER the engines' DEALERs connect to (docs/CONTRACTS.md)."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import zmq
from pydantic import BaseModel, ConfigDict, ValidationError

from supervisor.effects.zmq_ipc import bind_private_ipc

log = logging.getLogger("understudy.control")


class EngineMessage(BaseModel):
    """One message from an engine; extra fields (steps, phases, ...) are kept."""

    model_config = ConfigDict(extra="allow")
    type: str
    engine: str
    incarnation: int
    pid: int | None = None
    ts: float | None = None

    def get(self, key: str, default: Any = None) -> Any:
        return (self.model_extra or {}).get(key, default)


class ControlChannel:
    """ROUTER at ``ipc://{runtime_dir}/control.sock``; ``listen`` hands each parsed EngineMessage to a
    callback from the loop's own reader on the socket: a message is taken in the loop round that sees
    it, not one round later through a task awaiting ``recv`` (a failover's "promoted" came 8-16 ms
    after the engine sent it on the dev VM, behind the 256 lost streams' handling in those rounds)."""

    def __init__(self, ctx: zmq.Context, path: str) -> None:
        self.endpoint = f"ipc://{path}"
        self._sock = bind_private_ipc(ctx, zmq.ROUTER, path, ROUTER_MANDATORY=1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_message: Callable[[EngineMessage | None], None] = lambda msg: None

    def listen(self, loop: asyncio.AbstractEventLoop, on_message: Callable[[EngineMessage | None], None]) -> None:
        """From now on call ``on_message`` (on ``loop``) with every message: None for a malformed one."""
        self._loop, self._on_message = loop, on_message
        loop.add_reader(self._sock.getsockopt(zmq.FD), self._drain)
        loop.call_soon(self._drain)  # (messages queued before the reader was added raise no edge of their own)

    def _drain(self) -> None:
        """Every message queued (zmq's descriptor signals an edge: read until none is left)."""
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:  # (closed)
                return
            self._on_message(self._parse(frames))

    @staticmethod
    def _parse(frames: list[bytes]) -> EngineMessage | None:
        try:
            return EngineMessage.model_validate(json.loads(frames[-1]))
        except (ValueError, ValidationError) as e:
            log.warning("malformed control message from %r: %s", frames[0][:64], str(e).splitlines()[0])
            return None

    async def send(self, name: str, incarnation: int, obj: dict[str, Any]) -> bool:
        """Send a command to ``name:incarnation``; False if that engine is not connected."""
        return self.send_now(name, incarnation, obj)

    def send_now(self, name: str, incarnation: int, obj: dict[str, Any]) -> bool:
        """`send` without a loop round: a non-blocking send completes in the call, which a failover's
        round trip must not wait for."""
        try:
            self._sock.send_multipart([f"{name}:{incarnation}".encode(), json.dumps(obj).encode()], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            log.warning("cannot send %s to %s:%d: %s", obj, name, incarnation, e)
            return False
        finally:  # a send can take the descriptor's edge of a message that came meanwhile: read on
            if self._loop is not None:
                self._loop.call_soon(self._drain)

    def close(self) -> None:
        if self._loop is not None and not self._sock.closed:
            self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
        self._sock.close()
