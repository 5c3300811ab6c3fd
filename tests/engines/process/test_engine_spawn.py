"""The spawn server forks engines that serve, reports their exit codes, and survives bad requests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from wire.engine_config import EngineConfig
from harness.engine_process import wait_for_ready_line
from engines.process.spawn_client import SpawnClient, SpawnError

ROOT = Path(__file__).resolve().parents[3]


def start_spawn_server(tmp: Path, *args: str) -> subprocess.Popen:
    """`python -m engines.process.spawn_server --socket tmp/spawn.sock ARGS`, once its socket exists."""
    path = tmp / "spawn.sock"
    with open(tmp / "spawn-server.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "engines.process.spawn_server", "--socket", str(path), *args],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    deadline = time.monotonic() + 60
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp / "spawn-server.log").read_text()
        time.sleep(0.05)
    return proc


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spawn")
    proc = start_spawn_server(tmp)
    yield tmp, tmp / "spawn.sock"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    assert not (tmp / "spawn.sock").exists()


def config(tiny_model: Path, tmp: Path, name: str) -> EngineConfig:
    return EngineConfig(name=name, model_path=str(tiny_model), port=0, runtime_dir=str(tmp / "rt"),
                        max_model_len=256, max_num_seqs=4)


def wait_exit(client: SpawnClient, pid: int, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while (rc := client.wait(pid)) is None:
        assert time.monotonic() < deadline, f"pid {pid} still running"
        time.sleep(0.05)
    return rc


def test_spawned_engine_serves_skips_imports_and_drains_to_0(server, tiny_model) -> None:
    tmp, path = server
    with SpawnClient(str(path)) as client:
        client.ping()
        pid = client.spawn(config(tiny_model, tmp, "sp1"), str(tmp / "sp1.log"))
        assert client.wait(pid) is None
        ready = wait_for_ready_line(tmp / "sp1.log", 60, lambda: client.wait(pid))
        assert ready["pid"] == pid and os.getsid(pid) == pid
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{ready['port']}/v1", api_key="unused", max_retries=0)
        r = oai.completions.create(model=tiny_model.name, prompt="Hi", max_tokens=5, temperature=0,
                                   extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5
        # a fork of the warm server, never an exec: the imports were the server's (how much faster
        # that starts is `understudy bench restart`'s figure)
        engine, parent = psutil.Process(pid), psutil.Process(pid).parent()
        assert parent.cmdline()[1:3] == ["-m", "engines.process.spawn_server"] and engine.cmdline() == parent.cmdline()
        assert engine.exe() == parent.exe()
        assert "pre_init" in httpx.get(f"http://127.0.0.1:{ready['port']}/startup").json()["phases"]
        os.killpg(pid, signal.SIGTERM)
        assert wait_exit(client, pid) == 0


def test_wait_reports_the_killing_signal(server, tiny_model) -> None:
    tmp, path = server
    with SpawnClient(str(path)) as client:
        pid = client.spawn(config(tiny_model, tmp, "sp2"), str(tmp / "sp2.log"))
        wait_for_ready_line(tmp / "sp2.log", 60, lambda: client.wait(pid))
        os.killpg(pid, signal.SIGKILL)
        assert wait_exit(client, pid) == -signal.SIGKILL


@pytest.mark.parametrize("request_obj,message", [
    ({"op": "fly"}, "unknown op 'fly'"),
    ({"op": "wait", "pid": 1}, "pid 1 was not spawned by this server"),
    ({"op": "spawn", "config": {"name": "x"}, "log_path": "/tmp/x.log"}, "config.model_path: Field required"),
    ({"op": "spawn", "config": {"name": "x", "model_path": "/m", "port": 0, "runtime_dir": "/r", "tp_size": 0},
      "log_path": "/tmp/x.log"}, "config.tp_size"),
    ({"op": "spawn", "config": {"name": "x", "model_path": "/m", "port": 0, "runtime_dir": "/r"}},
     "log_path must be a non-empty string"),
])
def test_bad_requests_get_errors(server, request_obj, message) -> None:
    _, path = server
    with SpawnClient(str(path)) as client:
        with pytest.raises(SpawnError, match=message.replace("(", r"\(").replace(")", r"\)")):
            client.request(request_obj)
        client.ping()


def test_malformed_frame_closes_that_connection_only(server) -> None:
    _, path = server
    raw = socket.socket(socket.AF_UNIX)
    raw.connect(str(path))
    raw.sendall(b"\x00\x00\x00\x05{bad}")
    raw.settimeout(5)
    data = raw.recv(4096)
    assert b"not UTF-8 JSON" in data
    assert raw.recv(4096) == b""  # then closed
    raw.close()
    with SpawnClient(str(path)) as client:
        client.ping()


def test_a_tokenizer_that_cannot_be_preloaded_is_said_and_engines_still_serve(tiny_model, tmp_path) -> None:
    """--tokenizer naming a folder with no tokenizer: a warning in the spawn server's log, and the
    engines it forks read their checkpoint's own tokenizer."""
    proc = start_spawn_server(tmp_path, "--tokenizer", str(tmp_path / "missing"))
    try:
        assert "tokenizer of" in (tmp_path / "spawn-server.log").read_text()
        with SpawnClient(str(tmp_path / "spawn.sock")) as client:
            pid = client.spawn(config(tiny_model, tmp_path, "tk1"), str(tmp_path / "tk1.log"))
            ready = wait_for_ready_line(tmp_path / "tk1.log", 60, lambda: client.wait(pid))
            r = httpx.post(f"http://127.0.0.1:{ready['port']}/v1/completions", timeout=30,
                           json={"model": tiny_model.name, "prompt": "Hi", "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
            os.killpg(pid, signal.SIGTERM)
            assert wait_exit(client, pid) == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
