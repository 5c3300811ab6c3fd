"""When to feed systemd's watchdog: only while the node serves, or is making progress toward it.

Stuck, precisely: no READY primary routed, and for ``stuck_after_s`` no progress, where progress is
any child state transition (a spawn started, an engine READY, FAILED, BACKOFF...), a startup phase
or state reported by an engine, or a daemon's load advancing. A crash loop is progress (each retry
is a spawn); a start that hangs with no timeout firing, or a supervisor that stopped acting, is not.
Then WATCHDOG=1 stops and systemd (WatchdogSec) restarts the node (supervisor/core/stuck.py judges,
supervisor/effects/runner.py feeds it).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WatchdogGate:
    """The stuck verdict as a function of (now, serving, last progress)."""

    stuck_after_s: float
    last_progress: float

    def progress(self, now: float) -> None:
        """Something moved toward serving (or away, to be retried)."""
        self.last_progress = max(self.last_progress, now)

    def stuck_for(self, now: float, serving: bool) -> float:
        """Seconds since progress, when not serving; 0 while serving."""
        return 0.0 if serving else max(now - self.last_progress, 0.0)

    def should_feed(self, now: float, serving: bool) -> bool:
        """Feed WATCHDOG=1 now?"""
        return serving or now - self.last_progress <= self.stuck_after_s

