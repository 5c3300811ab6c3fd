"""Poll the admin /status on an interval; notice a supervisor that stopped answering."""
from __future__ import annotations

import asyncio
import time

from .admin import AdminClient, AdminError
from .records import StatusSample
from .status_view import parse_status


class StatusPoller:
    """Keeps every StatusSample; `dead` is set with a reason after `dead_after_s` of failures."""

    def __init__(self, admin: AdminClient, interval_s: float, dead_after_s: float, max_samples: int) -> None:
        self.admin = admin
        self.interval_s = interval_s
        self.dead_after_s = dead_after_s
        self.max_samples = max_samples
        self.samples: list[StatusSample] = []
        self.dead = asyncio.Event()
        self.dead_reason: str | None = None
        self.last_error: str | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until `stop` is set, the supervisor is declared dead, or max_samples is reached."""
        failing_since: float | None = None
        while not stop.is_set() and len(self.samples) < self.max_samples:
            t = time.time()
            try:
                body = await self.admin.status()
                self.samples.append(parse_status(body, t))
                failing_since = None
            except AdminError as exc:
                self.last_error = str(exc)
                failing_since = failing_since or t
                if t - failing_since >= self.dead_after_s:
                    self.dead_reason = f"supervisor stopped answering for {t - failing_since:.1f} s: {exc}"
                    self.dead.set()
                    return
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.interval_s)
            except asyncio.TimeoutError:
                pass
