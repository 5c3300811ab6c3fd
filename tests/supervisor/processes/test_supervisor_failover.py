"""The whole flow with real processes (one supervisor for the module, CPU, tiny model): daemons,
primary + standby engines, failover on crash and hang, daemon restart, admin operations under load,
auth, systemd notify, graceful stop. Tests run in file order and each leaves the node healthy."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from harness import ROOT

from harness.load import Load

from harness.node import Harness

CONFIG = """
runtime_dir: {rt}
model: {{path: {model}}}
engines: {{heartbeat_interval_s: 0.1, kv_cache_bytes: 4194304, max_num_seqs: 8, max_model_len: 128}}
failover: {{heartbeat_timeout_s: 1.5, probe_interval_s: 0.5, probe_timeout_s: 5, hold_timeout_s: 20,
           backoff_base_s: 0.1, backoff_max_s: 1, flap_max: 50, drain_timeout_s: 10, stop_timeout_s: 5}}
router: {{port: 0}}
admin: {{port: 0}}
"""


@pytest.fixture(scope="module")
def sup(tmp_path_factory, tiny_model):
    work = tmp_path_factory.mktemp("sup")
    model = work / "model"
    shutil.copytree(tiny_model, model)  # a private copy: one test rewrites it
    h = Harness(work, CONFIG.format(rt=work / "rt", model=model), env={"WATCHDOG_USEC": "400000"})
    h.model_dir = model
    try:
        h.wait_booted()
        h.wait_all_ready(120)
        yield h
    finally:
        rc = h.stop()
        h.exit_code = rc


def test_boot_two_engines_share_the_daemon_and_systemd_is_told(sup):
    st = sup.wait_all_ready()
    roles = sorted(e["role"] for e in st["engines"])
    assert roles == ["primary", "standby"] and st["epoch"] >= 1
    for e in st["engines"]:
        assert e["weights_source"] == "cache_hit", e
        assert e["pid"] and psutil.pid_exists(e["pid"]) and os.getpgid(e["pid"]) == e["pid"]
        assert set(e["startup_phases"]) >= {"weights", "server_ready"}
    (d,) = st["daemons"]
    assert d["state"] == "READY" and d["resident_bytes"] > 0 and d["fingerprint"]["content_digest"]
    ready = [m for m in sup.notify_msgs if "READY=1" in m.split("\n")]
    assert len(ready) == 1 and "STATUS=epoch 1: " in ready[0]
    n = sup.notify_msgs.count("WATCHDOG=1")
    time.sleep(0.5)
    assert sup.notify_msgs.count("WATCHDOG=1") >= n + 1  # every WATCHDOG_USEC / 2 from the main loop
    # what systemd last read as STATUS (a line of its own datagram, or of READY=1's)
    status = [line for m in sup.notify_msgs for line in m.split("\n") if line.startswith("STATUS=")]
    assert status and "primary/READY" in status[-1] and "standby/READY" in status[-1]
    m = sup.metrics()
    assert 'understudy_weight_cache_requests_total{reason="",result="hit"} 2.0' in m
    assert "understudy_active_engines 1.0" in m and "understudy_standby_ready 1.0" in m
    assert 'understudy_daemon_resident_bytes{rank="0"}' in m
    assert f"understudy: ready: serving model on {sup.router_url}/v1" in sup.log.read_text()  # where to send
    rt = sup.rd
    assert rt.stat().st_mode & 0o777 == 0o700
    for name in ("admin.token", "state.json", "daemon-rank0.sock", "events.sock", "control.sock"):
        assert (rt / name).stat().st_mode & 0o077 == 0, name


def test_admin_needs_the_token_and_reports_bad_requests(sup):
    for path in ("/status", "/metrics"):
        r = sup.admin("GET", path, token=None)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert sup.admin("POST", "/admin/promote", token="wrong").status_code == 401
    r = sup.admin("POST", "/admin/engines/zzz/restart")
    assert r.status_code == 404 and "unknown engine 'zzz'" in r.json()["error"]
    r = sup.admin("POST", "/admin/engines/" + "x" * 10_000 + "/restart")  # issue 23: not echoed whole
    assert r.status_code == 404 and r.json()["error"].startswith("unknown engine 'xxx") and len(r.text) < 300, r.text[:500]
    assert "(10000 characters)" in r.json()["error"]
    for body, said in (({"force": "yes"}, "body.force: Input should be a valid boolean"),
                       ({"force": True, "now": 1}, "body.now: Extra inputs are not permitted")):
        r = httpx.post(sup.admin_url + "/admin/engines/zzz/restart", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {sup.token}"})  # (force in a JSON body: read, not ignored)
        assert r.status_code == 400 and said in r.json()["error"], r.text


def test_a_second_supervisor_on_the_same_runtime_dir_is_refused(sup):
    r = subprocess.run([sys.executable, "-m", "supervisor", "serve", "-c", str(sup.config)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert f"runtime_dir {sup.rd} is in use by a running supervisor (pid {sup.proc.pid})" in r.stderr
    assert sup.status()["primary"]  # the running one is untouched


def test_data_plane_passes_streams_and_engine_errors(sup):
    url = sup.router_url
    assert httpx.get(url + "/healthz").status_code == 200
    assert httpx.get(url + "/readyz").json()["ready"] is True
    bad = httpx.post(url + "/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert 400 <= bad.status_code < 500
    r = httpx.post(url + "/v1/completions", json={"model": "model", "prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400
    with httpx.stream("POST", url + "/v1/completions", timeout=30,
                      json={"model": "model", "prompt": "hi", "max_tokens": 5, "stream": True}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        body = "".join(s.iter_text())
    assert body.rstrip().endswith("data: [DONE]") and body.count("data:") >= 2
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "model"


def _kill_and_wait_failover(sup, sig: int, reason: str):
    st = sup.wait_all_ready()
    old, new = sup.primary(), sup.standby()
    mark = len(sup.events)
    with Load(sup.router_url, "model", threads=2) as load:
        time.sleep(0.5)
        t_kill = time.monotonic()
        os.kill(old["pid"], sig)
        ev = sup.wait_event(lambda e: e["type"] == "failover", since=mark, timeout_s=30)
        deadline = time.monotonic() + 30
        while load.first_success_from(new["name"], t_kill) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    assert ev["reason"] == reason and ev["from"] == old["name"] and ev["to"] == new["name"]
    assert ev["epoch"] == st["epoch"] + 1
    assert load.failures == [], load.failures[:5]
    assert load.first_success_from(new["name"], t_kill) is not None
    return old, new, mark


def test_kill_9_primary_standby_promoted_and_dead_one_returns_as_standby_with_cache_hit(sup):
    old, new, mark = _kill_and_wait_failover(sup, signal.SIGKILL, "exit")
    rec = sup.wait_event(lambda e: e["type"] == "recovered" and e["engine"] == old["name"], since=mark, timeout_s=60)
    assert rec["weights_source"] == "cache_hit"
    st = sup.wait_all_ready()
    eng = {e["name"]: e for e in st["engines"]}
    assert eng[new["name"]]["role"] == "primary"
    back = eng[old["name"]]
    assert back["role"] == "standby" and back["incarnation"] == old["incarnation"] + 1
    assert back["weights_source"] == "cache_hit" and back["last_exit"] == "killed by SIGKILL"
    assert st["recent_failovers"][-1]["to"] == new["name"]
    m = sup.metrics()
    assert 'understudy_failovers_total{reason="exit"} 1.0' in m
    assert "understudy_failover_seconds_count 1.0" in m and "understudy_recovery_seconds_count 1.0" in m
    young = re.search(r'understudy_supervisor_gc_pause_seconds_count\{generation="0"\} (\S+)', m)
    assert young and float(young[1]) > 0  # the supervisor's own collections are observed (~46 in this test)


def test_kill_standby_is_replaced_and_primary_traffic_untouched(sup):
    st = sup.wait_all_ready()
    prim, sb = sup.primary(), sup.standby()
    mark = len(sup.events)
    with Load(sup.router_url, "model", threads=2) as load:
        time.sleep(0.3)
        os.kill(sb["pid"], signal.SIGKILL)
        sup.wait_event(lambda e: e["type"] == "recovered" and e["engine"] == sb["name"], since=mark, timeout_s=60)
    assert load.failures == []
    assert {r[3] for r in load.results} == {prim["name"]}
    st2 = sup.wait_all_ready()
    assert st2["epoch"] == st["epoch"] and st2["primary"] == prim["name"]
    assert not any(e["type"] == "failover" for e in sup.events[mark:])


def test_both_engines_killed_requests_wait_for_the_first_replacement(sup):
    st = sup.wait_all_ready()
    prim, sb = sup.primary(), sup.standby()
    mark = len(sup.events)
    with Load(sup.router_url, "model", threads=2) as load:
        time.sleep(0.3)
        # The standby first, and the primary once the supervisor knows the standby is gone (its
        # replacement is seconds away): were the standby promoted and sent requests before its own
        # death, a request in flight at both deaths would rightly be quarantined.
        os.kill(sb["pid"], signal.SIGKILL)
        sup.wait_event(lambda e: e["type"] == "transition" and e["engine"] == sb["name"] and e["from"] == "READY",
                       since=mark, timeout_s=30)
        os.kill(prim["pid"], signal.SIGKILL)
        ev = sup.wait_event(lambda e: e["type"] == "failover" and e["seconds"] > 0.05, since=mark, timeout_s=60)
        time.sleep(0.3)
    assert load.failures == [], load.failures[:5]  # held, then served by the first engine back
    assert ev["epoch"] > st["epoch"]
    assert "understudy_router_hold_seconds_count" in sup.metrics()
    sup.wait_all_ready()


def on_the_daemons_pool(sup, old_pool: str | None = None) -> dict:
    """The status once every engine is READY on the (restarted) daemon's KV pool, not `old_pool`."""
    return sup.wait_for(lambda s: s["daemons"][0]["kv_pool_id"] not in (None, old_pool)
                        and all(e["state"] == "READY" and e["kv_pool_id"] == s["daemons"][0]["kv_pool_id"]
                                for e in s["engines"]), 90, "both engines on the daemon's pool")


