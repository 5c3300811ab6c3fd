"""The supervisor: one asyncio loop (gunicorn's arbiter, controller-runtime's reconcile loop).

Sources (child exits by pidfd and the primary's exit poll, the control channel, signals, admin
requests, the answers of effects, the clock) only record events. Each pass takes every event
recorded since the last one (supervisor/core/reconcile.py: a pure function of the node, the events
and the time) and decides actions; supervisor/effects/ carry them out and report back as events.
state.json and children.json are written once per pass. This file wires them and runs the passes."""
from __future__ import annotations

import asyncio
import importlib
import logging
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from wire.block_keys import key_root
from supervisor.admin.gate import bearer_gate
from supervisor.admin.requests import AdminRequests
from supervisor.admin.status_view import status_view
from wire import node_secret
from wire.secret_file import ensure_token
from supervisor.config import UnderstudyConfig
from supervisor.core.events import Event, StopAsked
from supervisor.core.model import Node, Settings, new_node
from supervisor.core.reconcile import reconcile, wake_in
from supervisor.core.why import not_ready_text
from supervisor.effects.bus import EventBus
from supervisor.effects.canary import GoldenStore, model_fingerprint
from supervisor.effects.checks import Checks
from supervisor.effects.child_configs import ChildConfigs
from supervisor.effects.control import ControlChannel
from supervisor.effects.launcher import Launcher
from supervisor.effects.pidwatch import become_subreaper
from supervisor.effects.publisher import Publisher
from supervisor.effects.reaper import Reaper
from supervisor.effects.records_file import read_records
from supervisor.effects.runner import Effects
from supervisor.effects.sdnotify import Notifier
from supervisor.effects.servers import bind_tcp, listener_limits, make_server, raise_open_files_limit
from supervisor.effects.socket_activation import ActivationError, inherited_sockets
from supervisor.effects.state_files import StateFiles
from supervisor.effects.survey import Surveyor
from supervisor.errors import BootError
from supervisor.loop_watch import LoopWatch
from supervisor.metrics import Metrics
from supervisor.router.app import build_router
from supervisor.router.routing import RoutingTable
from supervisor.router.upstream import Client
from supervisor.sources import on_signal, primary_exit_poll, said

log = logging.getLogger("understudy")

FINAL_GRACE_S = 0.2  # the servers finish their last responses


