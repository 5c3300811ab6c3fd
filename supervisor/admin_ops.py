"""Admin actions (promote, drain, undrain, restart, rollout) and the status view."""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from typing import Any

from supervisor.errors import AdminError
from supervisor.slots import EngineSlot
from supervisor.states import Role, State

log = logging.getLogger("understudy")


class AdminOps:
    """Mixin of Supervisor (see arbiter.py for the attributes it uses)."""

    # ------------------------------------------------------------------ views
    def status_dict(self) -> dict[str, Any]:
        now = time.monotonic()
        p = self.table.primary if hasattr(self, "table") else None
        return {
            "pid": os.getpid(), "epoch": self.epoch, "primary": p.name if p else None,
            "drained": self.table.drained, "stopping": self.stopping, "stopped": self.final,
            "router_url": self.router_url, "admin_url": self.admin_url,
            "runtime_dir": str(self.rd), "events": f"ipc://{self.rd}/events.sock",
            "token_file": str(getattr(self, "token_file", "")) or None,
            "model": {"path": str(self.model_path), "name": self.model_name, "device": self.device,
                      "dtype": self.cfg.model.dtype, "tp_size": self.cfg.model.tp_size,
                      "fingerprint": self.fingerprint},
            "engines": [self._engine_view(s, now) for s in self.engines.values()],
            "daemons": [{"name": d.name, "rank": d.rank, "state": d.state.value, "pid": d.pid,
                         "resident_bytes": d.resident_bytes, "fingerprint": d.fingerprint,
                         "weights_finite": d.weights_finite,
                         "socket": d.socket_path, "reason": d.reason, "last_exit": d.last_exit}
                        for d in self.daemons],
            "spawn_server": {"pid": self.spawn_proc.pid} if self.spawn_proc else None,
            "recent_failovers": list(self.failovers)[-10:],
            "rollout": self.rollout_state,
            "not_ready": None if p is not None else self.table.not_ready_reason,
            "watchdog": {"stuck": self.stuck, "stuck_after_s": self.watchdog_gate.stuck_after_s,
                         "since_progress_s": round(now - self.watchdog_gate.last_progress, 3)},
        }

    def _engine_view(self, s: EngineSlot, now: float) -> dict[str, Any]:
        return {"name": s.name, "role": s.role.value, "state": s.state.value, "pid": s.pid,
                "incarnation": s.incarnation, "url": s.url or None,
                "weights_source": s.weights_source, "startup_phases": s.phases,
                "state_for_s": round(now - s.state_since, 3),
                "heartbeat_age_s": round(now - s.last_heartbeat, 3) if s.last_heartbeat else None,
                "heartbeat": {k: v for k, v in s.heartbeat.items()}, "reason": s.reason,
                "last_exit": s.last_exit, "recent_failures": len(s.policy.failures),
                "crash_loop": s.crash_loop,
                "next_try_in_s": round(max(s.retry_at - now, 0.0), 3) if s.retry_at is not None else None}

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def announce(self) -> None:
        """First primary READY: tell systemd and the operator where to send requests."""
        self.notifier.ready(self.roles_text())
        print(f"understudy: ready: serving {self.model_name} on {self.router_url}/v1 "
              f"(e.g. curl {self.router_url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{self.model_name}\", \"prompt\": \"Hello\", \"max_tokens\": 8}}'); "
              f"admin {self.admin_url} (token in {self.token_file})", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ actions
    def _primary_slot(self) -> EngineSlot | None:
        p = self.table.primary
        return self.engines.get(p.name) if p else None

    async def admin_promote(self) -> dict[str, Any]:
        """Planned switchover: the READY standby serves; the old primary drains and comes back as standby."""
        self._not_stopping()
        standby = self.ready_standby()
        if standby is None:
            raise AdminError(409, "no READY standby to promote (" + ", ".join(
                f"{s.name}: {s.role.value} {s.state.value}" for s in self.engines.values()) + ")")
        old = self._primary_slot()
        self.promote(standby, "promote", time.monotonic(), old.name if old else "")
        if old is not None and old is not standby:
            self.stop_engine(old, restart=True)
        return {"primary": standby.name, "epoch": self.epoch, "previous": old.name if old else None}

    async def admin_set_drained(self, drained: bool) -> dict[str, Any]:
        """Node drain: /readyz fails so the load balancer moves away; requests still get served.
        Undrain (False) turns /readyz back on."""
        self.table.drained = drained
        log.info("node %s by admin", "drained" if drained else "undrained")
        self.events.publish({"type": "drained", "drained": drained})
        self.refresh_gauges()
        self.write_state()
        return {"drained": drained}

    async def admin_restart(self, name: str, force: bool = False) -> dict[str, Any]:
        """Restart one engine (resets FATAL); the primary is switched over first."""
        self._not_stopping()
        slot = self.engines.get(name)
        if slot is None:
            raise AdminError(404, f"unknown engine {name!r} (engines: {', '.join(self.engines)})")
        slot.policy.reset()
        if slot.role == Role.PRIMARY and self.table.primary and self.table.primary.name == name:
            if self.ready_standby() is not None:
                return {"restarting": name, **(await self.admin_promote())}
            if not force:
                raise AdminError(409, f"{name} is the primary and no standby is READY: a restart would hold "
                                      "traffic; retry when a standby is READY, or pass force=true")
        was = slot.state.value
        self.stop_engine(slot, restart=True)
        return {"restarting": name, "was": was}

    async def admin_rollout(self) -> dict[str, Any]:
        """Restart every engine in turn (standbys first, then a switchover), never dropping traffic."""
        self._not_stopping()
        if self.rollout_state and self.rollout_state.get("running"):
            raise AdminError(409, "a rollout is already running")
        if self.ready_standby() is None:
            raise AdminError(409, "rollout needs a READY standby so that traffic never waits")
        self.rollout_state = {"running": True, "done": [], "started": time.time()}
        try:
            await self._restart_spawn_server()
            timeout = self.cfg.failover.startup_timeout_s
            standbys = [s for s in self.engines.values() if s.role == Role.STANDBY]
            for s in standbys:
                self.stop_engine(s, restart=True)
                await self._wait_ready(s, timeout)
                self.rollout_state["done"].append(s.name)
            old = self._primary_slot()
            if old is not None:
                await self.admin_promote()
                await self._wait_ready(old, timeout)
                self.rollout_state["done"].append(old.name)
            return {"restarted": self.rollout_state["done"], "primary": self.table.primary.name
                    if self.table.primary else None, "epoch": self.epoch}
        finally:
            self.rollout_state["running"] = False

    async def _restart_spawn_server(self) -> None:
        """New engine code is picked up by a fresh spawn server (running engines are adopted)."""
        if self.spawn_proc is None:
            return
        old, self.spawn_proc = self.spawn_proc, None
        from supervisor.launch import kill_group
        import signal
        kill_group(old.pid, signal.SIGTERM)
        await self.start_spawn_server()

    async def _wait_ready(self, slot: EngineSlot, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        await asyncio.sleep(0)
        while not (slot.state == State.READY and not slot.stop_requested):
            if slot.state == State.FATAL or time.monotonic() > deadline or self.stopping:
                raise AdminError(500, f"rollout stopped: {slot.name} is {slot.state.value} ({slot.reason})")
            await asyncio.sleep(0.05)

    def _not_stopping(self) -> None:
        if self.stopping:
            raise AdminError(409, "the supervisor is stopping")