def test_kill_daemon_engines_keep_serving_and_the_node_moves_onto_the_new_daemons_pool(sup):
    """The engines serve on while the daemon is away; the restarted daemon holds a new KV pool (and
    arena), which the engines started before do not map (an operator's review: the next failover then
    recomputed every stream, ~237 tokens each, and nothing said so; on a GPU the old pool stays held
    too). The supervisor heals: the standby restarts onto the new pool, the primary hands over to it and
    restarts too; no request fails. (Without the pool check in supervisor/core/healing.py the engines stay
    on the old pool and this fails.)"""
    st = sup.wait_all_ready()
    d = st["daemons"][0]
    assert {e["kv_pool_id"] for e in st["engines"]} == {d["kv_pool_id"]} and d["kv_pool_id"]
    mark = len(sup.events)
    with Load(sup.router_url, "model", threads=2) as load:
        time.sleep(0.3)
        os.kill(d["pid"], signal.SIGKILL)
        sup.wait_event(lambda e: e["engine"] == "daemon-rank0" and e["to"] == "READY", since=mark, timeout_s=60)
        st2 = on_the_daemons_pool(sup, d["kv_pool_id"])
        time.sleep(0.3)
    assert load.failures == [] and len(load.results) > 2, load.failures[:3]
    assert st2["daemons"][0]["pid"] != d["pid"] and st2["daemons"][0]["resident_bytes"] == d["resident_bytes"]
    assert not any(e["kv_pool_stale"] for e in st2["engines"])
    healed = [e["engine"] for e in sup.events[mark:] if e["type"] == "healing"]
    assert sorted(healed) == sorted(e["name"] for e in st["engines"]), healed  # each once: standby, then primary
    assert st2["primary"] != st["primary"] and all(f["reason"] == "promote" for f in sup.events[mark:]
                                                   if f["type"] == "failover")


