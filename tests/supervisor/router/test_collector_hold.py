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
    table.collector = CollectorHold(1.0)
    assert wait_enabled(2.0), "(a failover of an earlier test in this process may still hold it)"
    table.mark_lost(1)
    assert not gc.isenabled(), "held from the fence on"
    time.sleep(0.6)
    table.mark_lost(2)
    time.sleep(0.6)
    assert not gc.isenabled(), "the second fence restarted the window"
    assert wait_enabled(3.0), "released after the window"


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


def test_fences_in_a_row_hold_it_no_longer_than_the_longest_stretch() -> None:
    """A crash loop fencing every 0.05 s must not keep the collector off for good: the stretch ends
    (`longest`), and a fence right after it does not turn the collector off again (`seconds`)."""
    hold = CollectorHold(0.5, longest=1.0)
    assert wait_enabled(2.0)
    hold.hold()
    assert not gc.isenabled()
    deadline = time.monotonic() + 60  # (a guard against a hang, not a measure)
    while not gc.isenabled():
        assert time.monotonic() < deadline, "fences in a row kept the collector off"
        hold.hold()
        time.sleep(0.05)
    hold.hold()
    assert gc.isenabled(), "a fence just after a whole stretch held it off again"
    hold.release()
