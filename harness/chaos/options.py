"""What one chaos run does: targets, load shape, fault plan and limits (pydantic)."""
from __future__ import annotations

import ipaddress
import math
import random
import socket
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

FAULT_KINDS = (
    "kill-primary", "kill-standby", "kill-daemon", "kill-random",
    "stop-primary", "stop-standby", "stop-daemon", "stop-random",
    "promote", "rollout",
    "kill-supervisor",
    "big-request", "idle-connections",  # hostile clients on the data plane (chaos/hostile.py)
)
ENDPOINTS = ("completion", "chat")


class ChaosOptions(BaseModel):
    """Validated options; every loop of the run is bounded by these."""

    model_config = ConfigDict(extra="forbid")

    data_url: str
    admin_url: str
    token: str = Field(repr=False)
    events_endpoint: str | None = None
    supervisor_pid: int | None = None
    out_dir: str
    rate: float = Field(default=10.0, gt=0, le=10_000, description="request arrivals per second")
    concurrency: int = Field(default=16, ge=1, le=4096)
    mix: dict[str, float] = Field(default_factory=lambda: {"completion": 1.0, "chat": 1.0})
    stream_fraction: float = Field(default=0.5, ge=0, le=1)
    max_tokens: int = Field(default=8, ge=1, le=4096)
    request_timeout_s: float = Field(default=30.0, gt=0)
    faults: dict[str, int] = Field(default_factory=dict)
    interval_s: float = Field(default=5.0, ge=0, description="minimum gap between two faults")
    warmup_s: float = Field(default=3.0, ge=0)
    settle_s: float = Field(default=30.0, ge=0, description="after the last fault: wait for READY")
    ready_timeout_s: float = Field(default=60.0, gt=0, description="wait for a standby before a fault")
    stop_release_s: float = Field(default=30.0, gt=0, description="SIGCONT a stopped group after")
    duration_s: float = Field(default=600.0, gt=0, description="hard limit on the whole run")
    failover_window_s: float = Field(default=2.0, gt=0, description="after a fault: counted as around it")
    status_poll_s: float = Field(default=0.25, gt=0)
    memory_every_s: float = Field(default=10.0, gt=0)
    dead_after_s: float = Field(default=10.0, gt=0, description="supervisor unreachable this long: abort")
    tolerance: float = Field(default=0.10, ge=0, le=1)
    tolerance_floor_s: float = Field(default=0.010, ge=0, description="time figures also agree within this, "
                                     "absolute (tens of ms: a few ms of sampling are a large ratio)")
    idle_connections: int = Field(default=200, ge=1, le=5000, description="idle-connections: how many")
    idle_hold_s: float = Field(default=5.0, gt=0, le=120, description="idle-connections: held this long")
    slo_failover_p99_s: float | None = None
    slo_recovery_p99_s: float | None = None
    max_memory_growth_pct: float = 10.0
    seed: int = 0

    @field_validator("data_url", "admin_url")
    @classmethod
    def _loopback(cls, url: str) -> str:
        return require_loopback(url)

    @field_validator("mix")
    @classmethod
    def _mix(cls, mix: dict[str, float]) -> dict[str, float]:
        unknown = set(mix) - set(ENDPOINTS)
        if unknown or not mix or not all(math.isfinite(w) and w >= 0 for w in mix.values()):
            raise ValueError(f"mix: expected finite weights >= 0 for {ENDPOINTS}, got {mix}")
        if sum(mix.values()) <= 0:
            raise ValueError(f"mix: at least one weight must be > 0, got {mix}")
        return mix

    @field_validator("faults")
    @classmethod
    def _faults(cls, faults: dict[str, int]) -> dict[str, int]:
        for kind, count in faults.items():
            if kind not in FAULT_KINDS:
                raise ValueError(f"fault kind {kind!r}: expected one of {', '.join(FAULT_KINDS)}")
            if not 0 <= count <= 100_000:
                raise ValueError(f"fault count for {kind}: expected 0..100000, got {count}")
        return faults

    def fault_plan(self) -> list[str]:
        """Every fault to inject, in a seeded random order."""
        plan = [kind for kind, count in self.faults.items() for _ in range(count)]
        random.Random(self.seed).shuffle(plan)
        return plan

    def public(self) -> dict:
        """The options for the report, without the token."""
        return self.model_dump(exclude={"token"})


def require_loopback(url: str) -> str:
    """Return `url` if its host is a loopback address; ValueError otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r}: expected http://HOST:PORT")
    host = parts.hostname
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, parts.port or 80, proto=socket.IPPROTO_TCP)}
    except socket.gaierror as exc:
        raise ValueError(f"{url!r}: cannot resolve {host!r}: {exc.strerror}") from None
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise ValueError(f"{url!r}: chaos sends traffic to loopback only, {host!r} is {sorted(addrs)}")
    return url.rstrip("/")


def parse_counts(spec: str, what: str) -> dict[str, int]:
    """'kill-primary:3,kill-daemon:1' -> {'kill-primary': 3, 'kill-daemon': 1}."""
    out = _pairs(spec, what)
    for key, value in out.items():
        if not value.isdigit():
            raise ValueError(f"{what}: count for {key!r} must be a whole number, got {value!r}")
    return {k: int(v) for k, v in out.items()}


def parse_weights(spec: str, what: str) -> dict[str, float]:
    """'completion:1,chat:2' -> {'completion': 1.0, 'chat': 2.0}."""
    return {k: float(v) for k, v in _pairs(spec, what).items()}


def _pairs(spec: str, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = item.partition(":")
        if not sep or not key or not value:
            raise ValueError(f"{what}: expected NAME:NUMBER[,NAME:NUMBER...], got {item!r}")
        try:
            float(value)
        except ValueError:
            raise ValueError(f"{what}: {value!r} in {item!r} is not a number") from None
        out[key.strip()] = value.strip()
    return out
