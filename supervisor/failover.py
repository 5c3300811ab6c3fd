"""Failover: promote a READY standby (epoch + 1) and switch the router, or hold requests."""
from __future__ import annotations

import logging
import time

from supervisor.routing import Upstream
from supervisor.slots import EngineSlot, served_count
from supervisor.states import Role, State

log = logging.getLogger("understudy")


class FailoverOps:
    """Mixin of Supervisor (see arbiter.py for the attributes it uses)."""

    def ready_standby(self) -> EngineSlot | None:
        for s in self.engines.values():
            if s.state == State.READY and s.role == Role.STANDBY and s.pid:
                return s
        return None

    def failover(self, dead: EngineSlot, reason: str, t_detect: float) -> None:
        """The primary is gone (already fenced): promote a READY standby or hold requests."""
        if self.table.primary is not None and self.table.primary.name == dead.name:
            self.table.mark_lost(self.table.primary.epoch)
        standby = self.ready_standby()
        if standby is not None:
            self.promote(standby, reason, t_detect, dead.name)
            return
        self.pending_failover = (reason, t_detect, dead.name)
        self.table.set_primary(None, f"failover after {dead.name} {reason}: no READY standby yet")
        log.warning("failover: %s lost (%s) and no standby is READY; holding requests up to %gs",
                    dead.name, reason, self.cfg.failover.hold_timeout_s)
        self.refresh_gauges()
        self.write_state()

    def promote(self, slot: EngineSlot, reason: str, t_detect: float, old: str) -> None:
        """``slot`` serves from now on (epoch + 1)."""
        self.epoch += 1
        for s in self.engines.values():
            if s is not slot and s.role == Role.PRIMARY:
                s.role = Role.STANDBY
        slot.role = Role.PRIMARY
        slot.last_probe = time.monotonic()
        slot.probe_served = served_count(slot)
        self.table.set_primary(Upstream(slot.url, slot.name, self.epoch))
        secs = time.monotonic() - t_detect
        log.info("%s is primary (epoch %d, %s%s)", slot.name, self.epoch, reason,
                 f", {secs * 1000:.1f} ms after detection" if reason != "boot" else "")
        if reason != "boot":
            self.metrics.failovers.labels(reason=reason).inc()
            self.table.start_failover_clock(self.epoch, t_detect)  # the router observes failover_seconds
            ev = {"type": "failover", "reason": reason, "from": old, "to": slot.name, "epoch": self.epoch,
                  "seconds": secs, "ts": time.time()}
            self.failovers.append(ev)
            self.events.publish(dict(ev))
        else:
            self.events.publish({"type": "promoted", "engine": slot.name, "epoch": self.epoch})
        self.refresh_gauges()
        self.write_state()
        if not self.announced:
            self.announced = True
            self.announce()
