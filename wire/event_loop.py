"""The event loop of every serving process (the engine's HTTP front end, the supervisor and its
router, the load generator): uvloop, whose callbacks, timers and socket transports cost less per
stream chunk than asyncio's own loop (bench/HISTORY.md, "The loops themselves")."""
from __future__ import annotations

import asyncio
from typing import Any, Coroutine, TypeVar

import uvloop

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on a uvloop loop."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
