"""Playing the supervisor's pass (supervisor/core/reconcile.py) without processes: a node, a clock,
events written as short tuples, and the actions of each pass in the few words of ``brief()``.

Event tuples (``name`` is a child: "a", "b", "daemon-rank0", "spawn-server"):
    ("launched", name)           its Start succeeded (a new pid)      ("launch failed", name, why)
    ("exit", name)               its process exited                    ("exit read", name, rc)
    ("ready", name)              readiness: HTTP up and canary matched ("not listening", name)
    ("unanswered", name)         canary not answered yet              ("mismatch", name, reason)
    ("broken", name, why)        the engine says it cannot serve       ("health", name, problem | None)
    ("health not made", name, problem), ("ping not made", name): the supervisor was out of descriptors
    ("heartbeat", name, served)  ("stepping", name, steps): heartbeats of full slots, nothing finished  ("said", name, type, fields): e.g. a shared-KV answer "promoted"
    ("daemon ready", name[, kv_pool_id])  ("daemon loading", name)      ("ping", name, ok)
    ("ask", intent[, engine[, force]])                                ("stop", why)
    ("wait", seconds)            nothing but time passing
    ("surveyed", {pid: start time | None}[, spawn children])          ("survey failed", why)
    ("checked", {name: why})     ("check failed", why)                ("gone",): AwaitGone's groups are gone
"""
from __future__ import annotations

from typing import Any

from supervisor.config import FailoverSection
from supervisor.core import events as ev
from supervisor.core.adoption_plan import Wanted
from supervisor.core.model import Node, Settings, new_node
from supervisor.core.reconcile import reconcile
from supervisor.core.records import ChildRecord, ChildRecords

FAST = dict(heartbeat_timeout_s=1.5, probe_interval_s=0.5, probe_failures=2, backoff_base_s=0.1, backoff_max_s=1.0,
            flap_max=50, flap_window_s=120.0, drain_timeout_s=10.0, stop_timeout_s=5.0, startup_timeout_s=60.0,
            hold_timeout_s=20.0)
WANTED = Wanted(daemons={"daemon-rank0": "kd"}, engines={"a": "ke", "b": "ke"}, spawn_server="ks")
STEP_S = 0.01  # each pass is this much later than the previous one, unless ("wait", s) says otherwise


class Play:
    """A node and a clock. ``play(*events)`` runs one pass per event and returns the actions' briefs."""

    def __init__(self, engines: tuple[str, ...] = ("a", "b"), daemons: int = 1, spawn_server: bool = True,
                 records: ChildRecords | None = None, tp_size: int = 1, external: bool = False,
                 shared_kv: bool = False, **failover: Any) -> None:
        settings = Settings(FailoverSection(**{**FAST, **failover}), load_timeout_s=600.0, fingerprint="fp",
                            tp_size=tp_size, external=external, spawn_server=spawn_server, shared_kv=shared_kv)
        self.node: Node = new_node(settings, list(engines), [f"/rt/daemon-rank{r}.sock" for r in range(daemons)],
                                   WANTED, records, now=100.0)
        self.now, self.wall = 100.0, 1_000.0
        self.next_pid = 1000
        self.actions: list[Any] = []

    # ---- driving
    def play(self, *events: tuple) -> list[str]:
        """One pass per event (a pass with no event first); the briefs of every action decided."""
        out = [a.brief() for a in self._pass([])]
        for spec in events:
            out += [a.brief() for a in self._pass(self._events(spec))]
        return out

    def _pass(self, events: list) -> list:
        self.now += STEP_S
        self.wall += STEP_S
        actions = reconcile(self.node, events, self.now, self.wall)
        self.actions += actions
        return actions

    def _events(self, spec: tuple) -> list:
        kind, *args = spec
        if kind == "wait":
            self.now += args[0]
            self.wall += args[0]
            return []
        if kind in ("ask", "stop", "surveyed", "survey failed", "checked", "check failed", "gone"):
            return [self._node_event(kind, args)]
        name = args[0]
        c = self.node.child(name)
        inc = c.incarnation
        if kind == "launched":
            self.next_pid += 1
            return [ev.Launched(name, inc, self.next_pid, url=f"http://127.0.0.1:{self.next_pid}",
                                port=self.next_pid)]
        simple = {
            "launch failed": lambda: ev.LaunchFailed(name, inc, args[1]),
            "exit": lambda: ev.Exited(name, inc, c.pid),
            "exit read": lambda: ev.ExitRead(name, inc, self._reaped(name), args[1], log_line="last log line"),
            "ready": lambda: ev.ReadyChecked(name, inc, listening=True, answered=True),
            "not listening": lambda: ev.ReadyChecked(name, inc, listening=False),
            "unanswered": lambda: ev.ReadyChecked(name, inc, listening=True, error="ConnectError"),
            "mismatch": lambda: ev.ReadyChecked(name, inc, listening=True, answered=True, mismatch=args[1]),
            "broken": lambda: ev.ReadyChecked(name, inc, listening=True, broken=True, error=args[1]),
            "health": lambda: ev.HealthChecked(name, inc, args[1]),
            "health not made": lambda: ev.HealthChecked(name, inc, args[1], local=True),
            "heartbeat": lambda: ev.Said(name, inc, "heartbeat", {"served": args[1], "steps": args[1]}),
            "stepping": lambda: ev.Said(name, inc, "heartbeat", {"served": 0, "steps": args[1]}),
            "said": lambda: ev.Said(name, inc, args[1], args[2]),
            "daemon ready": lambda: ev.DaemonAnswered(name, inc, {"type": "ok", "daemon": {
                "state": "ready", "resident_bytes": 1000, "weights_finite": True,
                "fingerprint": {"content_digest": "d"}, "kv_pool_id": args[1] if len(args) > 1 else None}}),
            "daemon loading": lambda: ev.DaemonAnswered(name, inc, None, "ConnectionRefusedError"),
            "ping": lambda: ev.Pinged(name, inc, args[1], "" if args[1] else "timed out"),
            "ping not made": lambda: ev.Pinged(name, inc, False, "[Errno 24] Too many open files", local=True),
        }
        return [simple[kind]()]

    def _node_event(self, kind: str, args: list) -> Any:
        if kind == "ask":
            return ev.Asked(len(self.actions), args[0], *args[1:])
        if kind == "stop":
            return ev.StopAsked(args[0])
        if kind == "surveyed":
            return ev.Surveyed(args[0], tuple(args[1]) if len(args) > 1 else ())
        if kind == "survey failed":
            return ev.Surveyed({}, error=args[0])
        if kind == "checked":
            return ev.AdoptionChecked(args[0], {"daemon-rank0": {"resident_bytes": 1000}}, since_start=0.5)
        if kind == "check failed":
            return ev.AdoptionChecked({}, error=args[0])
        return ev.GroupsGone(())

    def _reaped(self, name: str) -> int:
        """The pid of the last Reap asked for ``name``."""
        return next(a.pid for a in reversed(self.actions) if type(a).__name__ == "Reap" and a.name == name)

    # ---- reading
    def state(self, name: str) -> str:
        """``READY primary``, ``BACKOFF standby``, ``READY`` (daemons, spawn server)."""
        c = self.node.child(name)
        role = getattr(c, "role", None)
        return c.state.value + (f" {role.value}" if role is not None else "")

    def answers(self) -> list[tuple[int, dict]]:
        return [(a.status, a.body) for a in self.actions if type(a).__name__ == "Answer"]

    def published(self, type_: str) -> list[dict]:
        return [a.event for a in self.actions if type(a).__name__ == "Publish" and a.event["type"] == type_]