def test_spawn_server_death_is_survived_and_it_is_replaced(sup):
    st = sup.wait_all_ready()
    old_spawn = st["spawn_server"]["pid"]
    os.kill(old_spawn, signal.SIGKILL)
    st = sup.wait_for(lambda s: s["spawn_server"] and s["spawn_server"]["pid"] != old_spawn, 60, "new spawn server")
    assert all(e["state"] == "READY" for e in st["engines"])  # engines it forked live on
    sb = sup.standby()
    mark = len(sup.events)
    os.kill(sb["pid"], signal.SIGKILL)  # the replacement comes from the new spawn server
    sup.wait_event(lambda e: e["type"] == "recovered" and e["engine"] == sb["name"], since=mark, timeout_s=60)
    st = sup.wait_all_ready()
    assert {e["name"]: e for e in st["engines"]}[sb["name"]]["last_exit"] == "killed by SIGKILL"


def test_sigstop_daemon_is_detected_and_replaced_while_engines_serve(sup):
    st = sup.wait_all_ready()
    d = st["daemons"][0]
    mark = len(sup.events)
    with Load(sup.router_url, "model", threads=1) as load:
        os.kill(d["pid"], signal.SIGSTOP)
        ev = sup.wait_event(lambda e: e["engine"] == "daemon-rank0" and e["to"] == "FAILED", since=mark, timeout_s=30)
        sup.wait_event(lambda e: e["engine"] == "daemon-rank0" and e["to"] == "READY", since=mark, timeout_s=60)
    assert ev["reason"].startswith("hang: 3 status requests unanswered")
    assert load.failures == [] and len(load.results) > 2
    st2 = on_the_daemons_pool(sup)
    assert st2["daemons"][0]["pid"] != d["pid"]
    assert all(f["reason"] == "promote" for f in sup.events[mark:] if f["type"] == "failover")  # (healing's only)


