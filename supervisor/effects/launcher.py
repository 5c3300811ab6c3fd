"""Start and Attach: children start in their own session (pid = group); an engine is forked by the
spawn server, started directly, or by its external command; each exit is watched by pidfd and comes
back as Exited. The handles are kept for Reap (the exit status)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from daemon.framing import FrameError
from wire.loopback import free_port
from supervisor.core.actions import Attach, Start
from supervisor.core.events import Event, Exited, Launched, LaunchFailed, Pinged
from supervisor.effects.child_configs import ChildConfigs
from supervisor.effects.pidwatch import watch_exit
from supervisor.effects.processes import (SPAWN_TIMEOUT_S, AdoptedHandle, PopenHandle, ProcHandle, SpawnClient,
                                          SpawnedHandle, child_env, python_argv, rotate_log)

log = logging.getLogger("understudy")

KEEP_LOGS = 20  # per slot, the logs of the last incarnations (runtime_dir is often a tmpfs)


def log_path(rd: Path, kind: str, name: str, incarnation: int) -> Path:
    """``{runtime_dir}/logs/{name}-{incarnation}.log`` (the spawn server's: ``spawn-server.log``)."""
    return rd / "logs" / (f"{name}.log" if kind == "spawn_server" else f"{name}-{incarnation}.log")


class Launcher:
    """Starts children, watches their exits, keeps their handles."""

    def __init__(self, configs: ChildConfigs, record: Callable[[Event], None]) -> None:
        self.configs, self.record = configs, record
        self.rd = configs.rd
        self.spawn_client = SpawnClient(self.rd / "spawn.sock")
        self.handles: dict[int, ProcHandle] = {}
        self.spawn_server: tuple[str, int] | None = None  # (name, incarnation) of the latest one started or adopted

    async def start(self, a: Start) -> Event | None:
        """Launched is recorded before the exit watch starts: a process that dies at once is seen
        launched first, then exited (never the other way round)."""
        try:
            if a.kind == "engine":
                handle, url, port = await self._engine(a)
            elif a.kind == "daemon":
                argv = self.configs.daemon(int(a.name.removeprefix("daemon-rank")))
                handle, url, port = PopenHandle(argv, log_path(self.rd, a.kind, a.name, a.incarnation),
                                                {**child_env(), **self.configs.daemon_env()}), "", 0
            else:
                handle, url, port = PopenHandle(self.configs.spawn_server(), log_path(self.rd, a.kind, a.name,
                                                a.incarnation), child_env()), "", 0
        except Exception as e:  # spawn refused, bad template, fork failed...: a failure of this child
            why = str(e) or type(e).__name__
            if a.kind == "daemon" and self.configs.external:  # (its command line is the operator's: name the key)
                why = f"engines.external.daemon_command: cannot run it: {why}"
            return LaunchFailed(a.name, a.incarnation, why)
        if a.kind == "spawn_server":
            self.spawn_server = (a.name, a.incarnation)
        self.record(Launched(a.name, a.incarnation, handle.pid, url, port, spawned=isinstance(handle, SpawnedHandle)))
        self.watch(a.name, a.incarnation, handle)
        return None

    async def _engine(self, a: Start) -> tuple[ProcHandle, str, int]:
        old = log_path(self.rd, a.kind, a.name, a.incarnation - KEEP_LOGS)
        old.unlink(missing_ok=True)
        old.with_name(old.name + ".1").unlink(missing_ok=True)  # its previous run's (rotate_log)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        logf = log_path(self.rd, a.kind, a.name, a.incarnation)
        if a.via == "external":
            argv, url, env = self.configs.external_engine(a.name, port)
            return PopenHandle(argv, logf, {**child_env(), **env}), url, port
        ec = self.configs.engine(a.name, a.incarnation, port)
        if a.via == "spawn":
            rotate_log(logf)
            try:
                return await self.spawn_client.spawn(ec.model_dump(), logf), url, port
            except (OSError, FrameError) as e:  # it went away meanwhile (rollout, crash): not this engine's fault
                log.warning("%s: spawn server unavailable (%s); starting the engine directly", a.name, e)
                if isinstance(e, TimeoutError) and self.spawn_server is not None:  # hung: the request it holds could
                    self.record(Pinged(*self.spawn_server, ok=False,  # still fork an engine nobody tracks
                                       error=f"did not answer a spawn within {SPAWN_TIMEOUT_S:g}s"))
        return PopenHandle(python_argv("engines", "--config-json", ec.model_dump_json()), logf, child_env()), url, port

    def attach(self, a: Attach) -> None:
        """A child re-adopted from a previous supervisor: not ours (its exit status is unknown) unless
        the adopted spawn server forked it."""
        handle = SpawnedHandle(a.pid, self.spawn_client) if a.spawned else AdoptedHandle(a.pid)
        if a.kind == "spawn_server":
            self.spawn_server = (a.name, a.incarnation)
        self.watch(a.name, a.incarnation, handle)

    def watch(self, name: str, incarnation: int, handle: ProcHandle) -> None:
        self.handles[handle.pid] = handle
        watch_exit(asyncio.get_running_loop(), handle.pid,
                   lambda pid: self.record(Exited(name, incarnation, pid, time.monotonic())))
