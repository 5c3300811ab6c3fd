"""A log handler filter that keeps a flood from drowning the log (issue 12: 49k lines in a second).

At most ``burst`` records of the same (logger, level, message template) pass per ``window_s``;
the first one after a window that dropped some says how many were dropped, and when.
"""
from __future__ import annotations

import logging
import time

MAX_KEYS = 2048


class RateLimitFilter(logging.Filter):
    """Per message template: ``burst`` lines per ``window_s``, then a count of the dropped ones."""

    def __init__(self, burst: int = 20, window_s: float = 10.0) -> None:
        super().__init__()
        self.burst, self.window_s = burst, window_s
        self._seen: dict[tuple, list] = {}  # key -> [window start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = time.monotonic()
        state = self._seen.get(key)
        if state is None:
            if len(self._seen) >= MAX_KEYS:
                self._seen.clear()
            state = self._seen[key] = [now, 0, 0]
        if now - state[0] >= self.window_s:
            dropped, began = state[2], time.localtime(time.time() - (now - state[0]))
            state[:] = [now, 0, 0]
            if dropped:  # when they were (this line may come much later); no "%": safe with or without args
                record.msg = (f"{record.msg} [{dropped} more like this dropped in the {self.window_s:g}s from "
                              f"{time.strftime('%H:%M:%S', began)}]")
        state[1] += 1
        if state[1] > self.burst:
            state[2] += 1
            return False
        return True


def install(logger: logging.Logger | None = None) -> None:
    """Add the filter to every handler of ``logger`` (the root logger by default)."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RateLimitFilter) for f in handler.filters):
            handler.addFilter(RateLimitFilter())
