"""External engines (command template + URL, no weight sharing) judged ready by the same canary;
crash loops back off: extra slots go FATAL until an admin restart, the last engine standing is
retried forever and serves once the cause is gone; a node stuck without progress stops feeding the
watchdog; a mismatching canary is never promoted; an engine boot error before anything served halts
the supervisor instead of looping; admin/router hygiene (bearer case, error shapes, headers, drain)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from harness import ROOT

from harness.load import Load

from harness.node import Harness

EXT_ENGINE = textwrap.dedent('''
    """A stand-in for vLLM/SGLang: an OpenAI-style server we did not write the weights path of."""
    import sys
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    import os
    port, name, vary = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "vary"
    sick_flag = sys.argv[4] if len(sys.argv) > 4 else None
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if sick_flag and os.path.exists(f"{sick_flag}-{name}"):  # alive, /health fine, answers wrong
            return JSONResponse({"error": "internal"}, status_code=500)
        text = f" ext-{name}" if vary else " ext-ok"
        return {"choices": [{"text": text, "index": 0}], "model": body.get("model")}

    @app.get("/health")
    async def health():
        return {}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
''')

BASE = """
runtime_dir: {rt}
model: {{name: ext-model}}
engines:
  kind: external
  count: {count}
  external: {{command: "{command}", url: "http://127.0.0.1:{{port}}"}}
failover: {{probe_interval_s: 0.3, probe_timeout_s: 2, hold_timeout_s: {hold}, backoff_base_s: 0.05,
           backoff_max_s: 0.2, flap_max: {flap}, flap_window_s: 60, drain_timeout_s: 5, stop_timeout_s: 3{extra}}}
