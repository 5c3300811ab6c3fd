"""Restart policy: capped exponential backoff, and a flapping verdict (FATAL for extra slots only:
the supervisor keeps retrying the last engine standing with the capped delay, forever)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

MAX_DOUBLINGS = 32  # 2**32 x base is past any cap: stop growing the exponent there


@dataclass
class RestartPolicy:
    """Per-slot failure memory: ``record_failure`` answers the delay before the next start,
    ``flapping`` says whether the slot failed ``max_failures`` times within ``window_s``."""

    base_s: float
    max_s: float
    window_s: float
    max_failures: int
    first_s: float = 0.0  # the delay after a one-off crash (failover.restart_delay_s)
    failures: deque[float] = field(default_factory=deque)
    consecutive: int = 0

    def record_failure(self, now: float | None = None) -> float:
        """Count a failure; the delay before the next start: ``first_s`` (0 by default) for the first
        since the slot was READY, at boot or since a reset (a one-off crash costs no backoff: its
        standby is back the sooner), unless the slot flaps; then base x 2^(n-2) for the n-th in a
        row, at most ``max_s``."""
        now = time.monotonic() if now is None else now
        self.failures.append(now)
        while self.failures and now - self.failures[0] > self.window_s:
            self.failures.popleft()
        self.consecutive += 1
        if self.consecutive == 1 and not self.flapping:  # (a slot that flaps waits even after a READY)
            return self.first_s
        return min(self.base_s * 2.0 ** min(max(self.consecutive - 2, 0), MAX_DOUBLINGS), self.max_s)

    @property
    def flapping(self) -> bool:
        """``max_failures`` failures within ``window_s`` (as of the last one recorded)."""
        return len(self.failures) >= self.max_failures

    def record_success(self) -> None:
        """The slot became READY: the next failure starts the backoff from the base again."""
        self.consecutive = 0

    def reset(self) -> None:
        """Admin reset (restart of a FATAL slot)."""
        self.failures.clear()
        self.consecutive = 0
