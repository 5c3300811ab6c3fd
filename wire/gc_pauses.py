"""Python's garbage collector, timed and kept off the objects of startup. A collection of the oldest
generation walks every tracked object and stops the process's event loop or scheduler meanwhile:
measured on an H200 host at 256 streams, an engine's took 120-260 ms about once a second, most of
it walking what torch, the model and the tokenizer made at startup (bench/RESULTS.md). Every
stream sees such a pause as a stall.

`watch()` once per process times every collection, logs one over LOG_OVER_S and tells its
`observers` (the supervisor's: `understudy_supervisor_gc_pause_seconds`); `freeze_startup()`,
once a process is about to serve, moves everything it made so far out of the collector's reach
(`gc.freeze`): later collections walk only what serving made."""
from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("understudy.gc")
LOG_OVER_S = 0.010
FREEZE_ENV = "UNDERSTUDY_GC_FREEZE"


@dataclass
class GcPauses:
    """Collections per generation, their total and longest pause (seconds); each pause also goes to
    every observer as (generation, seconds)."""

    count: list[int] = field(default_factory=lambda: [0, 0, 0])
    total_s: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    longest_s: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    observers: list[Callable[[int, float], None]] = field(default_factory=list)
    _began: float = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        took, gen = time.perf_counter() - self._began, info["generation"]
        self.count[gen] += 1
        self.total_s[gen] += took
        self.longest_s[gen] = max(self.longest_s[gen], took)
        for observe in self.observers:
            observe(gen, took)
        if took > LOG_OVER_S:
            log.warning("a garbage collection of generation %d paused %s for %.1f ms (%d objects collected)",
                        gen, _process_name(), took * 1e3, info.get("collected", 0))


_watcher: GcPauses | None = None


def _process_name() -> str:
    """This process as `ps` names it (an engine's core and its front end share a log), and its pid."""
    try:
        with open("/proc/self/comm") as f:
            return f"{f.read().strip()} (pid {os.getpid()})"
    except OSError:
        return f"pid {os.getpid()}"


def watch() -> GcPauses:
    """Time this process's collections from now on (once; later calls return the same counts)."""
    global _watcher
    if _watcher is None:
        _watcher = GcPauses()
        gc.callbacks.append(_watcher)
    return _watcher


def freeze_startup() -> None:
    """This process is about to serve: what it made until now lives as long as it does, so no
    collection needs to walk it again (garbage among it stays: a one-off, smaller than a collect's
    pause at every start). UNDERSTUDY_GC_FREEZE=0 leaves it all in reach (for an A/B run)."""
    if os.environ.get(FREEZE_ENV, "1") == "0":
        return
    gc.freeze()
    log.debug("%d objects of startup frozen out of the garbage collector", gc.get_freeze_count())
