"""The admin CLI against what is not our admin API (another HTTP server on the port, nothing
listening) and with arguments that are not engine names: a line naming what was wrong, exit 2,
never a traceback, never a success. Real processes and sockets."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from wire.loopback import free_port
from harness import ROOT


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def config(tmp_path: Path, port: int) -> Path:
    (tmp_path / "rt").mkdir(mode=0o700, exist_ok=True)
    token = tmp_path / "token"
    token.write_text("sesame\n")
    token.chmod(0o600)
    cfg = tmp_path / "cli.yaml"
    cfg.write_text(f"runtime_dir: {tmp_path}/rt\nadmin: {{port: {port}, token_file: {token}}}\n")
    return cfg


@pytest.fixture()
def foreign(tmp_path: Path) -> Iterator[int]:
    """Python's http.server: HTML pages and 404/501 for what we ask."""
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=tmp_path,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield port
    finally:
        p.kill()
        p.wait()


def test_another_http_server_on_the_admin_port_is_said_to_be_one(tmp_path, foreign):
    cfg = config(tmp_path, foreign)
    for args in (("status",), ("status", "--json"), ("promote",), ("restart", "a")):
        r = cli(*args, "-c", str(cfg))
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "not an understudy admin API (is admin.port right?)" in r.stderr and "Traceback" not in r.stderr
        assert "<html" not in (r.stdout + r.stderr).lower()  # (its page is not dumped)


def test_nothing_listening_is_named_with_the_address(tmp_path):
    port = free_port()
    r = cli("status", "-c", str(config(tmp_path, port)))
    assert r.returncode == 2 and f"cannot reach the admin API at http://127.0.0.1:{port}" in r.stderr, r.stderr


@pytest.mark.parametrize("name", ["b/restart?force=true&", "", "a?x", "x" * 70_000])
def test_restart_takes_only_an_engine_name_never_a_path(tmp_path, name):
    """A name with a path or query in it would reach another endpoint (or skip --force's question)."""
    r = cli("restart", name, "-c", str(config(tmp_path, free_port())))
    assert r.returncode == 2 and "is not an engine name" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr) < 300


@pytest.mark.parametrize("command, asked_again", [("drain", True), ("undrain", True), ("promote", False)])
def test_an_admin_request_closed_unanswered_is_asked_again_only_when_harmless(tmp_path, command, asked_again):
    """As a listener at its cap closes an idle connection to make room (supervisor/admin/client.py)."""
    from tests.harness.test_bench_serve import FakeServer

    server = FakeServer(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n"
                        b"connection: close\r\n\r\n{\"ok\": true}", unanswered=1)
    r = cli(command, "-c", str(config(tmp_path, int(server.url.rsplit(":", 1)[1]))))
    server.close()
    if asked_again:
        assert r.returncode == 0 and '"ok": true' in r.stdout, r.stderr
        assert server.paths == [f"/admin/{command}".encode()] * 2
    else:  # a second promote could be a second switchover: said, not repeated
        assert r.returncode == 2 and "Server disconnected without sending a response" in r.stderr, r.stderr
        assert server.paths == [b"/admin/promote"]