def test_a_standby_that_came_up_while_the_daemon_hung_is_healed_onto_its_weights_and_pool(sup):
    """Issue 52 (B), real processes: the daemon SIGSTOPped (fenced after its unanswered pings, then
    restarted) and the standby SIGKILLed at once, so that its replacement starts while the daemon is
    away: it comes up degraded (weights from disk, a KV cache of its own). Once the daemon is READY
    again the supervisor replaces it with a standby on the daemon's weights and pool, within 30 s of
    the hang, and no request of the light load beside fails. (Without supervisor/core/healing.py the
    degraded standby stays as it is and this fails.)"""
    st = sup.wait_all_ready()
    d, standby = st["daemons"][0], sup.standby()
    assert standby["weights_source"] == "cache_hit" and standby["kv_source"] == "shared", standby
    mark = len(sup.events)
    with Load(sup.router_url, "model", threads=2, stream=True) as load:
        time.sleep(0.3)
        t0 = time.monotonic()
        os.kill(d["pid"], signal.SIGSTOP)
        os.kill(standby["pid"], signal.SIGKILL)
        sup.wait_event(lambda e: e["engine"] == "daemon-rank0" and e["to"] == "READY", since=mark, timeout_s=60)
        t_daemon = time.monotonic()
        heal = sup.wait_event(lambda e: e["type"] == "healing", since=mark, timeout_s=60)
        back = sup.wait_for(lambda s: any(e["name"] == standby["name"] and e["state"] == "READY"
                                          and e["weights_source"] == "cache_hit" and e["kv_source"] == "shared"
                                          for e in s["engines"]), 60, "the standby back on the daemon")
        t_back = time.monotonic()
        time.sleep(0.5)
    assert heal["engine"] == standby["name"] and heal["degraded"].startswith(("weights disk:", "KV own")), heal
    assert not [f for f in sup.events[mark:] if f["type"] == "failover" and f["reason"] != "promote"]  # (the
    # primary, on the daemon's pool of before its restart, may hand over by then: supervisor/core/healing.py)
    assert load.failures == [] and len(load.results) > 5, load.failures[:5]
    assert t_back - t0 < 30, (t_daemon - t0, t_back - t0)
    print(f"\nself-heal: daemon READY {t_daemon - t0:.2f} s after its SIGSTOP; standby back on its weights and pool "
          f"{t_back - t0:.2f} s after it ({t_back - t_daemon:.2f} s after the daemon); degraded: {heal['degraded']}; "
          f"{len(load.results)} requests, {len(load.failures)} failed")


