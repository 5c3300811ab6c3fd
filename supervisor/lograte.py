"""The log flood filter (wire/lograte.py) as the supervisor installs it: records marked
``extra={KEEP: True}`` (every state transition) always pass and are not counted, so a flood of other
lines never hides one, and no "dropped" notice of other lines is hung on one."""
from __future__ import annotations

import logging

from wire.lograte import RateLimitFilter

KEEP = "understudy_keep"
"""LogRecord attribute: never rate-limited."""


class KeepingFilter(RateLimitFilter):
    """RateLimitFilter, except for records carrying ``KEEP``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return bool(getattr(record, KEEP, False)) or super().filter(record)


def install(logger: logging.Logger | None = None) -> None:
    """Add the filter to every handler of ``logger`` (the root logger by default)."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RateLimitFilter) for f in handler.filters):
            handler.addFilter(KeepingFilter())
