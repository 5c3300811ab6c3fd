"""What a pass decides: actions that supervisor/effects/ carry out. Each reports back, if at all, as
an event (supervisor/core/events.py). ``brief()`` is the action in a few words (logs, table tests)."""
from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any, Union


@dataclass(frozen=True)
class Start:
    """Start a new incarnation: ``via`` is "spawn" (the spawn server forks it), "direct" or "external"
    for an engine, "" for a daemon or the spawn server. Reports Launched or LaunchFailed."""

    kind: str
    name: str
    incarnation: int
    via: str = ""

    def brief(self) -> str:
        return f"start {self.name}" + (f" via {self.via}" if self.via else "")


@dataclass(frozen=True)
class Attach:
    """Watch a process re-adopted from a previous supervisor (its exit comes as Exited)."""

    kind: str
    name: str
    incarnation: int
    pid: int
    spawned: bool = False  # forked by the (adopted) spawn server, which knows its exit status

    def brief(self) -> str:
        return f"attach {self.name}"


@dataclass(frozen=True)
class Fence:
    """SIGKILL the process group of ``pid``: nothing of it runs on."""

    name: str
    pid: int

    def brief(self) -> str:
        return f"fence {self.name}"


@dataclass(frozen=True)
class Stop:
    """Ask a process group to stop (SIGTERM: an engine drains, a daemon exits 0)."""

    name: str
    pid: int
    sig: int = signal.SIGTERM

    def brief(self) -> str:
        return f"stop {self.name}" + ("" if self.sig == signal.SIGTERM else f" {signal.Signals(self.sig).name}")


@dataclass(frozen=True)
class Drain:
    """The ``drain`` command on the engine's control channel (SIGTERM when it cannot be sent)."""

    name: str
    incarnation: int
    pid: int

    def brief(self) -> str:
        return f"drain {self.name}"


@dataclass(frozen=True)
class Tell:
    """A command on the engine's control channel (the shared KV pool's `promote`, `demote`,
    `fenced`); what it answers comes back as a Said event."""

    name: str
    incarnation: int
    cmd: str

    def brief(self) -> str:
        return f"tell {self.name} {self.cmd}"


@dataclass(frozen=True)
class Promote:
    """The router sends to ``name`` from now on, under ``epoch``. ``lost_epoch``: a fenced primary's
    epoch whose requests in flight are retried at once; ``detected_at``: the failure this promotion
    answers (starts the router's failover clock), None for the first primary."""

    name: str
    url: str
    epoch: int
    lost_epoch: int | None = None
    detected_at: float | None = None

    def brief(self) -> str:
        return f"promote {self.name} epoch {self.epoch}"


@dataclass(frozen=True)
class LossCause:
    """How the primary of ``epoch`` died, once its exit status is read: ``evidence`` unless it was
    SIGKILLed from outside (not by us: an operator, a chaos script, the OOM killer), for the
    router's quarantine (a request is a poison only where engines died of something it could cause)."""

    epoch: int
    evidence: bool
    text: str

    def brief(self) -> str:
        return f"loss cause epoch {self.epoch} {'evidence' if self.evidence else 'killed from outside'}"


@dataclass(frozen=True)
class Hold:
    """No primary: requests wait (up to hold_timeout_s); ``reason`` is what /readyz says."""

    reason: str
    lost_epoch: int | None = None

    def brief(self) -> str:
        return "hold"


@dataclass(frozen=True)
class RouterFlags:
    """``drained``: /readyz answers 503 "node is drained" (requests are still served); ``stopping``:
    held requests get their 503 now, new ones are not held."""

    drained: bool
    stopping: bool

    def brief(self) -> str:
        return "router" + (" drained" if self.drained else "") + (" stopping" if self.stopping else "")


@dataclass(frozen=True)
class NextPrimary:
    """The engine a failover would promote now (its URL; "" for none): the router keeps a connection
    to it open, so that a failover's continuations go out with no connect first."""

    url: str

    def brief(self) -> str:
        return f"next primary {self.url or 'none'}"


