"""Startup phases: timed, reported to the control channel as they end, printed as a table."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from .phase_profile import profiled

PHASES = ("pre_init", "tokenizer", "dist_init", "weights", "kv_cache", "numerics", "graph_capture", "server_ready")


def process_age_s() -> float:
    """Seconds since this process was created (exec or fork), to the kernel's clock tick (~10 ms).

    Both ends are measured from boot (/proc/self/stat starttime and CLOCK_BOOTTIME), which avoids
    the up-to-1 s rounding of wall-clock creation times.
    """
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start_ticks = int(fields[19])  # field 22 of stat(5); fields[0] here is field 3
    return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"))


class StartupTimer:
    """Times the engine's startup phases in order.

    `pre_init` runs from the process's creation (a fork for the spawn server) to the first
    `phase()` call, so it holds interpreter start and imports.
    """

    def __init__(self, on_phase: Callable[[str, float, str | None], None] | None = None):
        self.phases: dict[str, float] = {}
        self.weights_source = "unknown"
        self.kv_source = "own"  # `shared` (the ranks' daemon pools), `own`, `own:<why no pool>`
        self.kv_pool_id: str | None = None  # rank 0's shared pool, as its daemon names it
        self.on_phase = on_phase
        self._record("pre_init", process_age_s())

    def _record(self, name: str, seconds: float, source: str | None = None) -> None:
        if name not in PHASES:
            raise ValueError(f"unknown startup phase {name!r}; expected one of {PHASES}")
        self.phases[name] = seconds
        if self.on_phase:
            self.on_phase(name, seconds, source)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase `name` (the weights phase also records `weights_source`)."""
        t0 = time.perf_counter()
        with profiled(name):
            yield
        self._record(name, time.perf_counter() - t0, self.weights_source if name == "weights" else None)

    @property
    def total_s(self) -> float:
        return sum(self.phases.values())

    def summary(self) -> dict:
        """The body of GET /startup."""
        return {"phases": dict(self.phases), "weights_source": self.weights_source, "kv_source": self.kv_source,
                "kv_pool_id": self.kv_pool_id, "total_s": round(self.total_s, 6)}

    def table(self) -> str:
        """A fixed-width table, one row per phase, like the reference breakdown."""
        total = self.total_s or 1e-9
        lines = [f"{'phase':<14}{'seconds':>10}{'share':>8}", "-" * 32]
        for name in PHASES:
            if name in self.phases:
                s = self.phases[name]
                extra = f"  ({self.weights_source})" if name == "weights" else ""
                lines.append(f"{name:<14}{s:>10.3f}{s / total:>8.1%}{extra}")
        lines += ["-" * 32, f"{'total':<14}{self.total_s:>10.3f}"]
        return "\n".join(lines)
