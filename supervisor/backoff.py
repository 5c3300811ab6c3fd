"""Restart policy: exponential backoff, and FATAL when a slot flaps."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    """Per-slot failure memory. ``record_failure`` answers the delay, or None for FATAL."""

    base_s: float
    max_s: float
    window_s: float
    max_failures: int
    failures: deque[float] = field(default_factory=deque)
    consecutive: int = 0

    def record_failure(self, now: float | None = None) -> float | None:
        """Count a failure; the delay before the next start, or None if the slot now flaps."""
        now = time.monotonic() if now is None else now
        self.failures.append(now)
        while self.failures and now - self.failures[0] > self.window_s:
            self.failures.popleft()
        self.consecutive += 1
        if len(self.failures) >= self.max_failures:
            return None
        return min(self.base_s * (2 ** (self.consecutive - 1)), self.max_s)

    def record_success(self) -> None:
        """The slot became READY: the next failure starts the backoff from the base again."""
        self.consecutive = 0

    def reset(self) -> None:
        """Admin reset (restart of a FATAL slot)."""
        self.failures.clear()
        self.consecutive = 0
