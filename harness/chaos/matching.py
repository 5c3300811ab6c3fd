"""Tie each fault to what followed: the failover the client saw, the recovery, the cache result."""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from itertools import islice

from .events import Event, FailoverEvent, RecoveredEvent, TransitionEvent
from .records import FaultRecord, RequestRecord, StatusSample
from .schema import FaultOutcome


class SuccessIndex:
    """Successful requests ordered by the time their response began, for 'first success after'."""

    def __init__(self, requests: Sequence[RequestRecord]) -> None:
        ok = [r for r in requests if r.ok and r.t_first is not None]
        ok.sort(key=lambda r: r.t_first)  # type: ignore[arg-type, return-value]
        self._recs = ok
        self._times = [r.t_first for r in ok]
        self.has_engine_header = any(r.engine for r in ok)

    def first_after(self, t: float, until: float, served_by: str | None, not_by: str | None,
                    min_epoch: int | None, sent_after: bool) -> RequestRecord | None:
        """First success with t <= t_first < until matching the serving-engine conditions."""
        for r in islice(self._recs, bisect.bisect_left(self._times, t), None):
            if r.t_first >= until:  # type: ignore[operator]
                return None
            if served_by is not None and r.engine != served_by:
                continue
            if not_by is not None and r.engine == not_by:
                continue
            if min_epoch is not None and r.epoch is not None and r.epoch < min_epoch:
                continue
            if sent_after and r.t_start < t:
                continue
            return r
        return None


class EventIndex:
    """Events ordered by ts, for 'first event like this after t'."""

    def __init__(self, events: Sequence[Event]) -> None:
        self.events = sorted(events, key=lambda e: e.ts)
        self._times = [e.ts for e in self.events]

    def first(self, cls: type, t: float, until: float, **match: object) -> Event | None:
        """First event of type `cls` with t <= ts < until whose fields equal `match`."""
        for ev in islice(self.events, bisect.bisect_left(self._times, t), None):
            if ev.ts >= until:
                return None
            if isinstance(ev, cls) and all(getattr(ev, k) == v for k, v in match.items()):
                return ev
        return None


def fault_window(fault: FaultRecord, window_s: float) -> tuple[float, float]:
    """[start, end] of the span in which this fault's effects are expected."""
    return fault.t - 1.0, (fault.t_done or fault.t) + window_s


def outcome(
    fault: FaultRecord,
    t0: float,
    until: float,
    successes: SuccessIndex,
    events: EventIndex,
    samples: Sequence[StatusSample],
    failures: Sequence[RequestRecord],
    window_s: float,
) -> FaultOutcome:
    """What followed `fault`; a failover counts only before `until` (the next fault)."""
    out = FaultOutcome(
        index=fault.index, kind=fault.kind, t=fault.t - t0, target=fault.name,
        target_role=fault.target_role, pid=fault.pid, error=fault.error,
    )
    w0, w1 = fault_window(fault, window_s)
    w1 = min(w1, until - 1.0)  # a failure is the next fault's once that fault's window began
    out.failed_requests = sum(1 for r in failures if w0 <= r.t_start < w1)
    if fault.t_done is not None:
        out.api_s = fault.t_done - fault.t
    if fault.error is not None or fault.name is None:
        return out
    left = events.first(TransitionEvent, fault.t, until, engine=fault.name, from_state="READY")
    if left is not None and fault.kind != "promote":
        out.detection_s = left.ts - fault.t
    if fault.target_role == "primary":
        _failover(out, fault, until, successes, events)
    _recovery(out, fault, events, samples)
    return out


def _failover(out: FaultOutcome, fault: FaultRecord, until: float, successes: SuccessIndex,
              events: EventIndex) -> None:
    ev = events.first(FailoverEvent, fault.t, until, from_engine=fault.name)
    min_epoch = None
    if isinstance(ev, FailoverEvent):
        out.new_primary, out.supervisor_failover_s, min_epoch = ev.to, ev.seconds, ev.epoch
    elif fault.epoch_before is not None:
        min_epoch = fault.epoch_before + 1
    if successes.has_engine_header:
        rec = successes.first_after(fault.t, until, out.new_primary, fault.name, min_epoch, sent_after=False)
        out.failover_method = "engine-header"
    else:
        rec = successes.first_after(fault.t, until, None, None, None, sent_after=True)
        out.failover_method = "first-success-sent-after-fault"
    if rec is not None and rec.t_first is not None:
        out.failover_s = rec.t_first - fault.t
        out.new_primary = out.new_primary or rec.engine


def _recovery(out: FaultOutcome, fault: FaultRecord, events: EventIndex,
              samples: Sequence[StatusSample]) -> None:
    name, end = fault.name, float("inf")  # a slow recovery may end after the next fault: still this one's
    ready = events.first(TransitionEvent, fault.t, end, engine=name, to="READY")
    if ready is not None:
        out.recovery_s, out.recovery_method = ready.ts - fault.t, "events"
    else:
        for s in samples:
            view = s.find(name)  # type: ignore[arg-type]
            if view is None or s.t <= fault.t or view.pid == fault.pid:
                continue
            if view.state == "READY" or (view.kind == "daemon" and view.state is None):
                out.recovery_s, out.recovery_method = s.t - fault.t, "status-poll"
                break
    rec = events.first(RecoveredEvent, fault.t, end, engine=name)
    if isinstance(rec, RecoveredEvent):
        out.weights_source, out.supervisor_recovery_s = rec.weights_source, rec.seconds
