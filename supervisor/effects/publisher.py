"""Publish, Measure and Notify: events on the zmq PUB socket, the metrics that count them, the
serving figures, systemd's notify messages and the operator's lines on stderr."""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from supervisor.core.actions import Measure, Notify, Publish
from supervisor.core.model import Node
from supervisor.core.states import Role, State
from supervisor.core.why import roles_text
from supervisor.effects.bus import EventBus
from supervisor.effects.sdnotify import Notifier
from supervisor.metrics import Metrics

STATES = [s.value for s in State]


class Publisher:
    def __init__(self, bus: EventBus, metrics: Metrics, notifier: Notifier, ready_line: str,
                 when_serving: Sequence[Callable[[], None]] = ()) -> None:
        self.bus, self.metrics, self.notifier = bus, metrics, notifier
        self.ready_line = ready_line  # "ready: serving MODEL on URL/v1 (e.g. curl ...)"
        self.when_serving = when_serving  # called once, after the ready line
        self._status = ""

    def publish(self, a: Publish) -> None:
        ev = a.event
        kind = ev["type"]
        if kind == "transition" and ev.get("kind") == "engine":
            self.metrics.set_engine_state(ev["engine"], ev["to"], STATES)
        elif kind == "transition" and ev.get("kind") == "daemon":
            for state in STATES:
                self.metrics.daemon_state.labels(daemon=ev["engine"], state=state).set(1 if state == ev["to"] else 0)
            if ev["to"] == "STARTING":
                self.metrics.daemon_starts.labels(daemon=ev["engine"]).inc()
        elif kind == "failover":
            self.metrics.failovers.labels(reason=ev["reason"]).inc()
        elif kind == "fatal_retry":
            self.metrics.fatal_retries.labels(engine=ev["engine"]).inc()
        elif kind == "recovered":
            self.metrics.recovery_seconds.observe(ev["seconds"])
        elif kind == "continuations":
            for n in ev["recomputed"]:
                self.metrics.continuation_recomputed.observe(n)
        self.bus.publish(dict(ev))

    def measure(self, a: Measure) -> None:
        v, m = a.values, self.metrics
        if a.what == "startup":
            for phase, secs in v["phases"].items():
                m.startup_phase.labels(phase=phase).observe(secs)
            if v["weights_source"]:
                m.count_weights_source(v["weights_source"])
        elif a.what == "heartbeat":
            m.record_heartbeat(a.name, v["heartbeat"], v["previous"], v["at"])
        elif a.what == "promotion":
            m.kv_adopted_blocks.set(v.get("adopted_blocks") or 0)
            m.kv_promotion_seconds.observe(float(v.get("seconds") or 0))
        elif a.what == "resident":
            m.daemon_resident.labels(rank=str(v["rank"])).set(v["bytes"])

    def notify(self, a: Notify) -> None:
        if a.what == "ready":  # the first primary: tell systemd and the operator where to send requests
            self.notifier.ready(a.text)
            self._status = a.text
            print(f"understudy: {self.ready_line}", file=sys.stderr, flush=True)
            for call in self.when_serving:
                call()
        elif a.what == "stuck":
            self.notifier.status(a.text)
        elif a.what == "stopping":
            self.notifier.stopping(a.text)
        elif a.what == "boot failed":
            print(f"understudy: boot failed: {a.text}", file=sys.stderr, flush=True)

    def gauges(self, node: Node) -> None:
        """Level figures, after each pass that changed something: active engines, READY standbys,
        the epoch; systemd's STATUS line when it changed (not while stuck: that one says why)."""
        engines = node.engines.values()
        serving = [s for s in engines if s.role == Role.PRIMARY and s.state == State.READY]
        self.metrics.active_engines.set(len(serving) if node.primary else 0)
        self.metrics.standby_ready.set(sum(s.role == Role.STANDBY and s.state == State.READY for s in engines))
        self.metrics.epoch.set(node.epoch)
        text = roles_text(node)
        if (node.booted or serving) and not node.stuck and text != self._status:
            self._status = text
            self.notifier.status(text)
