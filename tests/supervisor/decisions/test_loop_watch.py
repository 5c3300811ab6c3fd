"""The supervisor's loop watch (supervisor/loop_watch.py) on a real asyncio loop and thread: a callback
that blocks the loop is logged with its duration and where it blocked; a loop that runs is not."""
from __future__ import annotations

import asyncio
import logging
import re
import time

from supervisor.loop_watch import LoopWatch


def blocks_the_loop_for(seconds: float) -> None:
    time.sleep(seconds)


async def run_with_watch(block_s: float, stall_s: float = 0.1) -> None:
    watch = LoopWatch(asyncio.get_running_loop(), stall_s=stall_s, tick_s=0.01)
    watch.start()
    await asyncio.sleep(0.1)
    if block_s:
        blocks_the_loop_for(block_s)
    await asyncio.sleep(0.2)  # (the watch sees the loop run again)
    watch.stop()


def test_a_blocked_loop_is_logged_with_where_it_blocked(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="understudy"):
        asyncio.run(run_with_watch(0.4))
    lines = [r.getMessage() for r in caplog.records if "loop stalled" in r.getMessage()]
    assert len(lines) == 1, lines
    ms = float(re.search(r"stalled for (\d+) ms", lines[0])[1])
    assert 300 <= ms <= 2000, lines[0]  # (the 400 ms sleep, give or take a tick; a slow CI host adds)
    assert "blocks_the_loop_for" in lines[0] and "test_loop_watch.py" in lines[0], lines[0]


def test_a_loop_that_runs_is_not_logged(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="understudy"):
        asyncio.run(run_with_watch(0, stall_s=0.5))  # (a loaded CI host may hold a loop 0.1 s)
    assert not [r for r in caplog.records if "loop stalled" in r.getMessage()]
