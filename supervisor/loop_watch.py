"""The supervisor's loop (the reconcile passes and the router share it) never stalls silently: a watch
thread notes when the loop last ran a tick, samples where the loop's thread is while it does not, and
logs a stall of LOOP_STALL_S or more as a warning when it ends: how long, where the loop was (the
stacks sampled, the commonest first), and how late the watch itself woke meanwhile (late too: the
whole process was held back, by the CPU or by a thread that kept the GIL, not the loop alone).
A failover is decided and switched in this loop in ~15 ms: in one that took 235 ms on a GPU host the
supervisor logged the promotion 221 ms after the engine made it and the router saw the losses 0.3 s
late (bench/RESULTS.md, twenty-fifth session), and nothing said why."""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback
from collections import Counter

log = logging.getLogger("understudy")

LOOP_STALL_S = 0.1
TICK_S = 0.02  # the loop's tick and the watch's look
FRAMES = 6  # innermost frames of a sampled stack


class LoopWatch:
    """`start()` on the loop's thread; `stop()` ends the watch."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stall_s: float = LOOP_STALL_S, tick_s: float = TICK_S):
        self.loop, self.stall_s, self.tick_s = loop, stall_s, tick_s
        self._ran = time.monotonic()
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()

    def start(self) -> None:
        self.loop.call_soon(self._tick)
        threading.Thread(target=self._watch, name="loop-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _tick(self) -> None:
        self._ran = time.monotonic()
        if not self._stop.is_set():
            self.loop.call_later(self.tick_s, self._tick)

    def _watch(self) -> None:
        stacks: Counter[str] = Counter()
        since, late, looked = 0.0, 0.0, time.monotonic()
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            late, looked = max(late, now - looked - self.tick_s), now
            ran = self._ran
            if now - ran >= self.stall_s + self.tick_s:  # the loop is stalled now: where is it?
                since = since or ran
                frame = sys._current_frames().get(self._loop_thread)
                stacks[where(frame) if frame is not None else "?"] += 1
            elif since:  # it ran again
                self._report(ran - since - self.tick_s, stacks, late)
                stacks, since, late = Counter(), 0.0, 0.0
            else:
                late = 0.0

    def _report(self, stalled_s: float, stacks: Counter[str], late: float) -> None:
        seen = sum(stacks.values())
        log.warning("the supervisor's loop stalled for %.0f ms (this watch woke up to %.0f ms late meanwhile); "
                    "where it was, in %d looks: %s", stalled_s * 1e3, late * 1e3, seen,
                    "; ".join(f"{n}x {stack}" for stack, n in stacks.most_common(3)))


def where(frame) -> str:
    """A stack's innermost frames, innermost first: `file:line function < ...`."""
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                      for f in reversed(traceback.extract_stack(frame)[-FRAMES:]))
