"""A stream's waits for bytes, each bounded by a timeout, with one timer per timeout period instead
of one per wait (`asyncio.timeout` per wait took ~4% of the router's CPU at 256 streams on the H200
host): the upstream responses' reads (upstream_response.py) and a batch member's waits (batching.py)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable


class IdleGuard:
    """``begin()`` before a wait and ``end()`` after it; a wait that lasts ``timeout_s`` calls
    ``on_timeout`` (it ends the wait), or without one cancels ``task``, the task that began the wait,
    and sets ``timed_out``. ``stop()`` when the stream is done. (The guard of a response is its own:
    a callback back into the response would make each one a reference cycle, left to the garbage
    collector's full collections.)"""

    def __init__(self, timeout_s: float, on_timeout: Callable[[], None] | None = None) -> None:
        self.timeout_s, self.on_timeout = timeout_s, on_timeout
        self.timed_out = False
        self.task: asyncio.Task | None = None  # (no on_timeout) the task of the wait in progress
        self._since: float | None = None  # (loop time) the wait in progress began
        self._timer: asyncio.TimerHandle | None = None

    def begin(self) -> None:
        loop = asyncio.get_running_loop()
        self._since = loop.time()
        if self.on_timeout is None:
            self.task = asyncio.current_task()
        if self._timer is None:
            self._timer = loop.call_later(self.timeout_s, self._check)

    def end(self) -> None:
        self._since = None

    def stop(self) -> None:
        self.task = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        """Fires once per timeout period: ends a wait that has lasted the whole timeout, else re-arms."""
        loop = asyncio.get_running_loop()
        since = self._since
        if since is not None and loop.time() - since >= self.timeout_s - 0.001:  # (timers fire within ~1 ms)
            self._timer, self.timed_out = None, True
            if self.on_timeout is not None:
                self.on_timeout()
            elif self.task is not None:
                self.task.cancel()
        else:
            self._timer = loop.call_at((loop.time() if since is None else since) + self.timeout_s, self._check)
