"""The log flood filter: a burst passes, the rest is dropped and counted on the next line."""
from __future__ import annotations

import logging
import time

from engines.lograte import RateLimitFilter


def record(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("x", logging.ERROR, __file__, 1, msg, args, None)


def test_flood_is_cut_and_counted():
    f = RateLimitFilter(burst=3, window_s=0.2)
    passed = [f.filter(record("accept failed: %s", i)) for i in range(1000)]
    assert sum(passed) == 3
    assert f.filter(record("another message"))  # other messages are not held back
    time.sleep(0.25)
    r = record("accept failed: %s", 7)
    assert f.filter(r) and r.getMessage() == "accept failed: 7 [997 more like this dropped in 0.2s]"
