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

HOLD_S = 0.5  # a failover's continuations have all had a token by then (p99 ~0.2 s on the H200)


class CollectorHold:
    """``hold()`` pauses the collector for ``seconds`` of wall time, whatever the loop does (a new
    hold restarts the window); it never re-enables a collector that someone else had disabled."""

    def __init__(self, seconds: float = HOLD_S) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._release: threading.Timer | None = None

    def hold(self) -> None:
        with self._lock:
            if self._release is not None:
                self._release.cancel()
            elif gc.isenabled():
                gc.disable()
            else:
                return  # not ours to turn back on
            self._release = threading.Timer(self.seconds, self.release)
            self._release.daemon = True
            self._release.start()

    def release(self) -> None:
        with self._lock:
            if self._release is not None:
                self._release.cancel()
                self._release = None
                gc.enable()
