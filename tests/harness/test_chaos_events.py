"""Event parsing, and the listener receiving from the supervisor's real EventBus over ipc."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import zmq

from harness.chaos.events import (
    EventParseError, FailoverEvent, RecoveredEvent, TransitionEvent, parse_event, to_wall_clock,
)
from harness.chaos.listener import EventListener
from supervisor.effects.bus import EventBus


def _frame(**obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_parse_each_event_type() -> None:
    now = time.time()
    t = parse_event(_frame(type="transition", engine="a", **{"from": "WARMING"}, to="READY", role="primary",
                           epoch=2, ts=now, kind="engine"), now + 0.01)
    assert isinstance(t, TransitionEvent)
    assert (t.engine, t.from_state, t.to, t.role, t.epoch, t.t_recv) == ("a", "WARMING", "READY", "primary", 2, now + 0.01)
    f = parse_event(_frame(type="failover", reason="exit", **{"from": "a"}, to="b", epoch=3, seconds=0.04, ts=now), now)
    assert isinstance(f, FailoverEvent) and (f.from_engine, f.to, f.seconds) == ("a", "b", 0.04)
    r = parse_event(_frame(type="recovered", engine="a", seconds=1.5, weights_source="cache_hit", ts=now), now)
    assert isinstance(r, RecoveredEvent) and r.weights_source == "cache_hit"
    assert parse_event(_frame(type="something_new", ts=now), now) is None


@pytest.mark.parametrize("frame, message", [
    (b"\xff\xfe", "not JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (_frame(type="failover", reason="exit", ts=1.7e9), "to"),
    (_frame(type="transition", engine="a", to="READY", ts="yesterday"), "ts"),
])
def test_malformed_frames_raise_one_line(frame: bytes, message: str) -> None:
    with pytest.raises(EventParseError, match=message):
        parse_event(frame, 0.0)


def test_monotonic_timestamps_become_wall_clock() -> None:
    assert to_wall_clock(1.7e9) == 1.7e9
    before = time.time()
    m = time.monotonic()
    after = time.time()  # the wall clock at m lies between: however long this process was preempted
    assert before - 1e-3 <= to_wall_clock(m) <= after + 1e-3


def test_listener_receives_from_the_supervisor_event_bus(tmp_path: Path) -> None:
    path = tmp_path / "events.sock"
    ctx = zmq.Context()
    bus = EventBus(ctx, str(path))

    async def scenario() -> EventListener:
        listener = EventListener(f"ipc://{path}")
        stop = asyncio.Event()
        task = asyncio.create_task(listener.run(stop, poll_s=0.05))
        deadline = time.time() + 5.0
        while not listener.events and time.time() < deadline:  # PUB drops until the SUB joined
            bus.publish({"type": "transition", "engine": "a", "from": "WARMING", "to": "READY", "role": "primary"})
            await asyncio.sleep(0.05)
        bus._sock.send(b"not json")
        bus.publish({"type": "recovered", "engine": "b", "seconds": 0.7, "weights_source": "disk:mismatch"})
        await asyncio.sleep(0.3)
        stop.set()
        await asyncio.wait_for(task, 30.0)
        return listener

    started = time.time()
    try:
        listener = asyncio.run(scenario())
    finally:
        bus.close()
        ctx.term()
    ended = time.time()
    assert listener.events and isinstance(listener.events[0], TransitionEvent)
    assert any(isinstance(e, RecoveredEvent) and e.weights_source == "disk:mismatch" for e in listener.events)
    assert listener.errors and "not JSON" in listener.errors[0]
    # both stamps are wall-clock, in order: published (the bus's ts) before received, during the run
    assert all(started <= e.ts <= e.t_recv <= ended for e in listener.events)
