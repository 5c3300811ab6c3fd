"""`scripts/serve --port N --admin-port M` (issue 24): the ports given on the command line win over the
config's, checked on a real node whose config names ports this test holds busy (were the flags ignored,
it could not bind). Bad ports are refused with the reason, before anything starts."""
from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx
import pytest

from wire.loopback import free_port
from harness import ROOT
from harness.handover import listening

CONFIG = """
runtime_dir: {rt}
model: {{path: {model}}}
engines: {{heartbeat_interval_s: 0.1, kv_cache_bytes: 4194304, max_num_seqs: 8, max_model_len: 128}}
failover: {{drain_timeout_s: 10, stop_timeout_s: 5}}
router: {{port: {busy_router}}}
admin: {{port: {busy_admin}}}
"""
READY = re.compile(r"understudy: ready: serving \S+ on (http://\S+)/v1 .*; admin (http://\S+) \(token in (\S+)\)")


def test_serve_listens_on_the_ports_of_the_command_line(tmp_path, tiny_model):
    busy = [listening(), listening()]  # the config's ports: taken, so only the flags can make it boot
    cfg = tmp_path / "understudy.yaml"
    cfg.write_text(CONFIG.format(rt=tmp_path / "rt", model=tiny_model, busy_router=busy[0].getsockname()[1],
                                 busy_admin=busy[1].getsockname()[1]))
    port, admin_port = free_port(), free_port()
    proc = subprocess.Popen([str(ROOT / "scripts" / "serve"), "-c", str(cfg), "--port", str(port),
                             "--admin-port", str(admin_port)], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        for line in proc.stderr:  # until the ready line (or the process ends)
            lines.append(line)
            if m := READY.search(line):
                break
        else:
            pytest.fail("scripts/serve exited before serving:\n" + "".join(lines[-40:]))
        router_url, admin_url, token_file = m.groups()
        assert (router_url, admin_url) == (f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}")
        assert httpx.get(router_url + "/readyz", timeout=10).status_code == 200
        token = open(token_file).read().strip()
        st = httpx.get(admin_url + "/status", headers={"Authorization": f"Bearer {token}"}, timeout=10).json()
        assert (st["router_url"], st["admin_url"]) == (router_url, admin_url)
        assert httpx.get(admin_url + "/ui", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        for s in busy:
            s.close()
    assert proc.returncode == 0


@pytest.mark.parametrize("args, message", [
    (["--port", "65536"], "argument --port: expected a port number (0-65535), got 65536"),
    (["--admin-port", "eighty"], "argument --admin-port: expected a port number (0-65535), got 'eighty'"),
    (["--port", "8001"], "with --port/--admin-port: admin.port: expected a port other than router.port, got 8001"),
])
def test_bad_ports_are_refused_with_the_reason(args, message):
    r = subprocess.run([sys.executable, "-m", "supervisor", "serve", "--check", *args], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_check_shows_the_ports_it_would_use():
    r = subprocess.run([sys.executable, "-m", "supervisor", "serve", "--check", "--port", "0", "--admin-port", "9001"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and "config OK: data plane 127.0.0.1:0, admin 127.0.0.1:9001" in r.stdout, r.stderr
