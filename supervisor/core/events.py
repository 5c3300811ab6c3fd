"""What the sources record (a child exited, an engine said something, a probe answered, an admin
asked, a signal came): plain data, taken in by the next pass. Events of a child name it and its
incarnation; those of an earlier incarnation are dropped by the pass (one place, not one guard per
callback)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union


@dataclass(frozen=True)
class Launched:
    """A Start succeeded: the process runs (an engine: at ``url``, listening on ``port`` soon)."""

    name: str
    incarnation: int
    pid: int
    url: str = ""
    port: int = 0
    spawned: bool = False


@dataclass(frozen=True)
class LaunchFailed:
    name: str
    incarnation: int
    error: str


@dataclass(frozen=True)
class Exited:
    """The process began to exit or is gone (pidfd, or the primary's exit poll), seen ``at``
    (monotonic; None: at the pass): a failover's clock starts there."""

    name: str
    incarnation: int
    pid: int
    at: float | None = None


@dataclass(frozen=True)
class ExitRead:
    """The exit status of an exited process (None: unknown), once its group is gone if asked."""

    name: str
    incarnation: int
    pid: int
    returncode: int | None
    log_line: str = ""
    log_path: str = ""


@dataclass(frozen=True)
class Said:
    """A message from an engine on the control channel (docs/CONTRACTS.md)."""

    name: str
    incarnation: int
    type: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ReadyChecked:
    """A readiness probe: ``listening`` (HTTP up), then the canary: ``answered`` (a completion came
    back), ``broken`` (the engine says its model cannot serve), ``mismatch`` (differs from the
    golden answer); ``canary_s``: how long the canary took; ``startup`` = GET /startup when the control
    channel had not brought it."""

    name: str
    incarnation: int
    listening: bool
    answered: bool = False
    canary_s: float = 0.0
    broken: bool = False
    error: str = ""
    mismatch: str | None = None
    startup: dict[str, Any] | None = None


@dataclass(frozen=True)
class HealthChecked:
    """A health probe of the primary: ``problem`` is None when the canary matched. ``local``: it failed
    while the supervisor itself was out of descriptors (EMFILE): not the engine's failure."""

    name: str
    incarnation: int
    problem: str | None
    local: bool = False


@dataclass(frozen=True)
class DaemonAnswered:
    """A loading daemon's ``status`` reply (None: it did not answer, ``error`` says why)."""

    name: str
    incarnation: int
    reply: dict[str, Any] | None
    error: str = ""


@dataclass(frozen=True)
class Pinged:
    """A READY daemon's status request, or a starting spawn server's ping (``local``: as HealthChecked)."""

    name: str
    incarnation: int
    ok: bool
    error: str = ""
    local: bool = False


@dataclass(frozen=True)
class Asked:
    """An admin request: ``intent`` = promote | drain | undrain | restart | rollout."""

    request: int
    intent: str
    engine: str = ""
    force: bool = False


@dataclass(frozen=True)
class StopAsked:
    """Stop the node (SIGTERM/SIGINT, or an essential task ended: ``exit_code`` 70)."""

    why: str
    exit_code: int = 0


@dataclass(frozen=True)
class Surveyed:
    """Each recorded pid's start time now (None: gone), the live children of the recorded spawn
    server that lead their own session (forked engines); ``error``: the survey itself failed."""

    observed: dict[int, float | None]
    spawn_children: tuple[int, ...] = ()
    error: str = ""


@dataclass(frozen=True)
class AdoptionChecked:
    """Which adoptable children failed their check (name -> why), what the daemons answered, and
    this process's age (for the log)."""

    failed: dict[str, str]
    daemon_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    since_start: float = float("nan")
    error: str = ""


@dataclass(frozen=True)
class GroupsGone:
    pids: tuple[int, ...]


Event = Union[Launched, LaunchFailed, Exited, ExitRead, Said, ReadyChecked, HealthChecked, DaemonAnswered,
              Pinged, Asked, StopAsked, Surveyed, AdoptionChecked, GroupsGone]
CHILD_EVENTS = (Launched, LaunchFailed, Exited, ExitRead, Said, ReadyChecked, HealthChecked, DaemonAnswered,
                Pinged)
