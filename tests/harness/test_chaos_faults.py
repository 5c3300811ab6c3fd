"""Fault targeting and group signalling, on real child processes."""
from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import psutil
import pytest

from harness.chaos.faults import fatal_names, pick_target, replaced, settled
from harness.chaos.records import EngineView, FaultRecord, StatusSample
from harness.chaos.signals import SignalError, group_alive, signal_group


def _sample(a: tuple[str, str, int], b: tuple[str, str, int], daemon: tuple[str, int] = ("READY", 9)) -> StatusSample:
    return StatusSample(t=0.0, epoch=1, engines=[EngineView("a", "engine", a[0], a[1], a[2]),
                                                 EngineView("b", "engine", b[0], b[1], b[2])],
                        daemons=[EngineView("daemon-rank0", "daemon", None, daemon[0], daemon[1])])


def test_targets_follow_roles() -> None:
    s = _sample(("standby", "READY", 1), ("primary", "READY", 2))
    rng = random.Random(0)
    assert pick_target(s, "primary", rng).name == "b"
    assert pick_target(s, "standby", rng).name == "a"
    assert pick_target(s, "daemon", rng).name == "daemon-rank0"
    assert {pick_target(s, "random", rng).name for _ in range(50)} == {"a", "b", "daemon-rank0"}
    no_pid = _sample(("standby", "STARTING", None), ("primary", "READY", 2))  # type: ignore[arg-type]
    assert pick_target(no_pid, "standby", rng) is None


def test_settled_and_replaced() -> None:
    ok = _sample(("standby", "READY", 1), ("primary", "READY", 2))
    assert settled(ok)
    assert not settled(_sample(("standby", "WARMING", 1), ("primary", "READY", 2)))
    assert not settled(_sample(("standby", "READY", 1), ("primary", "READY", 2), daemon=("BACKOFF", 9)))
    assert not settled(_sample(("primary", "READY", 1), ("primary", "READY", 2)))  # two primaries
    kill_b = FaultRecord(0, "kill-primary", 0.0, "primary", "b", 2)
    assert not replaced(ok, kill_b)  # b still has the killed pid: the supervisor has not noticed yet
    assert replaced(_sample(("primary", "READY", 1), ("standby", "READY", 3)), kill_b)
    assert not replaced(_sample(("primary", "READY", 1), ("standby", "WARMING", 3)), kill_b)
    rollout = FaultRecord(1, "rollout", 0.0, detail={"engine_pids": {"a": 1, "b": 3}})
    assert not replaced(_sample(("primary", "READY", 4), ("standby", "READY", 3)), rollout)
    assert replaced(_sample(("primary", "READY", 4), ("standby", "READY", 5)), rollout)
    stop_d = FaultRecord(2, "stop-daemon", 0.0, "daemon", "daemon-rank0", 9)
    assert not replaced(ok, stop_d)  # same pid, still stopped as far as chaos knows
    stop_d.detail["released_after_s"] = 30.0  # the supervisor never fenced it; chaos resumed it
    assert replaced(ok, stop_d)
    assert fatal_names(_sample(("standby", "FATAL", 1), ("primary", "READY", 2))) == ["a"]


def _sleeper(new_session: bool) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=new_session)


def test_signal_group_stops_and_kills_a_real_group() -> None:
    child = _sleeper(new_session=True)
    try:
        signal_group(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while psutil.Process(child.pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.02)
        assert psutil.Process(child.pid).status() == psutil.STATUS_STOPPED
        signal_group(child.pid, signal.SIGKILL)
        assert child.wait(timeout=5) == -signal.SIGKILL
        assert not group_alive(child.pid)
        with pytest.raises(SignalError, match="gone"):
            signal_group(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_signal_group_refuses_a_non_leader() -> None:
    child = _sleeper(new_session=False)  # in our own process group
    try:
        with pytest.raises(SignalError, match="not a process-group leader"):
            signal_group(child.pid, signal.SIGKILL)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
