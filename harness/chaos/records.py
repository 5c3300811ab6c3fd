"""Raw observations of one run: requests, faults, events, status polls (plain dataclasses)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Headers the router sets on every proxied response (DESIGN.md §4 router; see router.py).
ENGINE_HEADER = "x-understudy-engine"
EPOCH_HEADER = "x-understudy-epoch"
RETRIES_HEADER = "x-understudy-retries"


@dataclass(slots=True)
class RequestRecord:
    """One client request. Times are wall-clock seconds (time.time()) on this host."""

    id: int
    endpoint: str  # "completion" | "chat"
    stream: bool
    t_start: float
    t_end: float = 0.0
    t_first: float | None = None  # non-stream: response headers; stream: first data chunk
    ok: bool = False
    status: int | None = None
    error: str | None = None  # failure kind, e.g. "http_503", "connect", "timeout", "stream_broken"
    engine: str | None = None
    epoch: int | None = None
    retries: int | None = None  # router retries, from RETRIES_HEADER when the router sets it
    response_id: str | None = None  # the completion's id (joins the router's migration events)
    text: str | None = None  # the generated text (greedy runs: must equal the uninterrupted one)
    cut: bool = False  # a 200 stream that ended without finish_reason and [DONE], or with an error event
    max_gap_s: float | None = None  # stream: longest wait for a chunk (send -> first chunk included)
    chunk_times: list[float] = field(default_factory=list)  # stream: arrival of each data chunk

    @property
    def latency(self) -> float:
        """Seconds from send to the end of the response (or of the failure)."""
        return self.t_end - self.t_start


@dataclass(slots=True)
class FaultRecord:
    """One injected fault, with what the supervisor looked like just before it."""

    index: int
    kind: str  # e.g. "kill-primary", "stop-daemon", "promote", "rollout"
    t: float
    target_role: str | None = None  # "primary" | "standby" | "daemon" | None for API faults
    name: str | None = None
    pid: int | None = None
    epoch_before: int | None = None
    primary_before: str | None = None
    t_done: float | None = None  # API faults: when the call returned
    error: str | None = None  # why it was not (fully) injected
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class EngineView:
    """One engine or daemon as /status shows it."""

    name: str
    kind: str  # "engine" | "daemon"
    role: str | None
    state: str | None
    pid: int | None
    incarnation: int | None = None
    weights_source: str | None = None


@dataclass(slots=True)
class StatusSample:
    """One poll of the admin /status."""

    t: float
    epoch: int | None
    engines: list[EngineView]
    daemons: list[EngineView]
    supervisor_pid: int | None = None
    spawn_server_pid: int | None = None

    def active_count(self) -> int:
        """Engines that are primary and READY, i.e. serving traffic."""
        return sum(1 for e in self.engines if e.role == "primary" and e.state == "READY")

    def find(self, name: str) -> EngineView | None:
        """The engine or daemon called `name`."""
        return next((e for e in self.engines + self.daemons if e.name == name), None)