def test_sigstop_primary_is_detected_by_heartbeat_and_failed_over(sup):
    old, new, mark = _kill_and_wait_failover(sup, signal.SIGSTOP, "hang")
    st = sup.wait_all_ready()
    back = {e["name"]: e for e in st["engines"]}[old["name"]]
    assert back["role"] == "standby" and back["weights_source"] == "cache_hit"
    assert not psutil.pid_exists(old["pid"]) or psutil.Process(old["pid"]).status() == psutil.STATUS_ZOMBIE


def test_admin_operations_under_load_fail_no_request(sup):
    sup.wait_all_ready()
    streams = Load(sup.router_url, "model", threads=1, stream=True, max_tokens=8)
    with Load(sup.router_url, "model", threads=2) as load, streams:
        # promote: planned switchover
        before = sup.status()
        r = sup.admin("POST", "/admin/promote")
        assert r.status_code == 200, r.text
        assert r.json()["primary"] != before["primary"] and r.json()["epoch"] == before["epoch"] + 1
        # the old primary hands its requests off (shared KV) and drains, coming back as standby: a second
        # promote meanwhile finds the switch under way, or no READY standby once it is done
        r2 = sup.admin("POST", "/admin/promote")
        err = r2.json()["error"]
        assert r2.status_code == 409 and ("no READY standby" in err or "already under way" in err), err
        sup.wait_all_ready()
        # drain / undrain
        assert sup.admin("POST", "/admin/drain").json() == {"drained": True}
        rz = httpx.get(sup.router_url + "/readyz")
        assert rz.status_code == 503 and rz.json()["reason"] == "node is drained"
        assert sup.admin("POST", "/admin/undrain").json() == {"drained": False}
        assert httpx.get(sup.router_url + "/readyz").status_code == 200
        # restart the standby, then the primary (switchover first)
        sb = sup.standby()
        assert sup.admin("POST", f"/admin/engines/{sb['name']}/restart").status_code == 200
        st = sup.wait_all_ready()
        assert {e["name"]: e for e in st["engines"]}[sb["name"]]["incarnation"] == sb["incarnation"] + 1
        prim = sup.primary()
        r = sup.admin("POST", f"/admin/engines/{prim['name']}/restart")
        assert r.status_code == 200 and r.json()["primary"] != prim["name"]
        sup.wait_all_ready()
        # rollout: every engine restarted in turn
        incs = {e["name"]: e["incarnation"] for e in sup.status()["engines"]}
        r = sup.admin("POST", "/admin/rollout", timeout=300)
        assert r.status_code == 200, r.text
        assert sorted(r.json()["restarted"]) == sorted(incs)
        st = sup.wait_all_ready()
        assert all(e["incarnation"] > incs[e["name"]] for e in st["engines"])
        time.sleep(0.3)
    assert load.failures == [], load.failures[:5]
    assert streams.failures == [], streams.failures[:5]  # planned operations never cut a stream
    assert len({r[3] for r in load.results}) == 2 and len(streams.results) > 5


def test_rollout_racing_a_kill_is_not_a_failure_of_the_engine(sup):
    """An engine restart while the rollout replaces the spawn server waits for the new server (or
    starts directly) instead of failing with 'NoneType has no attribute spawn' and counting toward FATAL."""
    import threading
    sup.wait_all_ready()
    result = {}
    t = threading.Thread(target=lambda: result.update(r=sup.admin("POST", "/admin/rollout", timeout=300)))
    t.start()
    sup.wait_for(lambda s: s["spawn_server"] is None, 30, "the spawn server being replaced")
    victim = sup.standby()
    failures_before = sup.engines()[victim["name"]]["recent_failures"]  # (earlier tests' kills may be in the window)
    mark = len(sup.events)
    os.kill(victim["pid"], signal.SIGKILL)
    t.join(300)
    assert result["r"].status_code == 200, result["r"].text
    sup.wait_all_ready(120)
    reasons = [e.get("reason", "") for e in sup.events[mark:] if e.get("engine") == victim["name"]]
    assert not any("start failed" in r for r in reasons), reasons
    seen = [(e.get("type"), e.get("state"), e.get("reason", "")) for e in sup.events[mark:]
            if e.get("engine") == victim["name"]]
    assert sup.engines()[victim["name"]]["recent_failures"] <= failures_before + 1, seen  # the kill itself, nothing more


