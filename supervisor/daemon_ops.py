"""Weight cache daemons (one per rank) and the engine spawn server: our own children."""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any

from daemon import framing
from daemon.cli import daemon_argv
from daemon.runtime_dir import daemon_socket_path
from supervisor.errors import BootError
from supervisor.exitstatus import describe_returncode
from supervisor.launch import PopenHandle, SpawnClient, child_env, kill_group, python_argv
from supervisor.pidwatch import watch_exit
from supervisor.slots import DaemonSlot
from supervisor.states import ALLOWED, RUNNING, State

log = logging.getLogger("understudy")

STATUS_POLL_S = 0.1
PING_INTERVAL_S = 2.0
PING_TIMEOUT_S = 2.0
PING_FAILURES = 3  # a daemon that does not answer this many pings in a row is hung: SIGKILL, restart


def daemon_status(path: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """One ``status`` request on a daemon socket (blocking; run in a thread)."""
    return framing.request(path, {"op": "status"}, timeout_s)


class DaemonOps:
    """Mixin of Supervisor (see arbiter.py for the attributes it uses)."""

    # ------------------------------------------------------------------ daemons
    async def boot_daemons(self) -> None:
        """Start every rank's daemon and wait for its arena; a daemon dying here is a boot error."""
        for d in self.daemons:
            if d.state == State.STOPPED:  # not re-adopted from a previous supervisor
                self.start_daemon(d)
        deadline = time.monotonic() + self.cfg.daemons.load_timeout_s
        while not all(d.state == State.READY for d in self.daemons):
            for d in self.daemons:
                if d.state not in RUNNING:
                    from supervisor.logtail import last_line
                    raise BootError(f"{d.name} stopped while loading the model ({d.last_exit or d.reason}): "
                                    f"{last_line(self.log_path(f'{d.name}-{d.incarnation}'))}")
            if time.monotonic() > deadline:
                raise BootError(f"daemons not loaded after {self.cfg.daemons.load_timeout_s:g}s "
                                f"(daemons.load_timeout_s)")
            await asyncio.sleep(STATUS_POLL_S)

    def start_daemon(self, d: DaemonSlot) -> None:
        if self.stopping:
            return
        d.incarnation += 1
        d.stop_requested, d.ping_failures = False, 0
        d.socket_path = str(daemon_socket_path(self.rd, d.rank))
        m = self.cfg.model
        gpu = self.cfg.resolved_gpu_ids()[d.rank] if self.device == "cuda" else None
        argv = daemon_argv(self.model_path, d.rank, m.tp_size, self.device, m.dtype, self.rd, gpu)
        d.started_at = time.monotonic()
        self.transition(d, State.STARTING, f"incarnation {d.incarnation}")
        try:
            handle = PopenHandle(argv, self.log_path(f"{d.name}-{d.incarnation}"), child_env())
        except OSError as e:
            self.transition(d, State.FAILED, f"cannot start: {e}")
            self.schedule_daemon_restart(d)
            return
        d.proc, d.pid = handle, handle.pid
        inc = d.incarnation
        d.cancel_watch = watch_exit(self.loop, handle.pid, lambda pid: self.on_daemon_exit(d, inc, pid))
        d.status_task = self._spawn(self._await_daemon(d, inc), f"status-{d.name}")
        self.write_state()  # its pid in children.json while it loads (a restarted supervisor stops it)

    async def _await_daemon(self, d: DaemonSlot, inc: int) -> None:
        """Poll ``status`` until the arena is loaded; record resident bytes and fingerprint."""
        last_pct, last_bytes = -1, None
        while d.incarnation == inc and d.state == State.STARTING:
            try:
                reply = await asyncio.to_thread(daemon_status, d.socket_path)
            except (OSError, ValueError) as e:
                log.debug("%s: not answering yet: %s", d.name, e)
                await asyncio.sleep(STATUS_POLL_S)
                continue
            info = reply.get("daemon") or {}
            prog = reply.get("progress") or info.get("progress") or {}
            if reply.get("type") == "ok" and info.get("state") == "ready":
                self.on_daemon_ready(d, info)
                return
            if reply.get("type") == "error" or info.get("state") == "failed":
                log.error("%s: %s", d.name, reply.get("message") or info.get("error"))
            elif prog.get("bytes_total"):
                pct = int(100 * prog.get("bytes_done", 0) / prog["bytes_total"])
                if prog.get("bytes_done") != last_bytes:  # the load advances: not stuck
                    last_bytes = prog.get("bytes_done")
                    self.watchdog_gate.progress(time.monotonic())
                if pct // 25 != last_pct // 25:
                    last_pct = pct
                    log.info("%s: loading %d%% (%.2f GB/s)", d.name, pct, prog.get("gbps", 0.0))
            await asyncio.sleep(STATUS_POLL_S)

    def check_daemon(self, d: DaemonSlot, now: float) -> None:
        """Ping READY daemons now and then; a hung one (SIGSTOP, deadlock) is killed and restarted.
        A (re)started daemon that does not finish loading within daemons.load_timeout_s is too."""
        limit = self.cfg.daemons.load_timeout_s
        if d.state == State.STARTING and d.pid and now - d.started_at > limit:
            self.transition(d, State.FAILED, f"not loaded within daemons.load_timeout_s={limit:g}s")
            kill_group(d.pid)
            return
        if d.state != State.READY or d.pinging or now - d.last_ping < PING_INTERVAL_S:
            return
        d.last_ping, d.pinging = now, True
        self._spawn(self._ping_daemon(d, d.incarnation), f"ping-{d.name}")

    async def _ping_daemon(self, d: DaemonSlot, inc: int) -> None:
        try:
            await asyncio.to_thread(daemon_status, d.socket_path, PING_TIMEOUT_S)
            d.ping_failures = 0
        except (OSError, ValueError) as e:
            if d.incarnation != inc or d.state != State.READY:
                return
            d.ping_failures += 1
            log.warning("%s: no answer to status (%d/%d): %s", d.name, d.ping_failures, PING_FAILURES, e)
            if d.ping_failures >= PING_FAILURES and d.pid:
                self.transition(d, State.FAILED, f"hang: {PING_FAILURES} status requests unanswered")
                kill_group(d.pid)
        finally:
            d.pinging = False

    def on_daemon_ready(self, d: DaemonSlot, info: dict[str, Any]) -> None:
        d.resident_bytes = int(info.get("resident_bytes") or 0)
        d.fingerprint = info.get("fingerprint")
        d.weights_finite = info.get("weights_finite")
        d.ever_ready = True
        d.policy.record_success()
        self.metrics.daemon_resident.labels(rank=str(d.rank)).set(d.resident_bytes)
        self.transition(d, State.READY, f"{d.resident_bytes / 1e6:.1f} MB resident, "
                        f"load {info.get('load_seconds') or 0:.2f}s")

    def on_daemon_exit(self, d: DaemonSlot, inc: int, pid: int) -> None:
        """pidfd event: engines keep their mappings; the daemon is restarted with backoff."""
        if d.incarnation != inc or d.pid != pid:
            return
        kill_group(pid)
        proc, d.pid = d.proc, None
        self.pending_reap.add(pid)
        if d.status_task is not None:
            d.status_task.cancel()
        expected = d.stop_requested or self.stopping
        if expected:
            if d.state in RUNNING and d.state != State.DRAINING:
                self.transition(d, State.DRAINING, "stop requested")
            self.transition(d, State.STOPPED, "stopped on request")
        elif d.state in RUNNING:
            self.transition(d, State.EXITED, "daemon exited without being asked to")
        self.metrics.daemon_resident.labels(rank=str(d.rank)).set(0)
        self._spawn(self._finish_daemon_exit(d, inc, pid, proc, expected), f"exit-{d.name}")

    async def _finish_daemon_exit(self, d: DaemonSlot, inc: int, pid: int, proc, expected: bool) -> None:
        try:
            rc = await proc.returncode() if proc is not None else None
        finally:
            self.pending_reap.discard(pid)
        d.last_exit = describe_returncode(rc)
        (log.info if expected else log.warning)("%s: pid %d %s", d.name, pid, d.last_exit)
        if expected or d.incarnation != inc or not d.ever_ready:
            self.write_state()
            return  # during boot, boot_daemons reports it
        if d.state == State.EXITED:
            d.reason = d.last_exit
        self.schedule_daemon_restart(d)

    def schedule_daemon_restart(self, d: DaemonSlot) -> None:
        if self.stopping:
            return
        delay = d.policy.record_failure()
        if d.policy.flapping:  # engines keep serving from their mappings: a daemon is never the last one
            self.transition(d, State.FATAL, f"flapping (last: {d.reason}); engines keep their mappings, "
                            "restarts load from disk")
            return
        self.transition(d, State.BACKOFF, f"restart in {delay:.2f}s (last: {d.reason})")
        d.timer = self.loop.call_later(delay, self._daemon_backoff_done, d)

    def _daemon_backoff_done(self, d: DaemonSlot) -> None:
        d.timer = None
        if d.state == State.BACKOFF and not self.stopping:
            self.start_daemon(d)

    def stop_daemon(self, d: DaemonSlot) -> None:
        if d.timer is not None:
            d.timer.cancel()
            d.timer = None
        if d.pid is None:
            if State.STOPPED in ALLOWED[d.state]:
                self.transition(d, State.STOPPED, "stopped")
            return
        d.stop_requested = True
        if d.state != State.DRAINING:
            self.transition(d, State.DRAINING, "stop requested")
        kill_group(d.pid, signal.SIGTERM)

    # ------------------------------------------------------------------ spawn server
    async def start_spawn_server(self) -> None:
        """The zygote that has imported torch and the engine code (no CUDA yet) and forks engines."""
        self.spawn_client = None
        self.spawn_proc = None
        if self.external or self.cfg.engines.spawn != "server":
            return
        path = self.rd / "spawn.sock"
        proc = PopenHandle(python_argv("engines.spawn_server", "--socket", str(path)),
                           self.log_path("spawn-server"), child_env())
        client = SpawnClient(path)
        self.spawn_starting = proc  # recorded (not adoptable) until it answers
        self.write_state()
        try:
            await client.wait_ready(120.0, proc)
        except asyncio.CancelledError:
            kill_group(proc.pid)
            raise
        except RuntimeError as e:
            kill_group(proc.pid)
            from supervisor.logtail import last_line
            raise BootError(f"{e}: {last_line(self.log_path('spawn-server'))}") from None
        finally:
            self.spawn_starting = None
        self.spawn_proc, self.spawn_client = proc, client
        watch_exit(self.loop, proc.pid, lambda pid: self._on_spawn_server_exit(proc))
        log.info("spawn server ready (pid %d)", proc.pid)
        self.write_state()  # recorded in children.json: a restarted supervisor re-adopts it

    def _on_spawn_server_exit(self, proc: PopenHandle) -> None:
        """Engines it forked keep running (we adopt them); a new server takes the next spawns."""
        if self.stopping or self.spawn_proc is not proc:
            return
        log.warning("spawn server (pid %d) exited (%s); starting a new one", proc.pid,
                    describe_returncode(proc.exit_status()))
        self._spawn(self.start_spawn_server(), "spawn-server")

    async def stop_spawn_server(self) -> None:
        proc = self.spawn_proc
        if proc is None:
            return
        kill_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.failover.stop_timeout_s
        while proc.running() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if proc.running():
            kill_group(proc.pid)
            await asyncio.sleep(0.05)
            proc.exit_status()
        self.spawn_proc = None
