"""The supervisor's published events (docs/CONTRACTS.md) as pydantic models."""
from __future__ import annotations

import json
import time
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

_MONOTONIC_CUTOFF = 1e9  # a ts below this is time.monotonic(), not wall-clock


class _Event(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    ts: float
    t_recv: float = 0.0  # set by the listener: wall-clock time of receipt


class TransitionEvent(_Event):
    """A child changed state."""

    type: Literal["transition"]
    engine: str
    from_state: str | None = Field(default=None, alias="from")
    to: str
    role: str | None = None
    epoch: int | None = None


class FailoverEvent(_Event):
    """The standby was promoted (crash, hang, probe failure or a planned promote)."""

    type: Literal["failover"]
    reason: str
    from_engine: str | None = Field(default=None, alias="from")
    to: str
    epoch: int | None = None
    seconds: float | None = None


class RecoveredEvent(_Event):
    """A replacement engine became READY after a failure."""

    type: Literal["recovered"]
    engine: str
    incarnation: int | None = None
    seconds: float | None = None
    weights_source: str | None = None


class MigrationEvent(_Event):
    """The router continued (or could not continue) a request whose primary was lost mid-request."""

    type: Literal["migration"]
    result: str
    request_id: str = ""
    tokens_replayed: int | None = None
    stall_s: float | None = None
    chunks_before: int | None = None  # data chunks the client had when the continuation began
    timeline: dict[str, float] | None = None  # the continuation's moments (supervisor/router/migrating.py TIMELINE)


Event = Annotated[Union[TransitionEvent, FailoverEvent, RecoveredEvent, MigrationEvent], Field(discriminator="type")]
_adapter: TypeAdapter[Event] = TypeAdapter(Event)
KNOWN_TYPES = ("transition", "failover", "recovered", "migration")


class EventParseError(ValueError):
    """A frame on the events socket that is not a known event."""


def to_wall_clock(ts: float) -> float:
    """Map a monotonic timestamp to wall-clock seconds; wall-clock ones pass through."""
    if ts >= _MONOTONIC_CUTOFF:
        return ts
    return ts + (time.time() - time.monotonic())


def parse_event(frame: bytes, t_recv: float) -> Event | None:
    """Parse one JSON frame; None for an event type we do not use; EventParseError if malformed."""
    try:
        obj = json.loads(frame)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EventParseError(f"event frame is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise EventParseError(f"event frame is a {type(obj).__name__}, expected a JSON object")
    if obj.get("type") not in KNOWN_TYPES:
        return None
    try:
        event = _adapter.validate_python(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise EventParseError(f"{obj.get('type')} event: {where}: {first['msg']}") from None
    event.ts = to_wall_clock(event.ts)
    event.t_recv = t_recv
    return event
