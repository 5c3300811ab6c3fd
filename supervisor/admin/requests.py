"""What the admin API (supervisor/admin/api.py) asks of the running node: its status and metrics,
and each request (promote, drain, undrain, restart, rollout) as an Asked event whose Answer comes
from the pass that decides it (supervisor/core/admin.py)."""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

from supervisor.core.actions import Answer
from supervisor.core.events import Asked, Event
from supervisor.core.model import Node
from supervisor.errors import AdminError
from supervisor.metrics import Metrics


NAME_SHOWN = 64  # characters of a name a client sent that an error shows


def shown(name: str) -> str:
    """A name a client sent, for an error message: quoted, cut after NAME_SHOWN characters."""
    if len(name) <= NAME_SHOWN:
        return repr(name)
    return f"{name[:NAME_SHOWN]!r}... ({len(name)} characters)"


class AdminRequests:
    """The admin API's target (supervisor/admin/api.py AdminTarget)."""

    def __init__(self, node: Node, status: Callable[[], dict[str, Any]], metrics: Metrics,
                 record: Callable[[Event], None]) -> None:
        self.node, self._status, self.metrics, self.record = node, status, metrics, record
        self._waiting: dict[int, asyncio.Future[Answer]] = {}
        self._ids = itertools.count(1)

    @property
    def stopping(self) -> bool:
        return self.node.stopping

    def status_dict(self) -> dict[str, Any]:
        return self._status()

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    async def admin_promote(self) -> dict[str, Any]:
        return await self._ask("promote")

    async def admin_set_drained(self, drained: bool) -> dict[str, Any]:
        return await self._ask("drain" if drained else "undrain")

    async def admin_restart(self, name: str, force: bool = False) -> dict[str, Any]:
        if name not in self.node.engines:  # answered here: the name is echoed short, whatever its length
            raise AdminError(404, f"unknown engine {shown(name)} (engines: {', '.join(self.node.engines)})")
        return await self._ask("restart", name, force)

    async def admin_rollout(self) -> dict[str, Any]:
        return await self._ask("rollout")

    async def _ask(self, intent: str, engine: str = "", force: bool = False) -> dict[str, Any]:
        rid = next(self._ids)
        fut = self._waiting[rid] = asyncio.get_running_loop().create_future()
        self.record(Asked(rid, intent, engine, force))
        try:
            answer = await fut
        finally:
            self._waiting.pop(rid, None)
        if answer.status != 200:
            raise AdminError(answer.status, answer.body.get("error", ""))
        return answer.body

    def answer(self, a: Answer) -> None:
        """The pass decided a request (an effect: supervisor/effects/runner.py)."""
        fut = self._waiting.get(a.request)
        if fut is not None and not fut.done():
            fut.set_result(a)

    def refuse_waiting(self) -> None:
        """The node stopped: requests still waiting (a rollout) get their answer."""
        for rid in list(self._waiting):
            self.answer(Answer(rid, 409, {"error": "the supervisor is stopping"}))
