"""An external engine's own weight cache daemon (engines.external.daemon_command), with real processes: the
recipes' daemons (stand-ins with the same command lines, tests/recipe_stand_ins.py) SIGKILLed under a serving
node are restarted while the engines serve, their death and restart in status, events and metrics; a daemon
command that is not there, or that exits at once, is a line naming the key, never a node that hangs; and each
form of readiness check (engines.external.daemon_ready) against real sockets, a real HTTP server, a real log."""
from __future__ import annotations

import asyncio
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import yaml

from harness import ROOT
from harness.node import Harness
from supervisor.effects.ready_checks import not_ready

from recipe_stand_ins import install, short_dir


def _complete(h: Harness, model: str) -> str:
    r = httpx.post(h.router_url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 4},
                   timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("recipe", ["vllm.yaml", "sglang.yaml"])
def test_a_killed_daemon_is_restarted_and_the_node_keeps_serving(tmp_path, recipe):
    cfg, env = install(tmp_path, recipe)
    model = cfg["model"]["path"]
    h = Harness(tmp_path, yaml.safe_dump(cfg), env=env)
    try:
        h.wait_booted()
        st = h.wait_all_ready(60)
        ready = [e for e in h.events if e.get("type") == "transition" and e.get("to") == "READY"]
        assert ready[0]["engine"] == "daemon-rank0", "the daemon is READY before any engine"
        primary, daemon = st["primary"], st["daemons"][0]
        before = _complete(h, model)
        seen = len(h.events)
        os.kill(daemon["pid"], signal.SIGKILL)
        h.wait_event(lambda e: e.get("engine") == "daemon-rank0" and e.get("to") == "EXITED", since=seen)
        assert _complete(h, model) == before  # served while the daemon is away
        st = h.wait_for(lambda s: s["daemons"][0]["state"] == "READY" and s["daemons"][0]["pid"] != daemon["pid"],
                        30, "the daemon READY again")
        assert st["primary"] == primary and all(e["state"] == "READY" for e in st["engines"]), st
        assert "killed by SIGKILL" in st["daemons"][0]["last_exit"], st["daemons"][0]
        assert not [e for e in h.events[seen:] if e.get("type") == "failover"]
        assert _complete(h, model) == before
        metrics = h.metrics()
        assert 'understudy_daemon_starts_total{daemon="daemon-rank0"} 2.0' in metrics
        assert 'understudy_daemon_state{daemon="daemon-rank0",state="READY"} 1.0' in metrics
    finally:
        assert h.stop() == 0, h.tail()


def _config(tmp_path: Path, daemon_command: str) -> Path:
    cfg = {"runtime_dir": short_dir(), "model": {"path": str(tmp_path)}, "router": {"port": 0}, "admin": {"port": 0},
           "engines": {"kind": "external", "external": {
               "command": "python3 -c pass", "daemon_command": daemon_command,
               "daemon_ready": "unix:{runtime_dir}/d{gpu_id}.sock"}}}
    path = tmp_path / "understudy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor", "serve", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_a_daemon_command_that_is_not_there_is_refused_naming_the_key(tmp_path):
    path = _config(tmp_path, "no-such-weight-daemon --model {model}")
    line = ("engines.external.daemon_command: expected a program that can run here, got 'no-such-weight-daemon' "
            "(not found on PATH)")
    for args in (("--check", "-c", str(path)), ("-c", str(path))):
        r = _serve(*args)
        assert r.returncode == 2 and f"{path}: {line}" in r.stderr, (args, r.stderr)


def test_a_daemon_that_exits_at_once_stops_the_boot_naming_the_key(tmp_path):
    path = _config(tmp_path, "python3 -c \"raise SystemExit('no GPU here')\"")
    r = _serve("-c", str(path))
    assert r.returncode == 1, r.stderr
    assert ("understudy: boot failed: engines.external.daemon_command: daemon-rank0 stopped before it was ready "
            "(exit code 1): no GPU here") in r.stderr, r.stderr


def test_each_readiness_check_passes_only_once_the_daemon_is_up(tmp_path):
    log, sock_path = tmp_path / "d.log", str(tmp_path / "d.sock")
    check = lambda spec: asyncio.run(not_ready(spec, log))  # noqa: E731
    assert "No such file" in check("log:are ready")
    log.write_text("loading\nAll 1 weight cache daemons on node 0 are ready (tp_ranks=0..0)\n")
    assert check("log:All 1 weight cache daemons on node 0 are ready") is None
    assert "no line" in check("log:All 2 weight cache daemons")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(sock_path)
    stale.close()  # a killed daemon's socket file: it refuses connections
    assert "refused" in check(f"unix:{sock_path}")
    os.unlink(sock_path)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(sock_path)
        s.listen()
        assert check(f"unix:{sock_path}") is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert "refused" in check(f"tcp:127.0.0.1:{port}")
        s.listen()
        assert check(f"tcp:127.0.0.1:{port}") is None
    codes = {"/health": 200, "/loading": 503}

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(codes.get(self.path, 404))
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert check(f"{url}/health") is None
        assert check(f"{url}/loading") == f"{url}/loading answered HTTP 503"
    finally:
        server.shutdown()
