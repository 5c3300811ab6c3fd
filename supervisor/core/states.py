"""Child states and roles as named constants with explicit allowed transitions (supervisord style).

Engines: STARTING -> ATTACHING -> WARMING -> READY, then DRAINING -> STOPPED, or EXITED/FAILED ->
BACKOFF -> STARTING, or FATAL after flapping. Daemons use the same set (no ATTACHING/WARMING
reports; READY once their arena is loaded).
"""
from __future__ import annotations

from enum import Enum


class State(str, Enum):
    STOPPED = "STOPPED"
    STARTING = "STARTING"
    ATTACHING = "ATTACHING"
    WARMING = "WARMING"
    READY = "READY"
    DRAINING = "DRAINING"
    EXITED = "EXITED"   # the process exited without being asked to
    FAILED = "FAILED"   # judged bad while alive (hang, probe, canary mismatch, startup timeout)
    BACKOFF = "BACKOFF"
    FATAL = "FATAL"


class Role(str, Enum):
    PRIMARY = "primary"
    STANDBY = "standby"


class Intent(str, Enum):
    """What was asked of a child's current process: run on, stop (drain, stop), or stop then start
    afresh (restart, rollout). One value where two booleans were (`stop_requested`, `restart_after_stop`)."""
    RUN = "run"
    STOP = "stop"
    RESTART = "restart"


S = State
_DOWN = {S.EXITED, S.FAILED}
ALLOWED: dict[State, frozenset[State]] = {
    S.STOPPED: frozenset({S.STARTING}),
    S.STARTING: frozenset({S.ATTACHING, S.WARMING, S.READY, S.DRAINING} | _DOWN),
    S.ATTACHING: frozenset({S.WARMING, S.READY, S.DRAINING} | _DOWN),
    S.WARMING: frozenset({S.READY, S.DRAINING} | _DOWN),
    S.READY: frozenset({S.DRAINING} | _DOWN),
    S.DRAINING: frozenset({S.STOPPED} | _DOWN),
    S.EXITED: frozenset({S.BACKOFF, S.FATAL, S.STOPPED, S.STARTING}),
    S.FAILED: frozenset({S.EXITED, S.BACKOFF, S.FATAL, S.STOPPED, S.STARTING}),
    S.BACKOFF: frozenset({S.STARTING, S.STOPPED, S.FATAL}),
    S.FATAL: frozenset({S.STARTING, S.STOPPED}),
}

RUNNING = frozenset({S.STARTING, S.ATTACHING, S.WARMING, S.READY, S.DRAINING})
"""States in which a process exists (or is about to)."""


class TransitionError(RuntimeError):
    """A transition that the table does not allow: a supervisor bug, never silently applied."""


def check_transition(src: State, dst: State) -> None:
    """Raise TransitionError unless ``src -> dst`` is allowed."""
    if dst not in ALLOWED[src]:
        raise TransitionError(f"transition {src.value} -> {dst.value} is not allowed "
                              f"(allowed: {', '.join(sorted(s.value for s in ALLOWED[src]))})")
