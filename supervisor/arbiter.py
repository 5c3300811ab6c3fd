"""The supervisor: one asyncio loop, one small method per event (gunicorn arbiter style).

Events: child exits (pidfds), engine messages (zmq), signals (enqueued by handlers), the periodic
tick (timeouts, probes, watchdog), admin calls. Engine, daemon and admin work live in the mixins
``EngineOps``, ``HealthOps``, ``FailoverOps``, ``DaemonOps`` and ``AdminOps``; this file is the loop, boot and shutdown.
"""
from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from supervisor.admin_ops import AdminOps
from supervisor.adopt import adopt_or_clean, snapshot, wanted
from supervisor.backoff import RestartPolicy
from supervisor.canary import GoldenStore, model_fingerprint
from supervisor.child_records import ChildRecords, read_records, write_records
from supervisor.config import UnderstudyConfig
from supervisor.control import ControlChannel
from supervisor.daemon_ops import DaemonOps
from supervisor.engine_ops import EngineOps
from supervisor.failover import FailoverOps
from supervisor.health import HealthOps
from supervisor.events import EventBus
from supervisor.httpserve import bind_tcp, make_server
from supervisor.errors import BootError
from supervisor.launch import PopenHandle, SpawnClient, kill_group
from supervisor.limits import listener_limits, raise_open_files_limit
from supervisor.metrics import Metrics
from supervisor.pidwatch import become_subreaper, is_exiting, reap_orphans
from supervisor.router import build_router
from supervisor.reconcile import AdoptionPlan
from supervisor.routing import RoutingTable
from supervisor.sdnotify import Notifier
from supervisor.slots import DaemonSlot, EngineSlot, Slot
from supervisor.socket_activation import ActivationError, inherited_sockets
from supervisor.states import Role, State
from supervisor.token import ensure_token
from supervisor.upstream import Client
from supervisor.watchdog import WatchdogGate
from supervisor.why import not_ready_text

log = logging.getLogger("understudy")

TICK_S = 0.1
ESSENTIAL = frozenset({"router", "admin", "control", "signals", "tick"})


