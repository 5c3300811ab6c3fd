"""Control channel to engines: a zmq ROUTER the engines' DEALERs connect to (docs/CONTRACTS.md)."""
from __future__ import annotations

import json
import logging
from typing import Any

import zmq
import zmq.asyncio
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
    """ROUTER at ``ipc://{runtime_dir}/control.sock``; ``recv`` yields parsed EngineMessages."""

    def __init__(self, ctx: zmq.asyncio.Context, path: str) -> None:
        self.endpoint = f"ipc://{path}"
        self._sock = bind_private_ipc(ctx, zmq.ROUTER, path, ROUTER_MANDATORY=1)

    async def recv(self) -> EngineMessage | None:
        """Next valid message; malformed ones are logged and answered with None."""
        frames = await self._sock.recv_multipart()
        try:
            data = json.loads(frames[-1])
            return EngineMessage.model_validate(data)
        except (ValueError, ValidationError) as e:
            log.warning("malformed control message from %r: %s", frames[0][:64], str(e).splitlines()[0])
            return None

    async def send(self, name: str, incarnation: int, obj: dict[str, Any]) -> bool:
        """Send a command to ``name:incarnation``; False if that engine is not connected."""
        return self.send_now(name, incarnation, obj)

    def send_now(self, name: str, incarnation: int, obj: dict[str, Any]) -> bool:
        """`send` without a loop round: a non-blocking send completes in the call (pyzmq sends at
        once when nothing is queued), which a failover's round trip must not wait for."""
        sent = self._sock.send_multipart([f"{name}:{incarnation}".encode(), json.dumps(obj).encode()], zmq.NOBLOCK)
        error = sent.exception() if sent.done() else None
        if error is not None:
            log.warning("cannot send %s to %s:%d: %s", obj, name, incarnation, error)
        return error is None

    def close(self) -> None:
        self._sock.close(0)
