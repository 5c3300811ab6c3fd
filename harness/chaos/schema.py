"""The chaos report (report.json) as pydantic models: the one definition of what a run reports."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from harness.stats import Distribution

REPORT_VERSION = 1


class RequestCounts(BaseModel):
    """Outcomes of a set of requests."""

    sent: int = 0
    succeeded: int = 0
    failed: int = 0
    failed_by_kind: dict[str, int] = Field(default_factory=dict)
    retried: int | None = None  # None: the router does not say (no retries header)


class Requests(BaseModel):
    """All requests, and the streaming / non-streaming split."""

    all: RequestCounts
    streaming: RequestCounts
    non_streaming: RequestCounts
    not_sent_client_busy: int = 0  # arrivals skipped because `concurrency` requests were in flight
    router_retries: int | None = None  # understudy_router_retries_total over the run (/metrics)
    cut_streams: int = 0  # 200 streams that ended without finish_reason + [DONE], or with an error event
    greedy_differ: int = 0  # successful outputs that differ from the most common one of their kind
    greedy_differ_continued: int = 0  # of those, outputs the router continued on another engine
    continued_outputs: int = 0  # successful outputs the router continued (the base of the one above)
    migrations: dict[str, int] = Field(default_factory=dict)  # migration events by result
    stall_client: Distribution | None = None  # migrated streams: longest wait for a chunk, client side
    stall_router: Distribution | None = None  # the same streams: the router's stall_s (events)


class Latency(BaseModel):
    """Request latency (send -> end of response) of successful requests, seconds."""

    window_s: float  # "around a failover" = [fault - 1 s, fault + window_s]
    steady: Distribution
    around_failovers: Distribution


class FaultOutcome(BaseModel):
    """One fault and what followed it."""

    index: int
    kind: str
    t: float  # seconds since the run started
    target: str | None = None
    target_role: str | None = None  # "primary" | "standby" | "daemon"; None for API faults
    pid: int | None = None
    error: str | None = None
    detection_s: float | None = None  # fault -> the supervisor moved the victim out of READY
    failover_s: float | None = None  # fault -> first success served by the new primary
    failover_method: str | None = None  # how the serving engine was recognised
    new_primary: str | None = None
    recovery_s: float | None = None  # fault -> replacement READY
    recovery_method: str | None = None  # "events" | "status-poll"
    weights_source: str | None = None
    supervisor_failover_s: float | None = None  # from the failover event
    supervisor_recovery_s: float | None = None  # from the recovered event
    api_s: float | None = None  # promote / rollout: duration of the admin call
    failed_requests: int = 0  # failures sent in [fault - 1 s, fault + window), cut at the next fault's


class KindSummary(BaseModel):
    """The faults of one kind together."""

    n: int
    failed_requests: int
    detection: Distribution
    failover: Distribution
    recovery: Distribution


class Cache(BaseModel):
    """Weight cache outcomes of the engine starts seen during the run (/status polls)."""

    hits: int = 0
    misses: int = 0
    hit_rate: float | None = None
    miss_reasons: dict[str, int] = Field(default_factory=dict)


class ActivePeriod(BaseModel):
    """A span during which the active engine count was not 1."""

    start: float  # seconds since the run started
    seconds: float
    count: int
    during_fault: bool  # inside some fault's window (a failover gap), or not


class ActiveEngines(BaseModel):
    """How many engines were primary and READY, from the events and the /status polls."""

    ever_not_one: bool
    ever_more_than_one: bool
    min: int | None = None
    max: int | None = None
    periods: list[ActivePeriod] = Field(default_factory=list)
    status_polls: int = 0
    status_polls_not_one: int = 0


class MemorySample(BaseModel):
    """Memory of the supervisor's whole process tree (and the GPUs) at one moment."""

    t: float
    processes: int = 0
    rss_bytes: int = 0
    pss_bytes: int | None = None  # shared arena pages counted once; None if not readable
    gpu_used_bytes: list[int] | None = None  # per GPU, nvidia-smi; None without one
    error: str | None = None


class Memory(BaseModel):
    """Start and end samples (end taken after the last recovery settled)."""

    supervisor_pid: int | None = None
    start: MemorySample | None = None
    end: MemorySample | None = None
    samples: list[MemorySample] = Field(default_factory=list)
    rss_growth_pct: float | None = None
    pss_growth_pct: float | None = None
    gpu_growth_bytes: list[int] | None = None


class MetricComparison(BaseModel):
    """One figure as the supervisor's /metrics has it and as the client observed it."""

    name: str
    supervisor: float | None
    client: float | None
    relative_diff: float | None = None
    agree: bool | None = None  # within the tolerance; None if one side is missing
    comparable: bool = True  # False: the two sides time different spans (see note); not a check
    note: str = ""
    rule: str = ""  # what decided `agree`: the relative tolerance, or the absolute floor of a time figure


class Check(BaseModel):
    """One pass/fail verdict against a target."""

    name: str
    ok: bool
    detail: str


class ChaosReport(BaseModel):
    """Everything `understudy chaos` measured in one run."""

    version: int = REPORT_VERSION
    started_at: float
    ended_at: float
    duration_s: float
    completed: bool
    aborted: str | None = None
    target: dict[str, str]
    options: dict[str, Any]
    requests: Requests
    latency: Latency
    faults: list[FaultOutcome]
    failover: Distribution  # primary faults and planned promotes
    recovery: Distribution  # engine failures (primary/standby kill or stop): fault -> replacement READY
    daemon_recovery: Distribution  # daemon failures: fault -> daemon READY again
    detection: Distribution  # unplanned engine faults: fault -> supervisor noticed
    by_kind: dict[str, KindSummary] = Field(default_factory=dict)
    failovers_observed: int = 0  # primary changes the client saw (distinct epochs served - 1)
    worst_recovery: FaultOutcome | None = None
    cache: Cache
    active_engines: ActiveEngines
    memory: Memory
    honest_metrics: list[MetricComparison]
    checks: list[Check]
    events_seen: int = 0
    event_errors: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
