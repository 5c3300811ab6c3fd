"""Stop a block of code running in the current task from outside it (a callback, another task),
without giving the block a task of its own; and its common use, an HTTP exchange that stops when
its client leaves.

The router used to run each request's call to the engine in a new task, so that a client leaving or
the engine being fenced could cancel just that call, and the engine's streaming responses ran their
body in a task group. A new task starts only after the rest of the event loop's current round;
under load (32 streams relaying a chunk per step) each such hop cost ~1 ms, twice, before a request
even reached the engine (H200 trace, bench/RESULTS.md). An Interrupt cancels the task the block runs
in instead, and tells its own cancel apart from anyone else's, as asyncio.timeout does.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any


class Interrupt:
    """``with interrupt: await ...`` in a task; ``interrupt.fire()`` (from a callback or another
    task) cancels that task while it is inside the block, and the block then ends quietly with
    ``interrupted`` set. A cancel from anyone else still propagates, also when both happen."""
    __slots__ = ("_task", "_inside", "_fired", "interrupted")

    def __init__(self) -> None:
        self._task: asyncio.Task | None = None
        self._inside = False
        self._fired = False
        self.interrupted = False  # the block ended because of fire()

    def fire(self) -> None:
        """Cancel the block (no effect once it has ended, or before it began)."""
        if self._inside and not self._fired and self._task is not None:
            self._fired = True
            self._task.cancel()

    @property
    def task(self) -> asyncio.Task | None:
        """The task whose block this interrupts (None before it began)."""
        return self._task

    def __enter__(self) -> "Interrupt":
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Interrupt must be entered inside a task")
        self._task, self._inside = task, True
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        self._inside = False
        if not self._fired:
            return False
        if self._task.uncancel() > 0 or kind is not asyncio.CancelledError:  # type: ignore[union-attr]
            return False  # someone else cancelled the task too (or the block failed on its own)
        self.interrupted = True
        return True


async def unless_client_leaves(work: Coroutine[Any, Any, None], receive: Callable[[], Awaitable[dict]]) -> None:
    """Run `work` in this task until it ends (its error re-raised) or the ASGI client disconnects
    (then it is cancelled and this returns). Our server (uvicorn) answers `receive` with
    http.disconnect once the client is gone, while a `send` to it is silently dropped: without this
    a stream to a client that left would run to its end."""
    interrupt = Interrupt()
    watcher = asyncio.ensure_future(_disconnected(receive))
    watcher.add_done_callback(lambda w: w.cancelled() or interrupt.fire())
    try:
        with interrupt:
            await work
    finally:
        watcher.cancel()


async def _disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns once the client has disconnected."""
    while (await receive())["type"] != "http.disconnect":
        pass
