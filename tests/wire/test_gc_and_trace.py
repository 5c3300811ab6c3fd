"""The collector's pauses are timed and logged per process (the supervisor's also as a metric);
startup objects are frozen out of its reach; a promotion's first second is logged once, with its
continued requests and steps."""
from __future__ import annotations

import gc
import logging
import time

import pytest

from wire import gc_pauses
from engines.core import promotion_trace
from engines.core.promotion_trace import PromotionTrace


def test_every_collection_is_counted_and_a_long_one_logged(monkeypatch, caplog):
    monkeypatch.setattr(gc_pauses, "_watcher", None)
    w = gc_pauses.watch()
    try:
        assert gc_pauses.watch() is w  # once per process
        monkeypatch.setattr(gc_pauses, "LOG_OVER_S", 0.0)
        with caplog.at_level(logging.WARNING, "understudy.gc"):
            gc.collect()
    finally:
        gc.callbacks.remove(w)
    assert w.count[2] == 1 and w.longest_s[2] > 0
    assert any("generation 2 paused" in r.getMessage() and "pid" in r.getMessage() for r in caplog.records)


def test_the_supervisors_pauses_are_a_metric(monkeypatch):
    """understudy_supervisor_gc_pause_seconds{generation}: every series from the start, and each
    collection observed in its generation's (as supervisor/serve.py wires it)."""
    from supervisor.metrics import Metrics
    m = Metrics()
    text = m.render().decode()
    assert all(f'understudy_supervisor_gc_pause_seconds_count{{generation="{g}"}} 0.0' in text for g in "012")
    monkeypatch.setattr(gc_pauses, "_watcher", None)
    w = gc_pauses.watch()
    w.observers.append(m.observe_gc)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(w)
    assert 'understudy_supervisor_gc_pause_seconds_count{generation="2"} 1.0' in m.render().decode()


def test_freeze_moves_what_exists_out_of_the_collector():
    made = [[i] for i in range(10_000)]  # tracked containers
    try:
        gc_pauses.freeze_startup()
        assert gc.get_freeze_count() >= len(made)
    finally:
        gc.unfreeze()


def test_the_supervisor_calls_its_serving_hooks_once_the_first_primary_is_ready(tmp_path):
    """(supervisor/serve.py freezes there what the loop made before serving: its servers and apps.)"""
    import zmq
    from supervisor.core.actions import Notify
    from supervisor.effects.bus import EventBus
    from supervisor.effects.publisher import Publisher
    from supervisor.effects.sdnotify import Notifier
    from supervisor.metrics import Metrics
    calls: list[str] = []
    ctx = zmq.Context()
    try:
        p = Publisher(EventBus(ctx, str(tmp_path / "events.sock")), Metrics(), Notifier(), "ready: serving",
                      [lambda: calls.append("hook")])
        p.notify(Notify("stuck", "waiting"))
        assert calls == []
        p.notify(Notify("ready", "serving"))
        assert calls == ["hook"]
    finally:
        ctx.destroy(linger=0)


def test_promotion_trace_logs_its_first_second_once(monkeypatch, caplog):
    monkeypatch.setattr(promotion_trace, "WINDOW_S", 0.05)
    t = PromotionTrace()
    t.step([time.monotonic()] * 7, 3, 3)  # not armed: nothing kept
    assert t.steps == []
    t.arm(reserved=100 << 20)
    t.continued()
    with caplog.at_level(logging.INFO, "engines.core.promotion_trace"):
        now = time.monotonic()
        t.step([now] * 7, 5, 40, reserved=100 << 20)
        time.sleep(0.06)
        now = time.monotonic()
        cpu = time.thread_time()
        t.step([now + i * 0.001 for i in range(7)], 7, 7, cpu=[cpu + i * 0.0004 for i in range(7)],
               reserved=164 << 20)
        t.step([now] * 7, 7, 7)  # disarmed once logged
    lines = [r.getMessage() for r in caplog.records if "after the promotion" in r.getMessage()]
    assert len(lines) == 1 and "1 continued requests admitted" in lines[0] and "2 steps" in lines[0]
    assert "schedule/prepare/run/sample/build/wait/seal ms" in lines[0]
    assert "5 rows 40 tokens" in lines[0] and t.since is None
    first, second = lines[0].split("5 rows 40 tokens")[1].split("7 rows 7 tokens")
    assert "device memory" not in first  # (the allocator held as much as at the promotion)
    assert " ms (1.0/1.0/1.0/1.0/1.0/1.0/" in second and "; CPU 0.4/0.4/0.4/0.4/0.4/0.4/" in second
    assert "; device memory +64 MiB)" in second


@pytest.mark.parametrize("arrivals", [0, 2])
def test_promotion_trace_summary_without_or_with_arrivals(arrivals):
    t = PromotionTrace()
    t.arm()
    for _ in range(arrivals):
        t.continued()
    now = time.monotonic()
    t.steps.append(promotion_trace._Step([now] * 8, 1, 1))
    text = t.summary()
    assert ("no continued request" in text) == (arrivals == 0)


def test_first_use_warm_up_names_are_checked(monkeypatch):
    from engines.core import first_use
    monkeypatch.setenv("UNDERSTUDY_WARM_FIRST_USE", " sampling, graphs ")
    assert first_use.asked() == ["sampling", "graphs"]
    monkeypatch.setenv("UNDERSTUDY_WARM_FIRST_USE", "sampling,kernels")
    with pytest.raises(ValueError, match="UNDERSTUDY_WARM_FIRST_USE: kernels not one of sampling, graphs"):
        first_use.asked()
    monkeypatch.delenv("UNDERSTUDY_WARM_FIRST_USE")
    assert first_use.asked() == []
