"""The garbage collector held off while a failover is under way.

The supervisor's process runs the router and the failover's decisions in one event loop, and a
failover is when the router allocates most (every stream in flight framed into one batch): on the
H200, collections of 10-23 ms fell inside failovers (2 of 100 failover_seconds over 50 ms, one
with 23 ms of collections in it). From the fence on, for HOLD_S, nothing is collected; what the
failover made is collected after, in one go.
"""
from __future__ import annotations

import gc
import threading
import time

HOLD_S = 0.5  # a failover's continuations have all had a token by then (p99 ~0.2 s on the H200)
HOLD_MAX_S = 2.0  # fences in a row (a crash loop) hold it this long at most, then leave it on for HOLD_S


class CollectorHold:
    """``hold()`` pauses the collector for ``seconds`` of wall time, whatever the loop does; a new
    hold restarts the window, up to ``longest`` after the first, after which the collector stays on
    for ``seconds`` whatever comes. It never re-enables a collector that someone else had disabled."""

    def __init__(self, seconds: float = HOLD_S, longest: float = HOLD_MAX_S) -> None:
        self.seconds, self.longest = seconds, longest
        self._lock = threading.Lock()
        self._release: threading.Timer | None = None
        self._since = 0.0  # the stretch began
        self._due = 0.0  # the running timer's release
        self._free_until = 0.0  # after a stretch of `longest`: no hold before

    def hold(self) -> None:
        with self._lock:
            now = time.monotonic()
            if now < self._free_until:
                return
            if self._release is not None:
                if now + self.seconds > self._since + self.longest:
                    self._free_until = self._due + self.seconds  # long enough: let it collect after
                    return
                self._release.cancel()
            elif gc.isenabled():
                gc.disable()
                self._since = now
            else:
                return  # not ours to turn back on
            self._due = now + self.seconds
            self._release = threading.Timer(self.seconds, self.release)
            self._release.daemon = True
            self._release.start()

    def release(self) -> None:
        with self._lock:
            if self._release is not None:
                self._release.cancel()
                self._release = None
                gc.enable()