@dataclass(frozen=True)
class Probe:
    """One check of a child: ``what`` = "ready" (HTTP up, canary vs golden), "health" (canary of the
    primary), "status" (a daemon loading), "ping" (a READY daemon, a starting spawn server), "up" (an external
    engine's daemon starting: its readiness check, engines.external.daemon_ready).
    ``target``: the engine's URL, the daemon's socket or readiness check. ``detail`` (ready): what the golden answer's
    provenance is judged from. Reports ReadyChecked, HealthChecked, DaemonAnswered or Pinged."""

    kind: str
    name: str
    incarnation: int
    what: str
    target: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    def brief(self) -> str:
        return f"probe {self.name} {self.what}"


@dataclass(frozen=True)
class Reap:
    """Read the exit status of a process that exited (``wait_group``: until its whole group is gone,
    e.g. the other TP ranks); an engine's link sockets are removed then, while its pid names no other
    process. Reports ExitRead."""

    kind: str
    name: str
    incarnation: int
    pid: int
    wait_group: bool = False

    def brief(self) -> str:
        return f"reap {self.name}"


@dataclass(frozen=True)
class SweepLinks:
    """Remove every engine link socket (``{runtime_dir}/eng-PID-in|out.sock``) in the runtime dir but
    those of ``keep`` (live adopted engines): what engines killed before their front end connected
    left, before any engine of ours starts. (After each engine's exit, Reap removes its own.)"""

    keep: tuple[int, ...] = ()

    def brief(self) -> str:
        return "sweep links" + (" but " + " ".join(map(str, self.keep)) if self.keep else "")


@dataclass(frozen=True)
class Publish:
    """One event on the events socket (docs/CONTRACTS.md); the metrics that count it follow it."""

    event: dict[str, Any]

    def brief(self) -> str:
        ev = self.event
        if ev["type"] == "transition":
            return f"publish {ev['engine']} {ev['to']}"
        return f"publish {ev['type']}"


@dataclass(frozen=True)
class Measure:
    """A figure for the metrics only: ``what`` = "startup" (phases, weights source), "heartbeat"
    (serving figures, with the previous heartbeat and when it came), "resident" (a daemon's bytes)."""

    what: str
    name: str
    values: dict[str, Any] = field(default_factory=dict)

    def brief(self) -> str:
        return f"measure {self.name} {self.what}"


@dataclass(frozen=True)
class Notify:
    """systemd (sd_notify) and the operator: ``what`` = "ready" (READY=1, and the "ready: serving"
    line), "stuck" (STATUS=, once), "stopping" (STOPPING=1), "boot failed" (a line on stderr)."""

    what: str
    text: str = ""

    def brief(self) -> str:
        return f"notify {self.what}"


@dataclass(frozen=True)
class Answer:
    """The answer to an admin request (Asked): HTTP ``status`` and its JSON ``body``."""

    request: int
    status: int
    body: dict[str, Any]

    def brief(self) -> str:
        return f"answer {self.status}"


@dataclass(frozen=True)
class Survey:
    """Observe what a previous supervisor left (its ``records``): each recorded pid's start time now,
    and the recorded spawn server's children. Reports Surveyed."""

    records: Any

    def brief(self) -> str:
        return "survey"


@dataclass(frozen=True)
class CheckAdoptable:
    """Ask each recorded child that may be adopted (ChildRecords) whether it answers as recorded:
    engine /health on its port, daemon status, spawn server ping. Reports AdoptionChecked."""

    candidates: tuple[Any, ...]

    def brief(self) -> str:
        return "check adoptable " + " ".join(r.name for r in self.candidates)


@dataclass(frozen=True)
class AwaitGone:
    """Wait (bounded) until these process groups are gone, SIGKILLing them again. Reports GroupsGone."""

    pids: tuple[int, ...]

    def brief(self) -> str:
        return "await gone"


@dataclass(frozen=True)
class Finish:
    """The last stage of a stop: close the servers and channels, write the final state, exit."""

    exit_code: int

    def brief(self) -> str:
        return f"finish {self.exit_code}"


Action = Union[Start, Attach, Fence, Stop, Drain, Tell, Promote, LossCause, Hold, RouterFlags, NextPrimary, Probe, Reap,
               SweepLinks, Publish, Measure, Notify, Answer, Survey, CheckAdoptable, AwaitGone, Finish]