def boot_steps(engines: tuple[str, ...] = ("a", "b")) -> list[tuple]:
    """Daemon loaded, spawn server answering, every engine READY (the first becomes primary)."""
    steps: list[tuple] = [("launched", "daemon-rank0"), ("daemon ready", "daemon-rank0"), ("launched", "spawn-server"),
                          ("ping", "spawn-server", True)]
    for e in engines:
        steps += [("launched", e), ("ready", e), ("heartbeat", e, 0)]  # (on the control channel)
    return steps


def booted(p: Play, engines: tuple[str, ...]) -> None:
    """Play the boot on ``p`` as far as its node has the children (daemons, a spawn server)."""
    for spec in boot_steps(engines):
        if p.node.child(spec[1]) is not None and not (p.node.settings.external and spec[0] == "heartbeat"):
            p.play(spec)
            if p.node.promoting is not None and spec[0] == "ready":  # shared KV: it takes the pool
                p.play(("said", spec[1], "promoted", {"adopted_blocks": 0}))


def serving(engines: tuple[str, ...] = ("a", "b"), **kw: Any) -> Play:
    """A booted node: daemon and spawn server READY, engines READY, the first the primary (epoch 1)."""
    p = Play(engines, **kw)
    booted(p, engines)
    p.actions.clear()
    return p


def record(kind: str, name: str, pid: int, key: str, state: str = "READY", inc: int = 1, role: str | None = None,
           t: float = 50.0) -> ChildRecord:
    return ChildRecord(kind=kind, name=name, pid=pid, create_time=t, config_key=key, state=state, incarnation=inc,
                       role=role, port=9000 + pid, url=f"http://127.0.0.1:{9000 + pid}")


def records(primary: str = "a", epoch: int = 3, changed: str = "", **over: Any) -> ChildRecords:
    """What a dead supervisor left: daemon pid 10, spawn server 11, engines a 12 and b 13 (``changed``:
    that engine was started with another config)."""
    children = [record("daemon", "daemon-rank0", 10, "kd"), record("spawn_server", "spawn-server", 11, "ks"),
                record("engine", "a", 12, "old" if changed == "a" else "ke",
                       role="primary" if primary == "a" else "standby"),
                record("engine", "b", 13, "old" if changed == "b" else "ke",
                       role="primary" if primary == "b" else "standby")]
    return ChildRecords(supervisor_pid=1, epoch=epoch, primary=primary, children=children, **over)


def in_order(got: list[str], want: list[str]) -> bool:
    """``want`` is a subsequence of ``got``."""
    it = iter(got)
    return all(any(g == w for g in it) for w in want)