def test_cli_talks_to_the_admin_api(sup):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "supervisor", *args, "-c", str(sup.config)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    r = cli("status", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["primary"] in ("a", "b")
    r = cli("status")
    assert r.returncode == 0 and "ENGINE" in r.stdout and "daemon-rank0" in r.stdout
    r = cli("restart", "nope")
    assert r.returncode == 1 and "HTTP 404" in r.stderr and "unknown engine 'nope'" in r.stderr
    assert cli("drain").returncode == 0 and sup.status()["drained"]
    assert cli("undrain").returncode == 0 and not sup.status()["drained"]
    r = cli("token", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == {"admin_url": sup.admin_url, "token": sup.token}, r.stdout


def test_cli_output_to_a_reader_that_left_ends_quietly(sup):
    """Issue 23: `understudy status | head -1` ended in a BrokenPipeError traceback. Here the reader
    is gone before anything is written (every write fails): exit 141, as a writer ended by SIGPIPE,
    and nothing on stderr; then the literal pipeline, with whatever timing it gets."""
    argv = [sys.executable, "-m", "supervisor"]
    for args in (("status",), ("status", "--json"), ("token", "--json")):
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            r = subprocess.run([*argv, *args, "-c", str(sup.config)], cwd=ROOT, stdout=write_end,
                               stderr=subprocess.PIPE, text=True, timeout=120)
        finally:
            os.close(write_end)
        assert r.returncode == 141 and r.stderr == "", (args, r.returncode, r.stderr)
    r = subprocess.run(f"{shlex.join(argv)} status --json -c {shlex.quote(str(sup.config))} | head -1", shell=True,
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.stdout == "{\n" and r.stderr == "", r.stderr


def test_changed_checkpoint_is_a_miss_with_reason_and_never_promoted(sup, make_tiny):
    sup.wait_all_ready()
    prim, sb = sup.primary(), sup.standby()
    other = make_tiny(seed=7)
    saved = sup.model_dir.with_name("saved-model")
    shutil.copytree(sup.model_dir, saved)
    shutil.copy(other / "model.safetensors", sup.model_dir / "model.safetensors")
    mark = len(sup.events)
    try:
        assert sup.admin("POST", f"/admin/engines/{sb['name']}/restart").status_code == 200
        ev = sup.wait_event(lambda e: e["type"] == "canary_mismatch", since=mark, timeout_s=60)
        assert ev["engine"] == sb["name"] and ev["weights_source"] == "disk:mismatch"
        assert ev["reason"].startswith("canary mismatch: expected ")
        st = sup.status()
        eng = {e["name"]: e for e in st["engines"]}
        assert eng[sb["name"]]["role"] == "standby" and st["primary"] == prim["name"]
        m = sup.metrics()
        miss = [ln for ln in m.splitlines() if ln.startswith("understudy_weight_cache_requests_total")
                and 'result="miss"' in ln]
        # (the self-healing test before this one left a protocol_error miss; >= 1: its restart may have
        # missed again by now)
        mismatch = [ln for ln in miss if ln.startswith('understudy_weight_cache_requests_total{reason="mismatch"')]
        assert len(mismatch) == 1 and float(mismatch[0].rsplit(" ", 1)[1]) >= 1.0, miss
        assert httpx.post(sup.router_url + "/v1/completions", timeout=30,
                          json={"model": "model", "prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        shutil.copy(saved / "model.safetensors", sup.model_dir / "model.safetensors")
    sup.admin("POST", f"/admin/engines/{sb['name']}/restart")
    st = sup.wait_all_ready(60)
    assert {e["name"]: e for e in st["engines"]}[sb["name"]]["weights_source"] == "cache_hit"


def test_sigterm_drains_and_stops_everything(sup):
    st = sup.wait_all_ready()
    pids = [e["pid"] for e in st["engines"]] + [d["pid"] for d in st["daemons"]]
    rc = sup.stop()
    assert rc == 0, sup.tail()
    assert any(m.startswith("STOPPING=1") for m in sup.notify_msgs)
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert "stopped" in sup.tail()
