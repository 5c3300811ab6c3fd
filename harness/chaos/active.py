"""How many engines were active (primary and READY) over time, from events and /status polls."""
from __future__ import annotations

from collections.abc import Sequence

from .events import Event, FailoverEvent, TransitionEvent
from .records import StatusSample
from .schema import ActiveEngines, ActivePeriod

Window = tuple[float, float]


def event_timeline(initial: StatusSample | None, events: Sequence[Event]) -> list[tuple[float, int]]:
    """(ts, active count) after every event, starting from the roles/states of `initial`."""
    state: dict[str, str | None] = {}
    role: dict[str, str | None] = {}
    if initial is not None:
        for e in initial.engines:
            state[e.name], role[e.name] = e.state, e.role
    timeline: list[tuple[float, int]] = []
    if initial is not None:
        timeline.append((initial.t, initial.active_count()))
    for ev in sorted(events, key=lambda e: e.ts):
        if isinstance(ev, TransitionEvent):  # daemons have no role, so they never count
            state[ev.engine] = ev.to
            if ev.role is not None:
                role[ev.engine] = ev.role
        elif isinstance(ev, FailoverEvent):
            if ev.from_engine is not None and ev.from_engine != ev.to:
                role[ev.from_engine] = None
            role[ev.to] = "primary"
        else:
            continue
        count = sum(1 for n, s in state.items() if s == "READY" and role.get(n) == "primary")
        timeline.append((ev.ts, count))
    return timeline


def _inside(t0: float, t1: float, windows: Sequence[Window]) -> bool:
    return any(t0 < w1 and t1 > w0 for w0, w1 in windows)


def periods_not_one(timeline: list[tuple[float, int]], end: float, windows: Sequence[Window], t0: float) -> list[ActivePeriod]:
    """Spans with a count other than 1, each marked as inside a fault window or not."""
    out: list[ActivePeriod] = []
    for i, (ts, count) in enumerate(timeline):
        if count == 1:
            continue
        until = timeline[i + 1][0] if i + 1 < len(timeline) else end
        if out and out[-1].count == count and abs(out[-1].start + out[-1].seconds - (ts - t0)) < 1e-6:
            out[-1].seconds += until - ts
            continue
        out.append(ActivePeriod(start=ts - t0, seconds=max(0.0, until - ts), count=count, during_fault=False))
    for p in out:
        p.during_fault = _inside(t0 + p.start, t0 + p.start + max(p.seconds, 1e-6), windows)
    return out


def active_engines(
    samples: Sequence[StatusSample], events: Sequence[Event], windows: Sequence[Window], t0: float, end: float
) -> ActiveEngines:
    """Combine the event timeline and the status polls into the report section."""
    timeline = event_timeline(samples[0] if samples else None, events)
    periods = periods_not_one(timeline, end, windows, t0)
    counts = [c for _, c in timeline] + [s.active_count() for s in samples]
    polls_bad = [s for s in samples if s.active_count() != 1]
    return ActiveEngines(
        ever_not_one=bool(periods) or bool(polls_bad),
        ever_more_than_one=any(c > 1 for c in counts),
        min=min(counts) if counts else None,
        max=max(counts) if counts else None,
        periods=periods[:1000],
        status_polls=len(samples),
        status_polls_not_one=len(polls_bad),
    )


def unexpected(section: ActiveEngines, samples: Sequence[StatusSample], windows: Sequence[Window]) -> list[str]:
    """Reasons the count was wrong outside a failover (empty when it never was)."""
    reasons = []
    if section.ever_more_than_one:
        reasons.append(f"more than one active engine (max {section.max})")
    outside = [p for p in section.periods if not p.during_fault]
    if outside:
        reasons.append(f"{len(outside)} span(s) with a count other than 1 outside any fault window")
    polls = [s for s in samples if s.active_count() != 1 and not _inside(s.t, s.t + 1e-6, windows)]
    if polls:
        reasons.append(f"{len(polls)} /status poll(s) outside fault windows did not show exactly one")
    return reasons
