"""The engine's link sockets (`{runtime_dir}/eng-PID-in|out.sock`, engines/core/core_link.py): 0600 from
the moment they exist, gone once the front end is connected, removed on the exit paths the engine
controls, and by whoever reaps an engine killed before that (issue 23, item 6).

To see the files at all, each test stops the front end (SIGSTOP) as soon as it is forked, long
before the core binds: the core then waits for it with both files in place."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from wire.engine_config import EngineConfig
from wire.link_sockets import remove_sockets, socket_paths
from harness.engine_process import EngineProcess, wait_for_ready_line
from engines.process.spawn_client import SpawnClient

ROOT = Path(__file__).resolve().parents[3]


def config(tiny_model: Path, rt: Path, name: str, **kw) -> EngineConfig:
    return EngineConfig(name=name, model_path=str(tiny_model), port=0, runtime_dir=str(rt), max_model_len=128,
                        max_num_seqs=2, **kw)


def child_named(pid: int, name: str, timeout: float = 60) -> psutil.Process:
    """The engine's child process called `name` (its front end: engine-NAME-http), once it has its name."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(pid).children():
            try:
                if child.name() == name:
                    return child
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.002)
    raise AssertionError(f"no child {name} of {pid}")


def stop_frontend_and_wait_for_sockets(pid: int, name: str, rt: Path) -> psutil.Process:
    """SIGSTOP the front end, then wait until the core has bound both link sockets."""
    frontend = child_named(pid, f"engine-{name}-http")
    frontend.suspend()
    paths = socket_paths(rt, pid)
    deadline = time.monotonic() + 60
    while not all(p.exists() for p in paths):
        assert psutil.pid_exists(pid) and time.monotonic() < deadline, "the core never bound its link sockets"
        time.sleep(0.01)
    return frontend


def link_files(rt: Path) -> list[str]:
    return sorted(p.name for p in rt.glob("eng-*.sock"))


def test_sockets_are_0600_and_gone_once_the_front_end_is_connected(tiny_model, tmp_path) -> None:
    rt = tmp_path / "rt"
    proc = EngineProcess(config(tiny_model, rt, "ls"), tmp_path / "engine.log")
    try:
        frontend = stop_frontend_and_wait_for_sockets(proc.pid, "ls", rt)
        for path in socket_paths(rt, proc.pid):
            st = os.stat(path)
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
        frontend.resume()
        proc.wait_ready(60)
        assert link_files(rt) == []  # removed at the front end's `ready`: a later SIGKILL leaves nothing
        r = httpx.post(proc.url + "/v1/completions", json={"model": tiny_model.name, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text  # the connections outlive their files
    finally:
        assert proc.stop() == 0
    assert link_files(rt) == []


def test_a_serving_engine_sigkilled_leaves_no_sockets(tiny_model, tmp_path) -> None:
    rt = tmp_path / "rt"
    proc = EngineProcess(config(tiny_model, rt, "lz"), tmp_path / "engine.log")
    proc.wait_ready(60)
    proc.signal_group(signal.SIGKILL)
    assert proc.proc.wait(30) == -signal.SIGKILL
    assert link_files(rt) == []


def test_front_end_lost_before_connecting_removes_the_sockets(tiny_model, tmp_path) -> None:
    """The core gives up on a front end that died before connecting: it exits removing its files."""
    rt = tmp_path / "rt"
    proc = EngineProcess(config(tiny_model, rt, "lf"), tmp_path / "engine.log")
    frontend = stop_frontend_and_wait_for_sockets(proc.pid, "lf", rt)
    frontend.kill()
    assert proc.proc.wait(60) != 0
    assert "front end did not start" in (tmp_path / "engine.log").read_text()
    assert link_files(rt) == []


def test_drain_begun_before_the_front_end_connected_exits_0_without_sockets(tiny_model, tmp_path) -> None:
    rt = tmp_path / "rt"
    proc = EngineProcess(config(tiny_model, rt, "ld"), tmp_path / "engine.log")
    frontend = stop_frontend_and_wait_for_sockets(proc.pid, "ld", rt)
    time.sleep(0.2)  # the core installs its SIGTERM handler microseconds after binding: let it
    proc.signal_group(signal.SIGTERM)  # the core drains (nothing in flight); the front end ignores it
    frontend.resume()
    assert proc.proc.wait(60) == 0
    assert link_files(rt) == []


def test_worker_rank_death_before_connecting_removes_the_sockets(tiny_model, tmp_path) -> None:
    """A TP rank dying kills the engine's group: rank 0 removes its link sockets first."""
    rt = tmp_path / "rt"
    proc = EngineProcess(config(tiny_model, rt, "lw", tp_size=2), tmp_path / "engine.log")
    stop_frontend_and_wait_for_sockets(proc.pid, "lw", rt)
    child_named(proc.pid, "engine-lw-r1").kill()
    assert proc.proc.wait(60) == -signal.SIGKILL  # the whole group, as before
    assert "rank 1" in (tmp_path / "engine.log").read_text()
    assert link_files(rt) == []


def test_sigkilled_engine_leaves_sockets_that_remove_sockets_takes(tiny_model, tmp_path) -> None:
    """What a supervisor must do after reaping an engine killed before its front end connected."""
    rt = tmp_path / "rt"
    proc = EngineProcess(config(tiny_model, rt, "lk"), tmp_path / "engine.log")
    stop_frontend_and_wait_for_sockets(proc.pid, "lk", rt)
    proc.signal_group(signal.SIGKILL)
    proc.proc.wait(30)
    assert link_files(rt) == [f"eng-{proc.pid}-in.sock", f"eng-{proc.pid}-out.sock"]
    assert remove_sockets(rt, proc.pid) == list(socket_paths(rt, proc.pid))
    assert link_files(rt) == [] and remove_sockets(rt, proc.pid) == []


def test_spawn_server_removes_the_sockets_of_a_killed_child(tiny_model, tmp_path) -> None:
    path = tmp_path / "spawn.sock"
    log = open(tmp_path / "spawn-server.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "engines.process.spawn_server", "--socket", str(path)],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    rt = tmp_path / "rt"
    try:
        deadline = time.monotonic() + 60
        while not path.exists():
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        with SpawnClient(str(path)) as client:
            pid = client.spawn(config(tiny_model, rt, "ss"), str(tmp_path / "ss.log"))
            stop_frontend_and_wait_for_sockets(pid, "ss", rt)
            os.killpg(pid, signal.SIGKILL)
            killed = pid
            deadline = time.monotonic() + 30
            while (rc := client.wait(pid)) is None:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert rc == -signal.SIGKILL
            assert link_files(rt) == []
            # and a spawned engine that serves and drains leaves nothing either
            pid = client.spawn(config(tiny_model, rt, "s2"), str(tmp_path / "s2.log"))
            wait_for_ready_line(tmp_path / "s2.log", 60, lambda: client.wait(pid))
            assert link_files(rt) == []
            os.killpg(pid, signal.SIGTERM)
            while (rc := client.wait(pid)) is None:
                time.sleep(0.05)
            assert rc == 0 and link_files(rt) == []
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(20) == 0
        log.close()
    said = (tmp_path / "spawn-server.log").read_text()
    assert all(f"removed {p}, left by engine pid {killed}" in said for p in socket_paths(rt, killed)), said


@pytest.mark.parametrize("pid", [1234, 99999])
def test_socket_paths_are_derived_from_the_pid(tmp_path, pid) -> None:
    assert socket_paths(tmp_path, pid) == (tmp_path / f"eng-{pid}-in.sock", tmp_path / f"eng-{pid}-out.sock")
