"""Process handles and groups: our own children (Popen), engines forked by the spawn server (and its
async client), children re-adopted from a previous supervisor; signalling a group, and whether one
is gone. Every child gets its own session, so its pid is its group."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from daemon import framing
from supervisor.effects.pidwatch import foreign_exit, is_our_child, try_reap

log = logging.getLogger("understudy.launch")


class ProcHandle(Protocol):
    """A started process group whose leader is ``pid``."""

    pid: int

    async def returncode(self) -> int | None:
        """Exit status once the process has exited (negative = signal); None if unknown."""


def rotate_log(path: Path) -> None:
    """Before a new process writes ``path``: the previous run's log becomes ``path.1`` (an older
    ``.1`` is dropped), so logs never grow across runs and the last one is kept."""
    try:
        os.replace(path, path.with_name(path.name + ".1"))
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("cannot rotate %s: %s", path, e)


def open_log(path: Path) -> int:
    """A fresh log fd (0600, append mode); the previous file at ``path`` is kept as ``path.1``."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    rotate_log(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)


class PopenHandle:
    """A child of ours, started with subprocess in a new session."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        fd = open_log(log_path)
        try:
            self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd,
                                          start_new_session=True, env=env, close_fds=True)
        finally:
            os.close(fd)
        self.pid = self.popen.pid
        self.argv = argv

    async def returncode(self) -> int | None:
        """The exit status; waits out a teardown still in progress (a GPU process: ~100 ms+)."""
        deadline = time.monotonic() + EXIT_STATUS_WAIT_S
        while time.monotonic() < deadline:
            rc = self.popen.poll()
            if rc is not None:
                return rc
            await asyncio.sleep(0.01)
        return no_status(self.pid)


EXIT_STATUS_WAIT_S = 10.0  # the exit may be seen early (PF_EXITING), before the kernel tore the process down


def no_status(pid: int) -> None:
    """The exit status did not come within EXIT_STATUS_WAIT_S: said (it held up whatever waited)."""
    log.warning("pid %d: no exit status %gs after its exit was seen: exit status unknown", pid, EXIT_STATUS_WAIT_S)


def python_argv(module: str, *args: str) -> list[str]:
    """``python -m module args`` with this interpreter (the venv's)."""
    return [sys.executable, "-m", module, *args]


def child_env() -> dict[str, str]:
    """Our environment, minus systemd's notify variables (only the supervisor talks to systemd),
    plus the repo on PYTHONPATH so ``-m engines`` works without an install."""
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


SPAWN_TIMEOUT_S = 10.0  # a READY spawn server forks in milliseconds: one silent this long is hung (stopped, stuck)
WAIT_TIMEOUT_S = 2.0  # for an exit status it already has or has not


class SpawnClient:
    """Client of the engine spawn server (frames as daemon/framing.py, one connection per call)."""

    def __init__(self, path: Path, timeout_s: float = 30.0) -> None:
        self.path = path
        self.timeout_s = timeout_s

    async def call(self, obj: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        return await asyncio.to_thread(framing.request, self.path, obj, timeout_s or self.timeout_s)

    async def wait_ready(self, timeout_s: float, alive: "PopenHandle") -> None:
        """Ping until the server answers; raise RuntimeError if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if alive.popen.poll() is not None:
                raise RuntimeError(f"spawn server exited during start ({alive.popen.returncode})")
            try:
                if (await self.call({"op": "ping"})).get("ok"):
                    return
            except (OSError, ImportError, ValueError) as e:
                last = str(e)
            await asyncio.sleep(0.05)
        raise RuntimeError(f"spawn server did not answer within {timeout_s:.0f}s ({last})")

    async def spawn(self, config_json: dict[str, Any], log_path: Path) -> "SpawnedHandle":
        reply = await self.call({"op": "spawn", "config": config_json, "log_path": str(log_path)}, SPAWN_TIMEOUT_S)
        if not reply.get("ok"):
            raise RuntimeError(f"spawn server refused: {reply.get('error', reply)}")
        return SpawnedHandle(int(reply["pid"]), self)


class SpawnedHandle:
    """An engine forked by the spawn server (its child, or ours once adopted as subreaper)."""

    def __init__(self, pid: int, client: SpawnClient) -> None:
        self.pid = pid
        self.client = client

    async def returncode(self) -> int | None:
        """The exit status, from the spawn server (or our own waitpid once we adopted the orphan). An
        engine of a spawn server replaced since it was re-adopted is nobody's we can ask: read from
        /proc while it is a zombie, else unknown, at once (a rollout never waits for it)."""
        deadline = time.monotonic() + EXIT_STATUS_WAIT_S
        while time.monotonic() < deadline:
            claimed = False
            try:
                reply = await self.client.call({"op": "wait", "pid": self.pid}, WAIT_TIMEOUT_S)
                if reply.get("ok") and reply.get("returncode") is not None:
                    return int(reply["returncode"])
                claimed = bool(reply.get("ok"))
            except (OSError, ValueError, ImportError):
                pass  # spawn server gone: we adopted the orphan (or init did)
            rc = try_reap(self.pid)
            if rc is not None:
                return rc
            if not claimed and not is_our_child(self.pid):
                exited, rc = foreign_exit(self.pid)
                if exited:
                    return rc
            await asyncio.sleep(0.02)
        return no_status(self.pid)


class AdoptedHandle:
    """A child re-adopted from a previous supervisor: watched by pidfd, but not our child (waitpid
    works only for a parent; it was re-parented to init): its exit status is read from /proc while
    it is a zombie, else unknown."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    async def returncode(self) -> int | None:
        """Once its teardown is over (a GPU process: ~100 ms after it began to exit)."""
        deadline = time.monotonic() + EXIT_STATUS_WAIT_S
        while time.monotonic() < deadline:
            exited, rc = foreign_exit(self.pid)
            if exited:
                return rc
            await asyncio.sleep(0.01)
        return no_status(self.pid)


def kill_group(pid: int, sig: int = signal.SIGKILL) -> bool:
    """Signal the process group led by ``pid``; False if it no longer exists."""
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError as e:
        log.error("cannot signal group %d: %s", pid, e)
        return False


def group_alive(pgid: int) -> bool:
    """Whether any process still lives in group ``pgid`` (zombies do not count)."""
    import psutil
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == pgid:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False
