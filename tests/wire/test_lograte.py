"""The log flood filter: a burst passes, the rest is dropped and counted on the next line."""
from __future__ import annotations

import logging
import time

from wire.lograte import RateLimitFilter


def record(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("x", logging.ERROR, __file__, 1, msg, args, None)


def test_flood_is_cut_and_counted():
    f = RateLimitFilter(burst=3, window_s=0.2)
    t0 = time.time()
    passed = [f.filter(record("accept failed: %s", i)) for i in range(1000)]
    t1 = time.time()
    assert sum(passed) == 3
    assert f.filter(record("another message"))  # other messages are not held back
    time.sleep(0.25)
    r = record("accept failed: %s", 7)
    assert f.filter(r) and r.getMessage().startswith("accept failed: 7 [997 more like this dropped in the 0.2s from ")
    # when the flood's window began (this line may come much later): between t0 and t1
    assert r.getMessage()[-9:-1] in {time.strftime("%H:%M:%S", time.localtime(t)) for t in (t0, t1)}


def test_the_supervisor_never_drops_a_state_transition_in_a_flood():
    """Issue 23: a standby's return to READY never appeared, the flood filter had counted it with
    other lines of the same template. Transitions (supervisor/core/lifecycle.py) pass uncounted."""
    import io
    from decision_table import serving
    from supervisor.lograte import KeepingFilter
    p = serving(flap_max=100, heartbeat_timeout_s=1e6)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(KeepingFilter(burst=3, window_s=60.0))
    log = logging.getLogger("understudy")
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    try:
        for _ in range(10):  # 10 restarts of b: EXITED, BACKOFF, STARTING, WARMING, READY each
            p.play(("exit", "b"), ("exit read", "b", -9), ("wait", 2.0), ("launched", "b"), ("ready", "b"))
        for i in range(50):
            log.info("%s", f"other line {i}")  # the template the transitions share: still cut
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    lines = out.getvalue().splitlines()
    published = [e for e in p.published("transition") if e["engine"] == "b"]
    assert len(published) == 50
    assert sum(line.startswith("b (standby): ") for line in lines) == len(published)
    assert sum(line.startswith("b (standby): WARMING -> READY: canary passed") for line in lines) == 10
    assert sum(line.startswith("other line") for line in lines) == 3
