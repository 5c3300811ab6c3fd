"""Tensor parallel (2 ranks, gloo on CPU): one daemon per rank, and an engine dies whole when any of
its ranks dies (the supervisor fences the group and fails over)."""
from __future__ import annotations

import os
import re
import signal

import psutil
import pytest

from harness.load import Load

from harness.node import Harness


@pytest.fixture(scope="module")
def sup(tmp_path_factory, tiny_model):
    work = tmp_path_factory.mktemp("tp")
    h = Harness(work, f"runtime_dir: {work / 'rt'}\nmodel: {{path: {tiny_model}, tp_size: 2}}\n"
                      "engines: {heartbeat_interval_s: 0.1, kv_cache_bytes: 4194304, max_model_len: 128}\n"
                      "failover: {heartbeat_timeout_s: 2, backoff_base_s: 0.1, hold_timeout_s: 20}\n"
                      "router: {port: 0}\nadmin: {port: 0}\n", notify=False)
    try:
        h.wait_booted()
        h.wait_all_ready(120)
        yield h
    finally:
        assert h.stop() == 0, h.tail()


def test_one_daemon_per_rank_and_cache_hits(sup):
    st = sup.wait_all_ready()
    assert [d["rank"] for d in st["daemons"]] == [0, 1] and all(d["resident_bytes"] > 0 for d in st["daemons"])
    assert all(e["weights_source"] == "cache_hit" for e in st["engines"])


def test_killing_a_worker_rank_fails_the_whole_engine_over(sup):
    old, new = sup.primary(), sup.standby()
    group = [p.pid for p in psutil.process_iter() if _pgid(p.pid) == old["pid"]]
    workers = [p for p in group if p != old["pid"]]
    assert workers, f"expected rank 1 in group {old['pid']}: {group}"
    mark = len(sup.events)
    with Load(sup.router_url, sup.status()["model"]["name"], threads=2) as load:
        sup.wait_for(lambda _: load.first_success_from(old["name"], 0.0) is not None, 30,
                     f"a request served by {old['name']} before the kill")
        os.kill(workers[0], signal.SIGKILL)
        ev = sup.wait_event(lambda e: e["type"] == "failover", since=mark, timeout_s=30)
        sup.wait_event(lambda e: e["type"] == "recovered" and e["engine"] == old["name"], since=mark, timeout_s=60)
    assert ev["from"] == old["name"] and ev["to"] == new["name"]
    assert load.failures == [], load.failures[:5]
    assert {r[3] for r in load.results} == {old["name"], new["name"]}
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in group)
    st = sup.wait_all_ready()
    assert {e["name"]: e for e in st["engines"]}[old["name"]]["weights_source"] == "cache_hit"


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_sigterm_stops_a_tp_node_without_any_rank_waiting_out_a_timeout(sup):
    """Every rank leaves its group together (NCCL's destroy is collective): no rank waits out a
    timeout (31.6 s on two H200s before), which each would log, and no engine is SIGKILLed for
    outstaying its drain: each drains and stops on request."""
    sup.wait_all_ready()
    assert sup.stop() == 0, sup.tail()
    logs = "".join(p.read_text(errors="replace") for p in (sup.rd / "logs").glob("*.log"))
    assert "teardown did not finish" not in logs and "did not exit" not in logs
    text = sup.log.read_text()
    stopping = text[text.index("received SIGTERM"):]
    assert "still draining after" not in stopping and "still alive" not in stopping, sup.tail()
    for name in ("a", "b"):
        assert re.search(rf"{name} \((primary|standby)\): DRAINING -> STOPPED: stopped on request", stopping), \
            sup.tail()
    assert "still draining" not in sup.tail(200)
