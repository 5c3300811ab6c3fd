"""Engine health while alive: heartbeat and startup timeouts, drain timeouts, canary probes of the
primary (progress under load counts as healthy), and fencing of an engine judged bad."""
from __future__ import annotations

import logging
import time

from supervisor.canary import compare, run_canary
from supervisor.launch import kill_group
from supervisor.slots import EngineSlot, served_count
from supervisor.states import RUNNING, Role, State

log = logging.getLogger("understudy")


class HealthOps:
    """Mixin of Supervisor (see arbiter.py for the attributes it uses)."""

    def check_engine_timers(self, slot: EngineSlot, now: float) -> None:
        f = self.cfg.failover
        if slot.state not in RUNNING or slot.pid is None:
            return
        if slot.state == State.DRAINING:
            self.check_drain_timeout(slot, now)
            return
        if slot.last_heartbeat is not None and now - slot.last_heartbeat > f.heartbeat_timeout_s:
            self.fail_engine(slot, f"hang: no heartbeat for {now - slot.last_heartbeat:.1f}s")
            return
        if slot.state != State.READY and now - slot.started_at > f.startup_timeout_s:
            self.fail_engine(slot, f"startup timeout: not READY after {f.startup_timeout_s:g}s")
            return
        if slot.state == State.READY and slot.role == Role.PRIMARY and not slot.probing \
                and now - slot.last_probe >= f.probe_interval_s:
            self._maybe_probe(slot, now)

    def check_drain_timeout(self, slot: EngineSlot, now: float) -> None:
        if slot.state == State.DRAINING and slot.pid and now - slot.state_since > self.cfg.failover.drain_timeout_s:
            log.warning("%s: still draining after %.0fs, SIGKILL", slot.name, now - slot.state_since)
            kill_group(slot.pid)
            slot.state_since = now  # once per timeout

    def _maybe_probe(self, slot: EngineSlot, now: float) -> None:
        """Probe the primary unless it served requests since the last probe (progress = healthy)."""
        served = served_count(slot)
        progressed = served > slot.probe_served >= 0
        slot.last_probe, slot.probe_served = now, served
        if progressed:
            slot.probe_failures = 0
            return
        slot.probing = True
        self._spawn(self._probe(slot, slot.incarnation), f"probe-{slot.name}")

    async def _probe(self, slot: EngineSlot, inc: int) -> None:
        try:
            res = await run_canary(self.http, slot.url, self.model_name, self.cfg.canary.prompt,
                                   self.cfg.canary.max_tokens, self.cfg.failover.probe_timeout_s)
        finally:
            slot.probing = False
        if slot.incarnation != inc or slot.state != State.READY:
            return
        golden = self.golden.get(self.fingerprint)
        problem = res.error if not res.ok else (compare(golden, res) if golden else None)
        if problem is None:
            slot.probe_failures = 0
            return
        slot.probe_failures += 1
        log.warning("%s: probe failed (%d/%d): %s", slot.name, slot.probe_failures,
                    self.cfg.failover.probe_failures, problem)
        if slot.probe_failures >= self.cfg.failover.probe_failures:
            self.fail_engine(slot, f"probe: {problem}")

    def fail_engine(self, slot: EngineSlot, reason: str) -> None:
        """A live engine judged bad: FAILED, fenced (SIGKILL its group); the exit does the rest."""
        if slot.state not in RUNNING:
            return
        slot.down_since = slot.down_since or time.monotonic()
        self.transition(slot, State.FAILED, reason)
        if slot.pid:
            kill_group(slot.pid)
            up = self.table.primary
            if up is not None and up.name == slot.name and not self.stopping:
                self.failover(slot, reason.split(":")[0], slot.down_since)  # fenced: switch now
        else:
            self.schedule_restart(slot)
