"""Engine exits observed and recorded as what they were (issue 23, item 6), with real processes (CPU,
tiny model): link sockets of dead engines removed (after each reap, and at boot), a crash racing an
admin promote recorded as a crash, and a FATAL slot tried again on its slow schedule (the rollout
after a re-adoption is in test_supervisor_readopt.py). Tests run in file order on one supervisor
(engines started directly: the exits are ours to reap) and each leaves the node healthy."""
from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import psutil
import pytest

from wire.link_sockets import socket_paths
from harness.node import Harness

CONFIG = """
runtime_dir: {rt}
model: {{path: {model}}}
engines: {{heartbeat_interval_s: 0.1, kv_cache_bytes: 4194304, max_num_seqs: 8, max_model_len: 128, spawn: {spawn}}}
failover: {{heartbeat_timeout_s: 3, probe_interval_s: 1, probe_timeout_s: 5, hold_timeout_s: 30, exit_poll_ms: 0,
           backoff_base_s: 0.1, backoff_max_s: 1, flap_max: 3, fatal_retry_s: 5, drain_timeout_s: 10,
           stop_timeout_s: 5}}
router: {{port: 0}}
admin: {{port: 0}}
"""
STALE_PID = 4_194_000  # above any pid_max of a test box: no engine of ours


def leave_socket(path: Path) -> None:
    """A bound AF_UNIX socket file whose owner is gone (what a SIGKILLed engine leaves)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()


@pytest.fixture(scope="module")
def sup(tmp_path_factory, tiny_model):
    work = tmp_path_factory.mktemp("exits")
    rt = work / "rt"
    rt.mkdir(mode=0o700)
    for path in socket_paths(rt, STALE_PID):
        leave_socket(path)
    h = Harness(work, CONFIG.format(rt=rt, model=tiny_model, spawn="direct"), notify=False)
    try:
        h.wait_booted()
        h.wait_all_ready(120)
        yield h
    finally:
        h.stop()


def engine(sup: Harness, name: str) -> dict:
    return sup.engines()[name]


def new_pid(sup: Harness, name: str, after_incarnation: int) -> int:
    st = sup.wait_for(lambda st: any(e["name"] == name and e["incarnation"] > after_incarnation and e["pid"]
                                     for e in st["engines"]), 60, f"{name} started again")
    return next(e["pid"] for e in st["engines"] if e["name"] == name)


def front_end_of(pid: int, name: str) -> psutil.Process:
    """The engine's front end (engine-NAME-http), as soon as it is forked."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for child in psutil.Process(pid).children():
            try:
                if child.name() == f"engine-{name}-http":
                    return child
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.002)
    raise AssertionError(f"engine {pid} forked no front end")


def test_boot_sweeps_the_link_sockets_dead_engines_left(sup):
    assert not any(p.exists() for p in socket_paths(sup.rd, STALE_PID))
    assert f"removed eng-{STALE_PID}-in.sock, left by a dead engine" in sup.log.read_text()


def test_an_engine_killed_before_its_front_end_connected_leaves_no_link_socket(sup):
    before = engine(sup, "b")["incarnation"]
    assert sup.admin("POST", "/admin/engines/b/restart").status_code == 200
    pid = new_pid(sup, "b", before)
    front_end_of(pid, "b").suspend()  # the core binds both files and waits for it
    paths = socket_paths(sup.rd, pid)
    deadline = time.monotonic() + 60
    while not all(p.exists() for p in paths):
        assert psutil.pid_exists(pid) and time.monotonic() < deadline, "the core never bound its link sockets"
        time.sleep(0.01)
    os.killpg(pid, signal.SIGKILL)
    sup.wait_for(lambda st: not any(p.exists() for p in paths), 30, "link sockets removed")
    assert f"removed eng-{pid}-in.sock, left by engine pid {pid}" in sup.log.read_text()
    sup.wait_all_ready(120)
    assert not list(sup.rd.glob("eng-*.sock"))


def test_a_crash_racing_an_admin_promote_is_a_failover_for_the_exit(sup):
    """The primary dies while an admin promote waits for its `demote` answer (SIGSTOPped first, so it
    cannot answer, then SIGKILLed): the switchover is recorded as a failover for its exit, during a
    promote, never as a planned promote."""
    st = sup.wait_all_ready()
    old = next(e for e in st["engines"] if e["name"] == st["primary"])
    since = len(sup.events)
    os.killpg(old["pid"], signal.SIGSTOP)
    try:
        answer = sup.admin("POST", "/admin/promote")
        assert answer.status_code == 200, answer.text
    finally:
        os.killpg(old["pid"], signal.SIGKILL)
    ev = sup.wait_event(lambda e: e["type"] == "failover" and e["from"] == old["name"], 30, since)
    assert (ev["reason"], ev.get("during")) == ("exit", "promote"), ev
    assert not [e for e in sup.events[since:] if e["type"] == "failover" and e["reason"] == "promote"]
    sup.wait_all_ready(120)
    assert engine(sup, old["name"])["recent_failures"] >= 1  # its slot counted the crash


def test_a_fatal_slot_is_tried_again_on_its_slow_schedule_and_says_so(sup):
    """A crash burst makes the standby's slot FATAL (flap_max 3) while the primary serves; it is not
    left so: status says when it is tried again, the retry is an event and a metric, and it comes
    back READY as the standby."""
    since = len(sup.events)
    for _ in range(5):  # until FATAL (the slot may carry earlier failures of this module)
        b = engine(sup, "b")
        if b["state"] == "FATAL":
            break
        pid = new_pid(sup, "b", b["incarnation"] - 1)
        inc = engine(sup, "b")["incarnation"]
        os.killpg(pid, signal.SIGKILL)
        sup.wait_for(lambda st: any(e["name"] == "b" and (e["state"] == "FATAL" or e["incarnation"] > inc)
                                    for e in st["engines"]), 30, "b's exit read (FATAL, or started again)")
    fatal = sup.wait_event(lambda e: e["type"] == "fatal" and e["engine"] == "b", 30, since)
    assert fatal["retry_in_s"] == 5
    b = engine(sup, "b")
    if b["state"] == "FATAL":  # (the retry may already be under way)
        assert b["next_try_in_s"] is not None and "tried again in 5s" in b["reason"]
    assert sup.admin("GET", "/status").json()["primary"] is not None  # the primary serves on
    retry = sup.wait_event(lambda e: e["type"] == "fatal_retry" and e["engine"] == "b", 30, since)
    assert retry["attempt"] == 1
    sup.wait_all_ready(120)
    assert engine(sup, "b")["fatal_retries"] == 0
    assert 'understudy_fatal_retries_total{engine="b"} 1.0' in sup.metrics()
