"""A bound on the connections busy at once, taken in the order asked (as asyncio.Semaphore), which
can also be taken without a wait when one is free: a failover's continuations go out from the
routing change itself (supervisor/router/batching.py), with no task to run first."""
from __future__ import annotations

import asyncio
from collections import deque


class Slots:
    """At most ``n`` taken at once."""

    def __init__(self, n: int) -> None:
        self._free = n
        self._waiters: deque[asyncio.Future[None]] = deque()

    def take_now(self) -> bool:
        """Take one if one is free and nobody waits for one (True), else take none."""
        if self._free and not self._waiters:
            self._free -= 1
            return True
        return False

    async def take(self) -> None:
        """Take one, once one is free (bound the wait with asyncio.timeout)."""
        if self.take_now():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # (release hands its slot over by resolving it)
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed one, but leaving: the next in line gets it
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1
