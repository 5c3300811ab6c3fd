"""What the supervisor knows: the node and one record per child (what was observed and what is
wanted). Plain data: no I/O, no clock of its own (the pass sets ``Node.now``)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar

from supervisor.config import FailoverSection
from supervisor.core.actions import Action
from supervisor.core.adoption_plan import Wanted
from supervisor.core.backoff import RestartPolicy
from supervisor.core.records import ChildRecords
from supervisor.core.states import Intent, Role, State
from supervisor.core.watchdog import WatchdogGate


@dataclass
class Child:
    """One restartable process with a state machine: an engine, a daemon or the spawn server."""

    kind: ClassVar[str] = ""
    name: str
    policy: RestartPolicy
    state: State = State.STOPPED
    pid: int | None = None
    incarnation: int = 0
    started_at: float = 0.0            # the last start (or adoption)
    state_since: float = 0.0
    reason: str = ""                   # why the last FAILED/EXITED/FATAL happened
    last_exit: str = ""                # decoded exit status of the last process
    log_line: str = ""                 # the telling line of the last exited process's log
    intent: Intent = Intent.RUN        # STOP, RESTART: an exit now is expected (and RESTART starts it afresh)
    exit_expected: bool = False        # the exit being read was asked for
    retry_at: float | None = None      # a BACKOFF restart (or a FATAL engine slot's slow retry) is due then
    crash_loop: bool = False           # flapping, yet retried: the last engine standing
    ever_ready: bool = False
    spawned: bool = False              # forked by the spawn server (it reports the exit status)
    launching: bool = False            # a Start is in flight: no pid yet
    reaping: bool = False              # exited: its status is being read
    checking: bool = False             # a Probe is in flight
    next_check_at: float = 0.0         # the next readiness / status probe, while starting
    last_check: float = 0.0            # the last periodic probe (engine health, daemon ping)
    check_failures: int = 0            # periodic probes failed in a row

    @property
    def stop_requested(self) -> bool:
        """An exit now is expected (drain, stop, restart)."""
        return self.intent != Intent.RUN

    @property
    def restart_after_stop(self) -> bool:
        """... and is followed by a fresh start."""
        return self.intent == Intent.RESTART


@dataclass
class Engine(Child):
    """An engine slot ("a", "b", ...)."""

    kind: ClassVar[str] = "engine"
    role: Role = Role.STANDBY
    port: int = 0
    url: str = ""
    last_heartbeat: float | None = None
    heartbeat: dict[str, Any] = field(default_factory=dict)
    last_progress: float = 0.0
    probe_progress: int = -1           # heartbeat progress (steps + served) at the last probe
    weights_source: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    startup_counted: bool = False
    down_since: float | None = None    # failure time, for recovery_seconds
    engine_state: str = ""             # the last state the engine reported
    unanswered: int = 0                # canaries not answered yet in this start
    kv_source: str | None = None       # shared | own | own:<why no pool> (its startup summary)
    kv_pool_id: str | None = None      # the shared pool it maps (rank 0's), as the daemon names it
    kv_writer: bool = False            # it holds the shared KV pool's writer role (it said `promoted`)
    fatal_retries: int = 0             # slow retries of this FATAL slot since it was last READY
    retrying_fatal: bool = False       # this incarnation is such a retry: failing again is FATAL again
    drain_fenced: bool = False         # SIGKILLed after drain_timeout_s: a signal exit was ours
    lost_epoch: int | None = None      # the epoch it served as primary when lost, until its exit status is read

    def progress(self) -> int:
        """The engine's progress as its heartbeat reports it: scheduler steps (tokens made, chunks
        prefilled) plus requests served; -1 when it reports neither."""
        steps, served = self.heartbeat.get("steps"), self.heartbeat.get("served")
        counts = [v for v in (steps, served) if isinstance(v, int) and not isinstance(v, bool)]
        return sum(counts) if counts else -1


@dataclass
class Daemon(Child):
    """The weight cache daemon of one rank ("daemon-rank0", ...)."""

    kind: ClassVar[str] = "daemon"
    rank: int = 0
    socket_path: str = ""                # its socket; an external daemon's readiness check (daemon_ready)
    resident_bytes: int | None = None
    fingerprint: dict[str, Any] | None = None
    weights_finite: bool | None = None  # the daemon checked every tensor of its arena finite
    kv_pool: dict[str, Any] | None = None  # its shared KV pool's layout (None: it holds none)
    kv_pool_id: str | None = None      # that pool's identity (a restarted daemon holds another pool)
    load_bytes: int | None = None       # the load's progress at the last status answer
    load_pct: int = -1


@dataclass
class SpawnServer(Child):
    """The zygote that has imported torch and the engine code and forks engines."""

    kind: ClassVar[str] = "spawn_server"


@dataclass(frozen=True)
class Settings:
    """The parts of the config that the rules read."""

    failover: FailoverSection
    load_timeout_s: float              # daemons.load_timeout_s
    fingerprint: str = ""              # the model's (canary golden answers are kept per fingerprint)
    tp_size: int = 1
    external: bool = False
    spawn_server: bool = True          # engines are forked by the spawn server
    spawn_wait_s: float = 30.0         # a start waits this long for a spawn server being restarted
    spawn_ready_s: float = 120.0       # a new spawn server must answer within this
    shared_kv: bool = False            # engines run on the daemons' KV pools: promotion is a round trip


@dataclass
class Failover:
    """A primary lost while no standby was READY: promote the first engine READY, as this failover."""

    reason: str
    detected_at: float
    lost: str
    detail: dict[str, Any] = field(default_factory=dict)  # more for the failover event (e.g. during: promote)


@dataclass
class Promotion:
    """A standby asked to take the shared KV pool's writer role: it serves once it says `promoted`."""

    name: str
    incarnation: int
    reason: str                        # what the promotion answers ("boot", "exit", "promote", ...)
    detected_at: float
    lost: str                          # the engine it replaces ("" at boot)
    deadline: float
    detail: dict[str, Any] = field(default_factory=dict)  # more for the failover event (e.g. during: promote)