class Supervisor(EngineOps, HealthOps, FailoverOps, DaemonOps, AdminOps):
    """Owns every child, the routing table and the two HTTP servers."""

    def __init__(self, cfg: UnderstudyConfig, model_path: Path, device: str) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.device = device
        self.model_name = cfg.model.name or model_path.name
        self.rd = cfg.resolved_runtime_dir()
        self.external = cfg.engines.kind == "external"
        self.metrics = Metrics()
        self.notifier = Notifier()
        self.epoch = 0
        self.stopping = False
        self.booted = False
        self.pending_failover: tuple[str, float, str] | None = None
        self.failovers: deque[dict[str, Any]] = deque(maxlen=50)
        self.engines: dict[str, EngineSlot] = {n: EngineSlot(n, self._policy()) for n in cfg.engines.slot_names()}
        self.daemons: list[DaemonSlot] = []
        if not self.external and cfg.daemons.enabled and cfg.engines.weight_cache_mode == "client":
            self.daemons = [DaemonSlot(f"daemon-rank{r}", self._policy(), rank=r) for r in range(cfg.model.tp_size)]
        self.fingerprint = model_fingerprint(str(model_path), dtype=cfg.model.dtype, tp=cfg.model.tp_size,
                                             device=device, prompt=cfg.canary.prompt, n=cfg.canary.max_tokens,
                                             external=cfg.engines.external.command if self.external else None)
        self.exit_code = 0
        self._signals: asyncio.Queue[int] = asyncio.Queue()
        self._stopped = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._last_watchdog = 0.0
        self._last_reap = 0.0
        self.pending_reap: set[int] = set()  # exited children whose status a task is still reading
        self.started_wall = time.time()
        self.table = RoutingTable()
        self.table.explain = lambda: not_ready_text(self.engines.values(), time.monotonic())
        self.watchdog_gate = WatchdogGate(cfg.failover.stuck_window_s(), time.monotonic())
        self.stuck = False
        self.router_url: str | None = None
        self.admin_url: str | None = None
        self.spawn_proc: PopenHandle | None = None
        self.spawn_starting: PopenHandle | None = None  # started, not answering yet
        self.spawn_client: SpawnClient | None = None
        self.rollout_state: dict[str, Any] | None = None
        self.announced = False  # "ready" printed and READY=1 sent
        self.final = False
        self.prev_records: ChildRecords | None = None  # left by a previous supervisor: adopt_or_clean
        self.adoption: AdoptionPlan | None = None
        self.records_ready = False  # children.json is written once the previous one has been used
        self.create_times: dict[int, float | None] = {}
        self.adopted_daemon_info: dict[str, dict[str, Any]] = {}

    def _policy(self) -> RestartPolicy:
        f = self.cfg.failover
        return RestartPolicy(f.backoff_base_s, f.backoff_max_s, f.flap_window_s, f.flap_max)

    # ------------------------------------------------------------------ setup
    def prepare(self) -> None:
        """Everything that can fail before a child starts: dirs, ports, token, sockets."""
        from daemon.runtime_dir import ensure_private_dir
        try:
            ensure_private_dir(self.rd)
        except (OSError, ValueError, RuntimeError) as e:
            raise BootError(f"runtime_dir: {e}") from None
        from supervisor.stale import RuntimeDirInUse, check_and_clean
        self.prev_records = read_records(self.rd)
        try:  # with records, live children are re-adopted (or stopped) at boot instead of killed here
            check_and_clean(self.rd, kill=self.prev_records is None)
        except RuntimeDirInUse as e:
            raise BootError(str(e)) from None
        (self.rd / "logs").mkdir(mode=0o700, exist_ok=True)
        try:
            held = inherited_sockets()
        except ActivationError as e:
            raise BootError(f"socket activation: {e}") from None
        for name, sock in held.items():
            log.info("%s: listening socket handed over (fd %d, %s)", name, sock.fileno(), sock.getsockname())
            want = self.cfg.router if name == "router" else self.cfg.admin
            if want.port not in (0, sock.getsockname()[1]):
                log.warning("%s: the handed-over socket listens on %s, the config says %s:%d; serving on the "
                            "socket (keep ListenStream= and the config equal)", name, sock.getsockname(),
                            want.host, want.port)
        self.router_sock = held.get("router") or bind_tcp(self.cfg.router.host, self.cfg.router.port, "router")
        try:
            self.admin_sock = held.get("admin") or bind_tcp(self.cfg.admin.host, self.cfg.admin.port, "admin")
        except Exception:
            self.router_sock.close()
            raise
        self.router_url = _url(self.router_sock)
        self.admin_url = _url(self.admin_sock)
        self.token_file = self.cfg.resolved_token_file()
        self.token = ensure_token(self.token_file)
        self.golden = GoldenStore(self.rd)
        self.zctx = zmq.Context()
        self.azctx = zmq.asyncio.Context()
        self.events = EventBus(self.zctx, str(self.rd / "events.sock"))
        self.control = ControlChannel(self.azctx, str(self.rd / "control.sock"))
        self.http = Client(timeout_s=10.0, max_connections=64)  # health checks, canaries, /startup
        self.child_keys = wanted(self)

    # ------------------------------------------------------------------ main
    async def run(self) -> int:
        """Serve until a signal stops us; returns the process exit code."""
        self.loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self.loop.add_signal_handler(sig, self._signals.put_nowait, sig)
        become_subreaper()
        if self.prev_records is not None:  # before serving: connections wait in the backlog meanwhile
            self.adoption = await adopt_or_clean(self, self.prev_records)
        lvl = "warning" if self.cfg.log_level != "debug" else "info"
        r = self.cfg.router
        router_app = build_router(self.table, self.metrics, hold_timeout_s=self.cfg.failover.hold_timeout_s,
                                  retry_after_s=self.cfg.failover.retry_after_s,
                                  upstream_timeout_s=r.upstream_timeout_s, max_connections=r.max_connections,
                                  # continuation needs our engine's extensions (token ids, `continuation`)
                                  migration=r.migration if self.cfg.engines.kind == "builtin"
                                  else r.migration.model_copy(update={"enabled": False}),
                                  publish=self.events.publish,
                                  limits=self.cfg.limits, body_timeout_s=self.cfg.limits.body_timeout_s)
        router_limits, admin_limits = listener_limits(self.cfg, raise_open_files_limit())
        self.servers = [make_server(router_app, self.router_sock, lvl, router_limits, "router")]
        self._spawn(self.servers[0].serve(sockets=[self.router_sock]), "router")
        self._spawn(self._control_loop(), "control")
        self._spawn(self._signal_loop(), "signals")
        self._spawn(self._tick_loop(), "tick")
        if self.cfg.failover.exit_poll_ms > 0:
            self._spawn(self._primary_exit_loop(self.cfg.failover.exit_poll_ms / 1000), "primary-exit")
        self.boot_task = self._spawn(self._boot(), "boot")
        self.write_state()
        # The admin API's framework (fastapi: 0.3 s on the GPU host) is imported off the loop, so a
        # restarted supervisor serves meanwhile; admin connections wait in the socket's backlog.
        admin = await asyncio.to_thread(importlib.import_module, "supervisor.admin")
        if not self._stopped.is_set():
            self.servers.append(make_server(admin.build_admin(self, self.token), self.admin_sock, lvl, admin_limits,
                                            "admin"))
            self._spawn(self.servers[1].serve(sockets=[self.admin_sock]), "admin")
        await self._stopped.wait()
        return self.exit_code

    def _spawn(self, coro, name: str) -> asyncio.Task:
        """A loop task; its failure is never silent (see _task_done)."""
        task = self.loop.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        """A boot error or the end of an essential task (servers, control, signals, tick) stops the
        supervisor; a bug in a per-child task is logged and published, and serving goes on."""
        self._tasks.discard(task)
        if task.cancelled() or self.stopping:
            return
        exc = task.exception()
        name = task.get_name()
        if isinstance(exc, BootError):
            self.halt(str(exc))
        elif name in ESSENTIAL or (name == "boot" and exc is not None):
            log.error("essential task %s ended (%r); stopping", name, exc, exc_info=exc)
            self.exit_code = 70
            self._spawn(self.shutdown("error"), "shutdown")
        elif exc is not None:
            log.error("internal error in task %s (serving goes on)", name, exc_info=exc)
            self.events.publish({"type": "internal_error", "task": name, "error": repr(exc)[:300]})

    def halt(self, why: str) -> None:
        """Boot failed in a way retrying cannot fix: say why, stop everything, exit 1."""
        if self.stopping:
            return
        log.error("boot failed: %s", why)
        print(f"understudy: boot failed: {why}", file=sys.stderr, flush=True)
        self.exit_code = 1
        self._spawn(self.shutdown("error"), "shutdown")

    async def _boot(self) -> None:
        """Daemons (loaded) and spawn server (torch imported) side by side, then every engine slot;
        children re-adopted from a previous supervisor (run()) are not started again."""
        self.records_ready = True
        self.write_state()
        spawn = self.loop.create_task(self.start_spawn_server() if self.spawn_proc is None else asyncio.sleep(0))
        try:
            if self.daemons:
                await self.boot_daemons()
        finally:
            if not spawn.done() and (self.stopping or any(d.state != State.READY for d in self.daemons)):
                spawn.cancel()
        await spawn
        for slot in self.engines.values():
            if slot.state == State.STOPPED:  # not re-adopted
                self.start_engine(slot)
        self.booted = True

    # ------------------------------------------------------------------ events
    async def _signal_loop(self) -> None:
        while True:
            sig = await self._signals.get()
            log.info("received %s", signal.Signals(sig).name)
            if sig in (signal.SIGTERM, signal.SIGINT) and not self.stopping:
                self._spawn(self.shutdown(signal.Signals(sig).name), "shutdown")
            elif sig == signal.SIGHUP:
                log.info("SIGHUP: config reload is not supported; use `understudy rollout` to restart engines")

    async def _control_loop(self) -> None:
        while True:
            msg = await self.control.recv()
            if msg is None:
                continue
            try:
                self.on_engine_message(msg)
            except Exception:  # one bad message must not stop the node
                log.exception("control message from %s:%s dropped: %s", msg.engine, msg.incarnation,
                              str(msg.model_dump())[:200])

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.tick(time.monotonic())
            except OSError as e:  # e.g. EMFILE: the node keeps serving; the next tick tries again
                self._tick_errors = getattr(self, "_tick_errors", 0) + 1
                if self._tick_errors in (1, 10, 100) or self._tick_errors % 1000 == 0:
                    log.error("tick failed (%d times so far): %r; serving goes on", self._tick_errors, e)

    async def _primary_exit_loop(self, period_s: float) -> None:
        """Fail over as soon as the primary starts to exit, not when its pidfd fires after teardown."""
        while True:
            await asyncio.sleep(period_s)
            up = self.table.primary
            slot = self.engines.get(up.name) if up is not None else None
            if slot is not None and slot.pid and not self.stopping and is_exiting(slot.pid):
                self.on_engine_exit(slot, slot.incarnation, slot.pid)

    def tick(self, now: float) -> None:
        """Timeouts, probes, watchdog, orphan reaping."""
        if not self.stopping:
            for slot in list(self.engines.values()):
                self.check_engine_timers(slot, now)
            for d in self.daemons:
                self.check_daemon(d, now)
        else:
            for slot in self.engines.values():
                self.check_drain_timeout(slot, now)
        self.feed_watchdog(now)
        if now - self._last_reap >= 1.0:
            self._last_reap = now
            known = {s.pid for s in self.all_slots() if s.pid} | self.pending_reap
            sp = self.spawn_proc
            if sp is not None:
                known.add(sp.pid)
            for pid, rc in reap_orphans(known):
                log.debug("reaped adopted process %d (%s)", pid, rc)

    def serving(self) -> bool:
        """A READY primary is routed."""
        p = self.table.primary
        slot = self.engines.get(p.name) if p is not None else None
        return slot is not None and slot.state == State.READY

    def feed_watchdog(self, now: float) -> None:
        """WATCHDOG=1 every WATCHDOG_USEC/2 while the node serves or progresses (supervisor/watchdog.py);
        a stuck node is said so once, and left for systemd to restart."""
        feed = self.stopping or self.watchdog_gate.should_feed(now, self.serving())
        if not feed and not self.stuck:
            secs = self.watchdog_gate.stuck_for(now, False)
            why = f"stuck: no READY primary and no progress for {secs:.0f}s ({self.table.not_ready_reason})"
            log.error("%s; no longer feeding the systemd watchdog", why)
            self.notifier.status(why[:400])
        if self.stuck != (not feed):
            self.stuck = not feed
            self.write_state()
        wd = self.notifier.watchdog_interval_s
        if feed and wd is not None and now - self._last_watchdog >= wd:
            self._last_watchdog = now
            self.notifier.watchdog()

    # ------------------------------------------------------------------ shared helpers
    def all_slots(self) -> list[Slot]:
        return [*self.daemons, *self.engines.values()]

    def transition(self, slot: Slot, new: State, reason: str = "") -> None:
        """Apply, log, publish and persist one state transition."""
        if slot.state == new:
            return
        old = slot.set_state(new)
        if reason:
            slot.reason = reason
        if new != State.FATAL:
            self.watchdog_gate.progress(time.monotonic())
        role = getattr(slot, "role", None)
        rtxt = f" ({role.value})" if role else ""
        log.info("%s%s: %s -> %s%s", slot.name, rtxt, old.value, new.value, f": {reason}" if reason else "")
        self.events.publish({"type": "transition", "engine": slot.name, "from": old.value, "to": new.value,
                             "role": role.value if role else None, "epoch": self.epoch, "reason": reason,
                             "kind": "engine" if isinstance(slot, EngineSlot) else "daemon"})
        if isinstance(slot, EngineSlot):
            self.metrics.set_engine_state(slot.name, new.value, [s.value for s in State])
        self.refresh_gauges()
        self.write_state()

    def refresh_gauges(self) -> None:
        serving = [s for s in self.engines.values() if s.role == Role.PRIMARY and s.state == State.READY]
        standby = [s for s in self.engines.values() if s.role == Role.STANDBY and s.state == State.READY]
        self.metrics.active_engines.set(len(serving) if self.table.primary else 0)
        self.metrics.standby_ready.set(len(standby))
        self.metrics.epoch.set(self.epoch)
        if (self.booted or serving) and not self.stuck:
            self.notifier.status(self.roles_text())

    def roles_text(self) -> str:
        parts = [f"{s.name}={s.role.value}/{s.state.value}" for s in self.engines.values()]
        drained = " drained" if self.table.drained else ""
        why = "" if self.table.primary is not None else f"; not ready: {self.table.not_ready_reason}"
        return (f"epoch {self.epoch}: " + " ".join(parts) + drained + why)[:400]

    def write_state(self) -> None:
        """``state.json`` by atomic rename (0600)."""
        try:
            data = json.dumps(self.status_dict(), indent=1, default=str)
            tmp = self.rd / f".state.json.{os.getpid()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(data)
            os.replace(tmp, self.rd / "state.json")
        except OSError as e:
            log.warning("cannot write state.json: %s", e)
        if self.records_ready:
            write_records(self.rd, snapshot(self))

    def log_path(self, name: str) -> Path:
        return self.rd / "logs" / f"{name}.log"

    # ------------------------------------------------------------------ shutdown
    async def shutdown(self, why: str) -> None:
        """Drain, stop engines, stop daemons, stop servers; then let run() return."""
        if self.stopping:
            return
        self.stopping = True
        self.table.stop()
        log.info("stopping (%s): draining engines", why)
        self.notifier.stopping(f"stopping ({why})")
        if not self.boot_task.done():
            self.boot_task.cancel()
        spawn = self.spawn_proc
        if spawn is not None:  # no spawns from now on; let it exit while engines drain
            kill_group(spawn.pid, signal.SIGTERM)
        for slot in self.engines.values():
            self.stop_engine(slot)
        f = self.cfg.failover
        await self._wait_down(list(self.engines.values()), f.drain_timeout_s + f.stop_timeout_s)
        await self.stop_spawn_server()
        for d in self.daemons:
            self.stop_daemon(d)
        await self._wait_down(self.daemons, f.stop_timeout_s + 2)
        for slot in self.all_slots():
            if slot.pid:
                kill_group(slot.pid)
        for srv in self.servers:
            srv.should_exit = True
        await asyncio.sleep(0.2)
        self.final = True
        self.write_state()
        await self.http.aclose()
        self.control.close()
        self.events.close()
        log.info("stopped")
        self._stopped.set()

    async def _wait_down(self, slots: list, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(s.pid for s in slots):
            await asyncio.sleep(0.05)


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"
