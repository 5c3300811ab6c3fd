"""A second engine death with requests queued (issue 23): the primary is SIGKILLed with more long
streams in flight than it runs at once (max_num_seqs), then the promoted engine too, once every
stream has reached it: the requests it only queued did not run on it and must be continued on the
third engine (the first one's replacement), not quarantined as engine killers. Those that ran on
both (the engine's scheduled marker, wire/sse.py) with no token in between are continued too (issue
52, item 4): both engines were SIGKILLed from outside, which their exit statuses say, and no request
causes that; a request whose engines crash is still quarantined (tests/supervisor/router/test_migration_router.py).
The node serves on. Real supervisor, engines, sockets and signals (CPU, tiny model, fp32)."""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable

import httpx
import pytest

from harness.node import running
from wire import node_secret
from tests.supervisor.router.test_migration_failover import Stream, check_same, migrations

SEQS, STREAMS = 2, 6
CONFIG = f"""
runtime_dir: {{rt}}
model: {{{{path: {{model}}, name: m}}}}
engines: {{{{heartbeat_interval_s: 0.1, kv_cache_bytes: 4194304, max_num_seqs: {SEQS}, max_model_len: 1024}}}}
failover: {{{{heartbeat_timeout_s: 1.5, probe_interval_s: 0.5, probe_timeout_s: 5, hold_timeout_s: 60,
           backoff_base_s: 0.1, backoff_max_s: 1, flap_max: 50, drain_timeout_s: 10, stop_timeout_s: 5}}}}
router: {{{{port: 0}}}}
admin: {{{{port: 0}}}}
"""
LONG = {"model": "m", "prompt": "Once upon a time", "max_tokens": 900, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def sup(tmp_path_factory, tiny_model):
    work = tmp_path_factory.mktemp("second-death")
    with running(work, CONFIG.format(rt=work / "rt", model=tiny_model)) as h:
        yield h


def wait_health(sup, url: str, pred: Callable[[dict[str, Any]], bool], what: str, timeout_s: float = 60) -> dict:
    """Poll an engine's /health (its core's figures as of its last step) until `pred` holds (with the
    node secret: the engine answers nobody else)."""
    deadline, last = time.monotonic() + timeout_s, None
    secret = node_secret.headers(sup.rd)
    while time.monotonic() < deadline:
        try:
            last = httpx.get(url + "/health", headers=secret, timeout=5).json()
        except httpx.HTTPError:
            last = None
        if last is not None and pred(last):
            return last
        time.sleep(0.002)
    raise TimeoutError(f"{url}: {what}; last /health {last}")


def test_requests_only_queued_on_the_second_dead_engine_are_continued_not_quarantined(sup):
    sup.wait_all_ready()
    ref = Stream(sup.router_url, "/v1/completions", LONG).result(120)
    first, second = sup.primary(), sup.standby()
    mark = len(sup.events)
    streams = [Stream(sup.router_url, "/v1/completions", LONG) for _ in range(STREAMS)]
    # Every stream still in flight is on the engine, SEQS of them running and the others only queued.
    # (Under load the first streams may end before the last arrive: the count is of those in flight.)
    queued = lambda h: (h["running"] == SEQS and h["waiting"] >= 1  # noqa: E731
                        and h["running"] + h["waiting"] == sum(s.in_flight for s in streams))
    wait_health(sup, first["url"], queued, f"{SEQS} running and the rest waiting on {first['name']}")
    os.killpg(first["pid"], signal.SIGKILL)
    sup.wait_event(lambda e: e["type"] == "failover" and e["to"] == second["name"], since=mark)
    wait_health(sup, second["url"], queued, f"every stream in flight on {second['name']}, {SEQS} of them running")
    os.killpg(second["pid"], signal.SIGKILL)
    for s in streams:
        s.result(120)
    failed = [s for s in streams if not s.done]
    assert not failed, [s.chunks[-1:] for s in failed]  # (those that ran on both too: killed from outside)
    for s in streams:
        check_same(s, ref)
    results = [e["result"] for e in migrations(sup, mark)]
    assert "quarantined" not in results and "failed" not in results, results
    assert "Exception in ASGI application" not in sup.log.read_text()
    r = httpx.post(sup.router_url + "/v1/completions", json={**LONG, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text


def test_two_sigkills_a_tenth_of_a_second_apart_fail_no_request(sup):
    """Issue 52's case: 32 streams in flight, the primary SIGKILLed and the engine promoted for it 0.11 s
    later (its promotion and the continuations' admission under way, or just done): every stream is
    continued on the replacements with the uninterrupted text; none is failed or quarantined."""
    sup.wait_all_ready()
    body = LONG  # (long enough that all 32 are in flight before the first ends)
    ref = Stream(sup.router_url, "/v1/completions", body).result(120)
    first, second = sup.primary(), sup.standby()
    mark = len(sup.events)
    streams = [Stream(sup.router_url, "/v1/completions", body) for _ in range(32)]
    busy = lambda h: h["running"] == SEQS and sum(s.in_flight for s in streams) == 32  # noqa: E731
    wait_health(sup, first["url"], busy, f"the 32 streams in flight, {first['name']} running {SEQS}")
    os.killpg(first["pid"], signal.SIGKILL)
    time.sleep(0.11)
    os.killpg(second["pid"], signal.SIGKILL)
    for s in streams:
        s.result(120)
    for s in streams:
        check_same(s, ref)
    results = [e["result"] for e in migrations(sup, mark)]
    assert "quarantined" not in results and "failed" not in results, results