@dataclass
class Demotion:
    """A planned switchover: the primary is asked to hand its requests off and give the pool up."""

    name: str
    incarnation: int
    successor: str
    deadline: float


@dataclass
class Rollout:
    """Every engine restarted in turn: ``steps`` still to do, ``waiting`` the child being replaced."""

    request: int
    steps: list[str]
    started: float                     # wall time
    incarnations: dict[str, int] = field(default_factory=dict)  # each engine's when it began
    done: list[str] = field(default_factory=list)
    waiting: str | None = None
    deadline: float = 0.0
    running: bool = True

    def view(self) -> dict[str, Any]:
        return {"running": self.running, "done": list(self.done), "started": self.started}


@dataclass
class Shutdown:
    """Stopping: engines drain, then the spawn server, then the daemons stop; each stage has a deadline."""

    why: str
    stage: str = "engines"
    deadline: float = 0.0


@dataclass
class Adoption:
    """Where the first pass stands (supervisor/core/adoption.py): begin -> survey -> check -> clear."""

    records: ChildRecords
    stage: str = "begin"
    observed: dict[int, float | None] = field(default_factory=dict)  # pid -> its start time now
    spawn_children: tuple[int, ...] = ()  # live children of the recorded spawn server


@dataclass
class Node:
    """The whole node: children, roles, epoch, routing intent, and what the pass emits."""

    settings: Settings
    engines: dict[str, Engine]
    daemons: list[Daemon]
    spawn: SpawnServer | None
    wanted: Wanted
    adoption: Adoption | None = None   # records a previous supervisor left: the first pass adopts from them
    phase: str = "booting"             # (adopting ->) booting -> serving: every engine slot started
    epoch: int = 0
    primary: str | None = None         # the engine the router sends to
    drained: bool = False
    pending_failover: Failover | None = None
    hold_reason: str = "starting: no engine READY yet"
    failovers: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=50))
    rollout: Rollout | None = None
    announced: bool = False            # "ready" said and READY=1 sent
    links_swept: bool = False          # engine link sockets left by dead engines removed (boot)
    boot_started: float = 0.0
    watchdog: WatchdogGate = field(default_factory=lambda: WatchdogGate(float("inf"), 0.0))
    stuck: bool = False                # no READY primary and no progress: systemd's watchdog starves
    shutdown: Shutdown | None = None
    exit_code: int = 0
    finished: bool = False             # Finish emitted
    now: float = 0.0                   # monotonic time of the current pass
    wall: float = 0.0                  # its wall time
    dirty: bool = True                 # something state.json / children.json show changed
    routed: tuple | None = None        # the routing last emitted (see failover.route)
    routed_flags: tuple[bool, bool] = (False, False)  # (drained, stopping) last emitted
    routed_next: str = ""              # the next primary's URL last emitted (NextPrimary)
    lost_epoch: int | None = None      # a fenced primary's epoch, not yet told to the router
    clock: tuple[int, float] | None = None  # (new epoch, failure detected): the router's failover clock
    promoting: Promotion | None = None  # shared KV: a promotion waiting for the engine's answer
    demoting: Demotion | None = None   # shared KV: a planned switchover waiting for the old primary
    unfenced: set[str] = field(default_factory=set)  # "name:incarnation" of KV writers not reaped yet
    out: list[Action] = field(default_factory=list)

    @property
    def stopping(self) -> bool:
        return self.shutdown is not None

    @property
    def booted(self) -> bool:
        return self.phase == "serving"

    def emit(self, action: Action) -> None:
        self.out.append(action)

    def children(self) -> list[Child]:
        every: list[Child] = [*self.daemons]
        if self.spawn is not None:
            every.append(self.spawn)
        return every + list(self.engines.values())

    def child(self, name: str) -> Child | None:
        if name in self.engines:
            return self.engines[name]
        if self.spawn is not None and name == self.spawn.name:
            return self.spawn
        return next((d for d in self.daemons if d.name == name), None)

    def primary_engine(self) -> Engine | None:
        return self.engines.get(self.primary) if self.primary is not None else None

    def serving(self) -> bool:
        """A READY primary is routed."""
        p = self.primary_engine()
        return p is not None and p.state == State.READY

    def ready_standby(self) -> Engine | None:
        return next((s for s in self.engines.values()
                     if s.state == State.READY and s.role == Role.STANDBY and s.pid), None)

    def progress(self) -> None:
        """Something moved toward serving (or away, to be retried): the watchdog's progress."""
        self.watchdog.progress(self.now)


def new_node(settings: Settings, engines: list[str], daemon_sockets: list[str], wanted: Wanted,
             records: ChildRecords | None = None, now: float = 0.0) -> Node:
    """A node before its first pass: every slot STOPPED; it adopts from ``records`` if given.
    ``daemon_sockets``: each rank's daemon socket (none: engines load their weights themselves)."""
    f = settings.failover

    def policy(first_s: float = 0.0) -> RestartPolicy:
        return RestartPolicy(f.backoff_base_s, f.backoff_max_s, f.flap_window_s, f.flap_max, first_s)

    node = Node(settings=settings, engines={n: Engine(n, policy(f.restart_delay_s)) for n in engines},
                daemons=[Daemon(f"daemon-rank{r}", policy(), rank=r, socket_path=path)
                         for r, path in enumerate(daemon_sockets)],
                spawn=SpawnServer("spawn-server", policy()) if settings.spawn_server and not settings.external
                else None, wanted=wanted, boot_started=now, now=now,
                watchdog=WatchdogGate(f.stuck_window_s(), now))
    for child in node.children():
        child.state_since = now
    if records is not None:
        node.adoption, node.phase = Adoption(records), "adopting"
    return node