class Supervisor:
    """Owns every child (through the node and its effects), the routing table and the two HTTP servers."""

    def __init__(self, cfg: UnderstudyConfig, model_path: Path, device: str) -> None:
        self.cfg, self.model_path, self.device = cfg, model_path, device
        self.rd = cfg.resolved_runtime_dir()
        self.external = cfg.engines.kind == "external"
        self.model_name = cfg.model.name or model_path.name
        self.metrics = Metrics()
        self.notifier = Notifier()
        self.table = RoutingTable()
        self.fingerprint = model_fingerprint(str(model_path), dtype=cfg.model.dtype, tp=cfg.model.tp_size,
                                             device=device, prompt=cfg.canary.prompt, n=cfg.canary.max_tokens,
                                             external=cfg.engines.external.command if self.external else None)
        self.exit_code = 0
        self.when_serving: list[Callable[[], None]] = []  # called once, when the first primary is ready
        self.inbox: list[Event] = []
        self._in_pass = False  # (a pass recording an event runs no pass inside itself)

    # ------------------------------------------------------------------ setup
    def prepare(self) -> None:
        """Everything that can fail before a child starts: dirs, ports, token, sockets."""
        from daemon.runtime_dir import ensure_private_dir
        from supervisor.effects.stale import RuntimeDirInUse, check_and_clean
        try:
            ensure_private_dir(self.rd)
        except (OSError, ValueError, RuntimeError) as e:
            raise BootError(f"runtime_dir: {e}") from None
        records = read_records(self.rd)
        try:  # with records, live children are re-adopted (or stopped) by the first pass instead of killed here
            check_and_clean(self.rd, kill=records is None)
        except RuntimeDirInUse as e:
            raise BootError(str(e)) from None
        (self.rd / "logs").mkdir(mode=0o700, exist_ok=True)
        self.router_sock, self.admin_sock = self._listening_sockets()
        self.router_url, self.admin_url = _url(self.router_sock), _url(self.admin_sock)
        self.token_file = self.cfg.resolved_token_file()
        self.token = ensure_token(self.token_file)
        self.golden = GoldenStore(self.rd)
        self.zctx = zmq.Context()
        self.bus = EventBus(self.zctx, str(self.rd / "events.sock"))
        self.control = ControlChannel(self.zctx, str(self.rd / "control.sock"))
        self.node_secret = (node_secret.HEADER, node_secret.ensure(self.rd).encode())  # engines answer only it
        self.http = Client(timeout_s=10.0, max_connections=64, local_headers=[self.node_secret])  # health, canaries
        cfg = self.cfg
        self.configs = ChildConfigs(cfg, self.model_path, self.device, self.rd, self.control.endpoint)
        spawn_server = not self.external and cfg.engines.spawn == "server"
        ranks = cfg.daemon_ranks()  # (ours, or an external engine's own: engines.external.daemon_command)
        engines = cfg.engines.slot_names()
        settings = Settings(cfg.failover.for_device(self.device), cfg.daemons.load_timeout_s, self.fingerprint,
                            cfg.model.tp_size, self.external, spawn_server, shared_kv=cfg.shares_kv())
        self.node: Node = new_node(settings, engines, [self.configs.daemon_ready(r) for r in range(ranks)],
                                   self.configs.wanted(engines, ranks, spawn_server, self.fingerprint), records,
                                   now=time.monotonic())
        self.table.explain = lambda: not_ready_text(self.node.engines.values(), time.monotonic())
        self.admin = AdminRequests(self.node, self.status_dict, self.metrics, self.record)
        self.state_files = StateFiles(self.rd, self.status_dict)
        self.fixed = {"router_url": self.router_url, "admin_url": self.admin_url, "runtime_dir": str(self.rd),
                      "events": self.bus.endpoint, "token_file": str(self.token_file),
                      "model": {"path": str(self.model_path), "name": self.model_name, "device": self.device,
                                "dtype": cfg.model.dtype, "tp_size": cfg.model.tp_size, "fingerprint": self.fingerprint,
                                "deterministic": cfg.engines.deterministic}}

    def _listening_sockets(self) -> tuple[socket.socket, socket.socket]:
        """The data and admin sockets: handed over (systemd socket activation), else bound here."""
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
        router = held.get("router") or bind_tcp(self.cfg.router.host, self.cfg.router.port, "router")
        try:
            admin = held.get("admin") or bind_tcp(self.cfg.admin.host, self.cfg.admin.port, "admin")
        except Exception:
            router.close()
            raise
        return router, admin

    def _effects(self) -> Effects:
        launcher = Launcher(self.configs, self.record)
        ready = (f"ready: serving {self.model_name} on {self.router_url}/v1 (e.g. curl {self.router_url}/v1/completions "
                 f"-H 'Content-Type: application/json' -d '{{\"model\": \"{self.model_name}\", \"prompt\": \"Hello\", "
                 f"\"max_tokens\": 8}}'); admin {self.admin_url} (token in {self.token_file})")
        return Effects(table=self.table, launcher=launcher, reaper=Reaper(launcher),
                       checks=Checks(self.cfg, self.model_name, self.http, self.golden, self.fingerprint,
                                     launcher.spawn_client),
                       surveyor=Surveyor(self.rd, self.http, self.external, self.configs.daemon_ready),
                       publisher=Publisher(self.bus, self.metrics, self.notifier, ready, self.when_serving),
                       control=self.control,
                       notifier=self.notifier, record=self.record, answer=self.admin.answer,
                       persist=self.state_files.write, finish=self._finish)

    # ------------------------------------------------------------------ the loop
    async def run(self) -> int:
        """Serve until a signal stops us; returns the process exit code."""
        self.loop = asyncio.get_running_loop()
        self._loop_watch = LoopWatch(self.loop)  # (a stall of the loop is a warning: supervisor/loop_watch.py)
        self._loop_watch.start()
        self._wake, self._stopped, self._adopted = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self._servers: list = []
        self._essential: set[asyncio.Task] = set()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self.loop.add_signal_handler(sig, on_signal, sig, self.record)
        become_subreaper()
        self.effects = self._effects()
        self._essential_task(self._passes(), "passes")
        self.control.listen(self.loop, lambda msg: said(msg, self.record))
        if self.cfg.failover.exit_poll_ms > 0:
            self._essential_task(primary_exit_poll(self.node, self.cfg.failover.exit_poll_ms / 1000, self.record),
                                 "primary-exit")
        await self._serve()
        await self._stopped.wait()
        return self.exit_code

    def record(self, event: Event, at_once: bool = False) -> None:
        """What every source does: note the event and wake the loop. ``at_once`` (a failover's events:
        the primary's exit, a standby's answer to "promote"): the pass runs now, in this loop round,
        not in the next one, which under load is a burst of lost streams later."""
        self.inbox.append(event)
        if not at_once or self._in_pass:
            self._wake.set()
            return
        try:
            self._pass()
        except Exception:  # (as when the passes' task ends: never silent, the node stops)
            log.exception("a pass failed; stopping")
            self.record(StopAsked("error", exit_code=70))

    async def _passes(self) -> None:
        """One pass per wake-up: every event recorded meanwhile, or the clock (timers, probes)."""
        while not self._stopped.is_set():
            if not self.inbox:
                try:
                    await asyncio.wait_for(self._wake.wait(), wake_in(self.node))
                except TimeoutError:
                    pass
            self._wake.clear()
            self._pass()

    def _pass(self) -> None:
        """Every event recorded so far, through reconcile, and its actions carried out."""
        self._in_pass = True
        try:
            events, self.inbox = self.inbox, []
            actions = reconcile(self.node, events, time.monotonic(), time.time())
            try:
                self.effects.carry_out(actions)
                self.effects.after_pass(self.node)
            except Exception:  # noqa: BLE001 (a bug in an effect: logged, the node goes on)
                log.exception("internal error carrying out %s", [a.brief() for a in actions])
        finally:
            self._in_pass = False
        if self.node.phase != "adopting":
            self._adopted.set()

    async def _serve(self) -> None:
        """The data plane once re-adoption has decided (connections wait in the backlog meanwhile),
        then the admin API; its framework (fastapi: 0.3 s on the GPU host) is imported off the loop."""
        await self._adopted.wait()
        if self.node.stopping:
            return
        lvl = "warning" if self.cfg.log_level != "debug" else "info"
        r = self.cfg.router
        router_app = build_router(self.table, self.metrics, hold_timeout_s=self.cfg.failover.hold_timeout_s,
                                  retry_after_s=self.cfg.failover.retry_after_s,
                                  upstream_timeout_s=r.upstream_timeout_s, max_connections=r.max_connections,
                                  # external engines: no batches (our engine's `/v1/continuations`), no block keys
                                  migration=r.migration if not self.external
                                  else r.migration.model_copy(update={"batch": False}),
                                  publish=self.bus.publish, limits=self.cfg.limits,
                                  body_timeout_s=self.cfg.limits.body_timeout_s,
                                  key_chain=None if self.external else
                                  (key_root(self.cfg.engines.deterministic), self.cfg.engines.kv_block_size),
                                  local_headers=[self.node_secret], external=self.external)
        router_limits, admin_limits = listener_limits(self.cfg, raise_open_files_limit())
        self._servers.append(make_server(router_app, self.router_sock, lvl, router_limits, "router"))
        self._essential_task(self._servers[0].serve(sockets=[self.router_sock]), "router")
        admin = await asyncio.to_thread(importlib.import_module, "supervisor.admin.api")
        if not self.node.stopping:
            self._servers.append(make_server(admin.build_admin(self.admin, self.token), self.admin_sock, lvl,
                                             admin_limits, "admin", bearer_gate(self.token)))
            self._essential_task(self._servers[1].serve(sockets=[self.admin_sock]), "admin")

    def _essential_task(self, coro, name: str) -> None:  # noqa: ANN001
        task = self.loop.create_task(coro, name=name)
        self._essential.add(task)
        task.add_done_callback(self._essential_done)

    def _essential_done(self, task: asyncio.Task) -> None:
        """The end of an essential task (servers, control channel, exit poll, passes) stops the node."""
        self._essential.discard(task)
        if task.cancelled() or self.node.stopping:
            return
        log.error("essential task %s ended (%r); stopping", task.get_name(), task.exception(),
                  exc_info=task.exception())
        self.record(StopAsked("error", exit_code=70))

    async def _finish(self, exit_code: int) -> None:
        """The last stage of a stop (supervisor/core/shutdown.py): close everything and let run() return."""
        for srv in self._servers:
            srv.should_exit = True
        await asyncio.sleep(FINAL_GRACE_S)
        self.effects.cancel()
        self.state_files.write(self.node)
        self.admin.refuse_waiting()
        await self.http.aclose()
        self.control.close()
        self.bus.close()
        log.info("stopped")
        self._loop_watch.stop()
        self.exit_code = exit_code
        self._stopped.set()
        self._adopted.set()
        for task in list(self._essential):
            task.cancel()


    def status_dict(self) -> dict[str, Any]:
        """The ``GET /status`` body (and state.json)."""
        return status_view(self.node, self.fixed, time.monotonic())


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"
