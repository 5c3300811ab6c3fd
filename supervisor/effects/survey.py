"""What re-adoption observes (supervisor/core/adoption.py decides): each recorded pid's start time,
the recorded spawn server's children, and whether each adoptable child answers as the recorded one
would (an engine's /health on its recorded port, a daemon's status, the spawn server's ping)."""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from daemon.runtime_dir import daemon_socket_path
from supervisor.core.actions import AwaitGone, CheckAdoptable, Survey
from supervisor.core.events import AdoptionChecked, GroupsGone, Surveyed
from supervisor.core.records import ChildRecord, same_process
from supervisor.effects.checks import daemon_status
from supervisor.effects.launcher import log_path
from supervisor.effects.ready_checks import not_ready
from supervisor.effects.processes import SpawnClient
from supervisor.effects.reaper import wait_groups_gone
from supervisor.effects.records_file import create_time
from supervisor.router.upstream import Client

CHECK_TIMEOUT_S = 2.0
STOP_WAIT_S = 10.0


class Surveyor:
    def __init__(self, rd: Path, http: Client, external: bool, ready_of: Callable[[int], str] | None = None) -> None:
        """``ready_of``: a rank's daemon readiness check, for an external engine's daemons."""
        self.rd, self.http, self.external, self.ready_of = rd, http, external, ready_of

    async def survey(self, a: Survey) -> Surveyed:
        try:
            return await asyncio.to_thread(_observe, a.records.children)
        except Exception as e:  # noqa: BLE001 (then nothing is adopted: supervisor/core/adoption.py gives up)
            return Surveyed({}, error=f"{type(e).__name__}: {e}")

    async def check(self, a: CheckAdoptable) -> AdoptionChecked:
        info: dict[str, dict[str, Any]] = {}
        checks = await asyncio.gather(*(self._check(r, info) for r in a.candidates), return_exceptions=True)
        failed = {r.name: (why if isinstance(why, str) else f"{type(why).__name__}: {why}")
                  for r, why in zip(a.candidates, checks) if why is not None}
        return AdoptionChecked(failed, info, since_start=_since_process_start())

    async def await_gone(self, a: AwaitGone) -> GroupsGone:
        await wait_groups_gone(list(a.pids), STOP_WAIT_S)
        return GroupsGone(a.pids)

    async def _check(self, rec: ChildRecord, info: dict[str, dict[str, Any]]) -> str | None:
        """None if the child answers as the recorded one would; else why not."""
        try:
            if rec.kind == "engine":
                # (an external engine may serve from a child process: its URL answering is the check)
                if not self.external and not await asyncio.to_thread(_listens_on, rec.pid, rec.port):
                    return f"pid {rec.pid} (or its HTTP front end) does not listen on port {rec.port}"
                status, _ = await self.http.fetch("GET", rec.url, "/health", timeout_s=CHECK_TIMEOUT_S)
                return None if status == 200 else f"GET {rec.url}/health answered {status}"
            if rec.kind == "daemon" and self.external and self.ready_of is not None:  # its readiness check again
                check = self.ready_of(int(rec.name.removeprefix("daemon-rank")))
                return await not_ready(check, log_path(self.rd, "daemon", rec.name, rec.incarnation))
            if rec.kind == "daemon":
                rank = int(rec.name.removeprefix("daemon-rank"))
                reply = await asyncio.to_thread(daemon_status, str(daemon_socket_path(self.rd, rank)), CHECK_TIMEOUT_S)
                daemon = reply.get("daemon") or {}
                if reply.get("type") != "ok" or daemon.get("state") != "ready":
                    return f"status answered {reply.get('type')} / {daemon.get('state')}"
                if daemon.get("pid") not in (None, rec.pid):
                    return f"the daemon socket is served by pid {daemon.get('pid')}, not {rec.pid}"
                info[rec.name] = daemon
                return None
            reply = await SpawnClient(self.rd / "spawn.sock", CHECK_TIMEOUT_S).call({"op": "ping"})
            return None if reply.get("ok") else f"ping answered {reply}"
        except Exception as e:  # noqa: BLE001 (any failure to answer means: do not adopt)
            return f"{type(e).__name__}: {e}"


def _observe(children: list[ChildRecord]) -> Surveyed:
    observed = {r.pid: create_time(r.pid) for r in children}
    kids: list[int] = []
    for rec in children:
        if rec.kind == "spawn_server" and same_process(rec.create_time, observed.get(rec.pid)):
            kids += _session_leaders(rec.pid)
    return Surveyed(observed, tuple(kids))


def _session_leaders(pid: int) -> list[int]:
    """Live children of ``pid`` that lead their own session (engines it forked: setsid done)."""
    try:
        kids = psutil.Process(pid).children()
    except psutil.Error:
        return []
    out = []
    for kid in kids:
        try:
            if kid.status() != psutil.STATUS_ZOMBIE and os.getpgid(kid.pid) == kid.pid:
                out.append(kid.pid)
        except (psutil.Error, ProcessLookupError):
            continue
    return out


def _listens_on(pid: int, port: int) -> bool:
    """The engine (rank 0) or one of its children (its HTTP front end) listens on `port`."""
    try:
        rank0 = psutil.Process(pid)
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for p in [rank0, *rank0.children()] for c in p.net_connections(kind="tcp"))
    except psutil.Error:
        return False


def _since_process_start() -> float:
    """Seconds since this process started (/proc/self/stat starttime vs CLOCK_BOOTTIME)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        ticks = int(stat[stat.rfind(b")") + 2:].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")
