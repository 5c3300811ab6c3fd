"""The collector is held off through a failover (supervisor/router/collector_hold.py)."""
from __future__ import annotations

import gc
import time

from supervisor.router.collector_hold import CollectorHold
from supervisor.router.routing import RoutingTable


def wait_enabled(timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gc.isenabled():
            return True
        time.sleep(0.01)
    return gc.isenabled()


def test_a_fence_holds_the_collector_for_the_window_and_a_second_one_restarts_it() -> None:
    table = RoutingTable()
    table.collector = CollectorHold(0.3)
    assert wait_enabled(2.0), "(a failover of an earlier test in this process may still hold it)"
    table.mark_lost(1)
    assert not gc.isenabled(), "held from the fence on"
    time.sleep(0.2)
    table.mark_lost(2)
    time.sleep(0.2)
    assert not gc.isenabled(), "the second fence restarted the window"
    assert wait_enabled(2.0), "released after the window"


def test_a_collector_disabled_by_someone_else_stays_disabled() -> None:
    hold = CollectorHold(0.05)
    assert wait_enabled(2.0)
    gc.disable()
    try:
        hold.hold()
        time.sleep(0.2)
        assert not gc.isenabled()
    finally:
        gc.enable()
    hold.hold()
    hold.release()
    assert gc.isenabled(), "an early release turns it back on at once"