router: {{port: 0}}
admin: {{port: 0}}
"""


def harness(tmp, command: str, count: int = 2, flap: int = 50, hold: float = 10, extra: str = "",
            env: dict[str, str] | None = None) -> Harness:
    return Harness(tmp, BASE.format(rt=tmp / "rt", command=command, count=count, flap=flap, hold=hold, extra=extra),
                   env=env)


CRASHY = textwrap.dedent('''
    """Exits 5 while FLAG exists (a broken install, a missing file), else becomes the engine script."""
    import os, sys
    flag, script = sys.argv[1], sys.argv[2]
    if os.path.exists(flag):
        print("crashy: cannot start: " + flag + " is present", file=sys.stderr)
        sys.exit(5)
    os.execv(sys.executable, [sys.executable, script, *sys.argv[3:]])
''')


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    p = tmp_path_factory.mktemp("ext") / "ext_engine.py"
    p.write_text(EXT_ENGINE)
    return p


def test_external_engines_serve_and_fail_over(tmp_path, script):
    h = harness(tmp_path, f"{sys.executable} {script} {{port}} {{name}} same")
    try:
        h.wait_booted()
        st = h.wait_all_ready(60)
        assert st["daemons"] == [] and all(e["weights_source"] is None for e in st["engines"])
        r = httpx.post(h.router_url + "/v1/completions", json={"model": "ext-model", "prompt": "x"})
        assert r.json()["choices"][0]["text"] == " ext-ok"
        old, new = h.primary(), h.standby()
        mark = len(h.events)
        with Load(h.router_url, "ext-model", threads=2) as load:
            time.sleep(0.3)
            os.kill(old["pid"], signal.SIGKILL)
            ev = h.wait_event(lambda e: e["type"] == "failover", since=mark)
            h.wait_event(lambda e: e["type"] == "recovered" and e["engine"] == old["name"], since=mark)
            time.sleep(0.2)
        assert ev["to"] == new["name"] and ev["reason"] == "exit"
        assert load.failures == []
    finally:
        assert h.stop() == 0, h.tail()


def test_failing_probes_of_a_live_primary_cause_a_failover(tmp_path, script):
    flag = tmp_path / "sick"
    h = harness(tmp_path, f"{sys.executable} {script} {{port}} {{name}} same {flag}")
    try:
        h.wait_booted()
        h.wait_all_ready(60)
        old, new = h.primary(), h.standby()
        mark = len(h.events)
        (tmp_path / f"sick-{old['name']}").touch()  # its process and /health stay fine
        ev = h.wait_event(lambda e: e["type"] == "failover", since=mark, timeout_s=30)
        assert ev["reason"] == "probe" and ev["from"] == old["name"] and ev["to"] == new["name"]
        (tmp_path / f"sick-{old['name']}").unlink()
        h.wait_event(lambda e: e["type"] == "recovered" and e["engine"] == old["name"], since=mark)
        st = h.wait_all_ready(30)
        back = {e["name"]: e for e in st["engines"]}[old["name"]]
        assert back["role"] == "standby" and back["last_exit"] == "killed by SIGKILL"
        r = httpx.post(h.router_url + "/v1/completions", json={"model": "ext-model", "prompt": "x"})
        assert r.status_code == 200 and r.headers["x-understudy-engine"] == new["name"]
    finally:
        assert h.stop() == 0, h.tail()


def test_crash_loop_backs_off_forever_for_the_last_engine_then_recovers(tmp_path, script):
    """Both engines crash at start: one goes FATAL, the last one standing is retried with capped
    backoff (never FATAL), /readyz and `understudy status` say why, the watchdog stays fed (retries
    are progress); once the cause is gone it serves, and an admin restart brings the FATAL one back."""
    flag = tmp_path / "broken"
    flag.touch()
    crashy = tmp_path / "crashy.py"
    crashy.write_text(CRASHY)
    h = harness(tmp_path, f"{sys.executable} {crashy} {flag} {script} {{port}} {{name}} same", flap=2, hold=0.5,
                env={"WATCHDOG_USEC": "200000"})
    try:
        h.wait_booted()
        st = h.wait_for(lambda s: any(e["state"] == "FATAL" for e in s["engines"]), 30, "a FATAL slot")
        fatal = next(e["name"] for e in st["engines"] if e["state"] == "FATAL")  # (status: its event may precede
        # the harness's subscription, which begins once state.json exists)
        last = next(n for n in ("a", "b") if n != fatal)
        exits = lambda: sum(e.get("engine") == last and e.get("to") == "EXITED" for e in h.events)
        deadline = time.monotonic() + 30
        while exits() < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert exits() >= 5, h.tail()
        assert not any(e.get("engine") == last and e.get("to") == "FATAL" for e in h.events)
        st = h.status()
        eng = {e["name"]: e for e in st["engines"]}
        assert eng[fatal]["state"] == "FATAL" and eng[last]["crash_loop"] and st["primary"] is None
        reason = ""
        for _ in range(100):  # /readyz may catch the slot mid-spawn; the crash loop shows between spawns
            rz = httpx.get(h.router_url + "/readyz")
            assert rz.status_code == 503
            reason = rz.json()["reason"]
            if "crash loop" in reason:
                break
            time.sleep(0.02)
        assert f"engine {last}: crash loop, next try in " in reason and \
            f"last exit: exit code 5 (crashy: cannot start: {flag} is present)" in reason, reason
        assert re.search(rf"engine {fatal}: FATAL \(next try in \d+ s\): flapping: 2 failures", reason), reason
        cli = subprocess.run([sys.executable, "-m", "supervisor", "status", "-c", str(h.config)], cwd=ROOT,
                             capture_output=True, text=True, timeout=30)
        assert cli.returncode == 0 and "NOT READY: " in cli.stdout and f"engine {fatal}: FATAL" in cli.stdout
        fed = h.notify_msgs.count("WATCHDOG=1")
        time.sleep(0.5)
        assert h.notify_msgs.count("WATCHDOG=1") > fed, "a node that keeps retrying is not stuck"
        flag.unlink()  # the cause is removed: the next retry serves
        h.wait_for(lambda s: s["primary"] == last, 30, "the crash-looping engine serves")
        r = httpx.post(h.router_url + "/v1/completions", json={"model": "ext-model", "prompt": "x"}, timeout=30)
        assert r.status_code == 200 and r.headers["x-understudy-engine"] == last
        assert httpx.get(h.router_url + "/readyz").status_code == 200
        assert h.engines()[fatal]["state"] == "FATAL", "an extra slot stays FATAL until an admin restart"
        assert h.admin("POST", f"/admin/engines/{fatal}/restart").status_code == 200
        h.wait_all_ready(30)
    finally:
        assert h.stop() == 0, h.tail()


def test_a_node_stuck_without_progress_stops_feeding_the_watchdog(tmp_path):
    """An engine that never listens, with a startup timeout far away: nothing moves for
    stuck_after_s, so WATCHDOG=1 stops (systemd would restart the node) and status says so."""
    h = harness(tmp_path, "sleep 60", count=1, extra=", startup_timeout_s: 60, stuck_after_s: 1",
                env={"WATCHDOG_USEC": "200000"})
    try:
        h.wait_booted()
        h.wait_for(lambda s: s["watchdog"]["stuck"], 15, "stuck")
        said = lambda: [i for i, m in enumerate(h.notify_msgs) if "STATUS=stuck: no READY primary and no progress" in m]
        deadline = time.monotonic() + 10  # (status may say stuck before the datagram is read here)
        while not said() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert said(), h.notify_msgs[-5:]
        assert "WATCHDOG=1" in h.notify_msgs[:said()[0]], "fed while the start was fresh"
        time.sleep(0.6)
        assert "WATCHDOG=1" not in h.notify_msgs[said()[0]:], "fed after it said stuck"
        assert "engine a: STARTING for" in httpx.get(h.router_url + "/readyz").json()["reason"]
    finally:
        assert h.stop() == 0, h.tail()


def test_admin_and_router_hygiene_drain_and_token(tmp_path, script):
    """Bearer scheme in any case; errors in one shape; one date/server header on proxied responses;
    drain = /readyz 503 while requests are still served; `understudy token` for curl."""
    h = harness(tmp_path, f"{sys.executable} {script} {{port}} {{name}} same", count=1)
    try:
        h.wait_booted()
        h.wait_all_ready(60)
        for scheme in ("bearer", "BEARER", "Bearer"):
            assert httpx.get(h.admin_url + "/status", headers={"authorization": f"{scheme} {h.token}"}).status_code == 200
        for bad in (f"Basic {h.token}", f"Bearer {h.token.upper()}x", "Bearer", ""):
            r = httpx.get(h.admin_url + "/status", headers={"authorization": bad})
            assert r.status_code == 401 and "bearer token" in r.json()["error"]
        assert h.admin("GET", "/nowhere").json() == {"error": "Not Found"}
        r = h.admin("POST", "/admin/engines/a/restart?force=maybe")
        assert r.status_code == 400 and r.json()["error"].startswith("query.force: "), r.text
        r = httpx.post(h.router_url + "/v1/completions", json={"model": "ext-model", "prompt": "x"})
        assert r.status_code == 200
        assert len(r.headers.get_list("date")) == 1 and len(r.headers.get_list("server")) == 1, r.headers
        for method, path, code in (("OPTIONS", "/v1/completions", 405), ("GET", "/nowhere", 404)):
            r = httpx.request(method, h.router_url + path)
            assert r.status_code == code and set(r.json()) == {"error"} and r.json()["error"]["message"]
        cli = lambda *a: subprocess.run([sys.executable, "-m", "supervisor", *a, "-c", str(h.config)], cwd=ROOT,
                                        capture_output=True, text=True, timeout=30)
        tok = cli("token")
        assert tok.returncode == 0 and tok.stdout.strip() == h.token
        assert cli("drain").returncode == 0
        rz = httpx.get(h.router_url + "/readyz")
        assert rz.status_code == 503 and rz.json()["reason"] == "node is drained"
        r = httpx.post(h.router_url + "/v1/completions", json={"model": "ext-model", "prompt": "x"})
        assert r.status_code == 200, "a drained node still serves what arrives (load balancer lag)"
        assert cli("undrain").returncode == 0 and httpx.get(h.router_url + "/readyz").status_code == 200
    finally:
        assert h.stop() == 0, h.tail()


def test_canary_mismatch_is_never_promoted(tmp_path, script):
    h = harness(tmp_path, f"{sys.executable} {script} {{port}} {{name}} vary", flap=3)
    try:
        h.wait_booted()
        ev = h.wait_event(lambda e: e["type"] == "canary_mismatch", timeout_s=60)
        st = h.wait_for(lambda s: s["primary"] is not None, 30)
        bad = ev["engine"]
        assert st["primary"] != bad
        assert "canary mismatch: expected ' ext-" in ev["reason"]
        h.wait_event(lambda e: e.get("engine") == bad and e.get("to") == "FATAL", timeout_s=30)
        assert not any(e["type"] in ("failover", "promoted") and e.get("to", e.get("engine")) == bad
                       for e in h.events)
    finally:
        assert h.stop() == 0, h.tail()


def test_engine_boot_error_halts_instead_of_looping(tmp_path, tiny_model):
    """A truncated checkpoint the engines load themselves (no daemon): each exits 3 (boot error).
    (What serve's preflight can tell, e.g. a KV budget too small, exits 2 before any engine starts:
    tests/supervisor/decisions/test_supervisor_config.py.)"""
    import shutil
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    st = model / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"runtime_dir: {tmp_path}/rt\nmodel: {{path: {model}}}\nrouter: {{port: 0}}\nadmin: {{port: 0}}\n"
                   "daemons: {enabled: false}\nengines: {spawn: direct, weight_cache_mode: 'off'}\n")
    r = subprocess.run([sys.executable, "-m", "supervisor", "serve", "-c", str(cfg)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "boot failed: no engine could start (a, b, boot error exit code 3): engine a: failed to start" \
        in r.stderr and "model.safetensors" in r.stderr, r.stderr[-2000:]
    assert r.stderr.count("STARTING: incarnation") == 2, "each slot started once, never looped"


def test_daemon_boot_error_halts_with_the_daemon_reason(tmp_path, tiny_model):
    import shutil
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    st = model / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])  # truncated checkpoint
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"runtime_dir: {tmp_path}/rt\nmodel: {{path: {model}}}\nrouter: {{port: 0}}\nadmin: {{port: 0}}\n")
    r = subprocess.run([sys.executable, "-m", "supervisor", "serve", "-c", str(cfg)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("understudy: boot failed:"))
    assert "daemon-rank0 stopped while loading the model (exit code" in line and "model.safetensors" in line
    assert "STARTING: incarnation" not in r.stderr.split("daemon-rank0: STOPPED -> STARTING")[1].split("boot failed")[0] \
        .replace("daemon-rank0", ""), "no engine starts after a daemon boot error"


def test_a_sigkilled_supervisor_leaves_no_orphans_after_the_next_start(tmp_path, tiny_model):
    """The next start re-adopts the children that match its config and stops the others
    (tests/supervisor/processes/test_supervisor_readopt.py covers the all-adopted case under load)."""
    import psutil
    text = (f"runtime_dir: {tmp_path}/rt\nmodel: {{path: {tiny_model}}}\nrouter: {{port: 0}}\nadmin: {{port: 0}}\n"
            "engines: {count: 1}\n")
    first = Harness(tmp_path, text, notify=False)
    try:
        first.wait_booted()
        st = first.wait_all_ready(90)
        engine, daemon, spawn = st["engines"][0]["pid"], st["daemons"][0]["pid"], st["spawn_server"]["pid"]
        first.proc.kill()  # the supervisor itself dies: its children are orphans now
        first.proc.wait()
        assert all(psutil.pid_exists(p) for p in (engine, daemon, spawn))
        (tmp_path / "again").mkdir()
        changed = text.replace("{count: 1}", "{count: 1, max_num_seqs: 4}")  # the engine's config changed
        second = Harness(tmp_path / "again", changed, notify=False)  # same runtime dir, new work dir
        try:
            second.wait_booted()
            st2 = second.wait_all_ready(90)
            assert not psutil.pid_exists(engine) or psutil.Process(engine).status() == psutil.STATUS_ZOMBIE
            assert st2["engines"][0]["pid"] != engine
            assert st2["daemons"][0]["pid"] == daemon and st2["spawn_server"]["pid"] == spawn  # re-adopted
            log = second.tail(200)
            assert f"previous engine a (pid {engine}) stopped, not adopted: started with another config" in log
        finally:
            assert second.stop() == 0
        for p in (engine, daemon, spawn):  # the normal stop ends adopted children too
            assert not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE
    finally:
        first.stop()


def test_boot_error_of_the_last_engine_after_serving_is_retried_until_fixed(tmp_path, tiny_model):
    """The checkpoint breaks under a serving node (one engine) and the engine dies: every restart
    is a boot error (exit 3), yet the node keeps retrying with capped backoff and says why; once
    the file is restored the next retry serves again."""
    import shutil
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    weights = model / "model.safetensors"
    good = weights.read_bytes()
    h = Harness(tmp_path, f"runtime_dir: {tmp_path}/rt\nmodel: {{path: {model}}}\nrouter: {{port: 0}}\n"
                          "admin: {port: 0}\nengines: {count: 1, kv_cache_bytes: 4194304, max_model_len: 128}\n"
                          "failover: {backoff_base_s: 0.05, backoff_max_s: 0.3, flap_max: 2, hold_timeout_s: 1}\n",
                notify=False)
    try:
        h.wait_booted()
        h.wait_all_ready(90)
        weights.write_bytes(good[: len(good) // 2])
        mark = len(h.events)
        os.kill(h.engines()["a"]["pid"], signal.SIGKILL)
        h.wait_for(lambda s: s["engines"][0]["recent_failures"] >= 4, 90, "four failures in a row")
        assert not any(e.get("to") == "FATAL" for e in h.events[mark:])
        eng = h.engines()["a"]
        assert eng["crash_loop"] and "exit code 3" in eng["last_exit"] + eng["reason"], eng
        reason = ""
        for _ in range(300):  # between spawns, /readyz shows the crash loop and the log line of the last exit
            reason = httpx.get(h.router_url + "/readyz").json()["reason"]
            if "crash loop" in reason:
                break
            time.sleep(0.02)
        assert "engine a: crash loop, next try in " in reason and "last exit: exit code 3 (" in reason \
            and "model.safetensors" in reason, reason
        weights.write_bytes(good)
        h.wait_for(lambda s: s["primary"] == "a", 90, "served again")
        r = httpx.post(h.router_url + "/v1/completions", json={"model": "model", "prompt": "x", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200 and h.engines()["a"]["weights_source"] == "cache_hit"
    finally:
        assert h.stop() == 0, h.tail()
