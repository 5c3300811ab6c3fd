"""What the supervisor knows about each child: engine slots and daemon slots."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from supervisor.backoff import RestartPolicy
from supervisor.launch import ProcHandle
from supervisor.states import Role, State, check_transition


@dataclass
class Slot:
    """Common part: a named, restartable process with a state machine."""

    name: str
    policy: RestartPolicy
    state: State = State.STOPPED
    proc: ProcHandle | None = None
    pid: int | None = None
    incarnation: int = 0
    started_at: float = 0.0            # monotonic, last spawn
    state_since: float = field(default_factory=time.monotonic)
    reason: str = ""                   # why the last FAILED/EXITED/FATAL happened
    last_exit: str = ""                # decoded exit status of the last process
    stop_requested: bool = False       # an exit now is expected (drain, stop, restart)
    restart_after_stop: bool = False   # ... and should be followed by a fresh start
    cancel_watch: Callable[[], None] | None = None
    timer: Any = None                  # asyncio.TimerHandle of a pending backoff restart
    retry_at: float | None = None      # monotonic time of that restart
    crash_loop: bool = False           # flapping, yet retried: the last engine standing
    log_line: str = ""                 # the telling line of the last exited process's log

    def set_state(self, new: State) -> State:
        """Apply an allowed transition; returns the old state."""
        check_transition(self.state, new)
        old, self.state = self.state, new
        self.state_since = time.monotonic()
        return old


@dataclass
class EngineSlot(Slot):
    role: Role = Role.STANDBY
    port: int = 0
    url: str = ""
    last_heartbeat: float | None = None
    heartbeat: dict[str, Any] = field(default_factory=dict)
    last_progress: float = 0.0
    probe_served: int = -1             # heartbeat 'served' count at the last probe
    last_probe: float = 0.0
    probe_failures: int = 0
    probing: bool = False
    weights_source: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    startup_counted: bool = False
    down_since: float | None = None    # failure time, for recovery_seconds
    ready_task: Any = None
    engine_state: str = ""             # last state the engine reported


@dataclass
class DaemonSlot(Slot):
    rank: int = 0
    socket_path: str = ""
    resident_bytes: int | None = None
    fingerprint: dict[str, Any] | None = None
    weights_finite: bool | None = None  # the daemon checked every tensor of its arena finite
    status_task: Any = None
    ever_ready: bool = False
    last_ping: float = 0.0
    pinging: bool = False
    ping_failures: int = 0


def served_count(slot: EngineSlot) -> int:
    """Requests the engine reports as served (heartbeat), -1 when it reports none."""
    v = slot.heartbeat.get("served")
    return int(v) if isinstance(v, int) else -1
