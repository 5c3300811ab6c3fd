"""Turn the raw observations of a run (RunData) into the ChaosReport."""
from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .active import active_engines, unexpected
from .events import Event, MigrationEvent, RecoveredEvent
from .honest import honest_metrics
from .matching import EventIndex, SuccessIndex, fault_window, outcome
from .memory import growth_pct
from harness.prometheus import MetricsSnapshot
from .records import FaultRecord, RequestRecord, StatusSample
from .schema import (
    Cache, ChaosReport, Check, FaultOutcome, KindSummary, Latency, Memory, RequestCounts, Requests,
)
from harness.stats import summarize


@dataclass
class RunData:
    """Everything observed during one run, as collected (nothing derived yet)."""

    t0: float
    t_end: float
    target: dict[str, str]
    options: dict[str, Any]
    requests: list[RequestRecord] = field(default_factory=list)
    not_sent: int = 0
    faults: list[FaultRecord] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    event_errors: list[str] = field(default_factory=list)
    samples: list[StatusSample] = field(default_factory=list)
    metrics_before: MetricsSnapshot | None = None
    metrics_after: MetricsSnapshot | None = None
    memory: Memory = field(default_factory=Memory)
    aborted: str | None = None
    notes: list[str] = field(default_factory=list)


PLANNED = ("promote", "rollout")


def greedy_differing(requests: Sequence[RequestRecord]) -> list[RequestRecord]:
    """Successful outputs unlike the most common one of their endpoint (the load is greedy, one
    prompt: every output of an endpoint must be the same, streamed or not, migrated or not)."""
    out: list[RequestRecord] = []
    for endpoint in {r.endpoint for r in requests}:
        done = [r for r in requests if r.ok and r.endpoint == endpoint and r.text is not None]
        if done:
            common = Counter(r.text for r in done).most_common(1)[0][0]
            out += [r for r in done if r.text != common]
    return out


def continued_ids(events: Sequence[Event]) -> set[str]:
    """Response ids of the requests the router continued on another engine."""
    return {e.request_id for e in events if isinstance(e, MigrationEvent) and e.result == "continued"}


def migration_stalls(requests: Sequence[RequestRecord], events: Sequence[Event]) -> tuple[list[float], list[float]]:
    """(client, router) stall of each continuation of a stream: the client's wait for its chunk
    number `chunks_before` (the first after the seam), and the router's `stall_s`."""
    by_id = {r.response_id: r for r in requests if r.stream and r.response_id}
    client, router = [], []
    for e in events:
        if not (isinstance(e, MigrationEvent) and e.result == "continued" and e.stall_s is not None
                and e.chunks_before is not None and (r := by_id.get(e.request_id)) is not None):
            continue
        n, times = e.chunks_before, r.chunk_times
        if n < len(times):
            client.append(times[n] - (times[n - 1] if n else r.t_start))
            router.append(e.stall_s)
    return client, router


def epoch_changes(requests: Sequence[RequestRecord]) -> int:
    """Primary changes seen from the client: distinct epochs among served responses, minus one."""
    epochs = {r.epoch for r in requests if r.ok and r.epoch is not None}
    return max(len(epochs) - 1, 0)


def count(requests: Sequence[RequestRecord]) -> RequestCounts:
    """sent / succeeded / failed by kind / retried for a set of requests."""
    failed = Counter(r.error or "unknown" for r in requests if not r.ok)
    with_header = [r.retries for r in requests if r.retries is not None]
    return RequestCounts(
        sent=len(requests),
        succeeded=sum(1 for r in requests if r.ok),
        failed=sum(failed.values()),
        failed_by_kind=dict(failed.most_common()),
        retried=sum(1 for n in with_header if n > 0) if with_header else None,
    )


def cache_from_status(samples: Sequence[StatusSample], events: Sequence[Event] = ()) -> Cache:
    """Hits and misses (with reasons) of every engine start seen during the run, in the /status polls
    or in `recovered` events (a replacement can come and go between two polls); each
    name+incarnation once; those already loaded at the first poll are not counted."""
    seen: set[tuple[str, int | None]] = set()
    if samples:
        seen = {(e.name, e.incarnation) for e in samples[0].engines if e.weights_source}
    starts = [(e.name, e.incarnation, e.weights_source) for s in samples[1:] for e in s.engines]
    starts += [(e.engine, e.incarnation, e.weights_source) for e in events
               if isinstance(e, RecoveredEvent) and e.incarnation is not None]
    hits, reasons = 0, Counter[str]()
    for name, incarnation, source in starts:
        if source is None or (name, incarnation) in seen:
            continue
        seen.add((name, incarnation))
        if source == "cache_hit":
            hits += 1
        else:
            reasons[source.removeprefix("disk:")] += 1
    misses = sum(reasons.values())
    total = hits + misses
    return Cache(hits=hits, misses=misses, hit_rate=hits / total if total else None, miss_reasons=dict(reasons))


def by_kind(outcomes: Sequence[FaultOutcome]) -> dict[str, KindSummary]:
    """Detection, failover and recovery per fault kind (a SIGSTOP is not a SIGKILL)."""
    out = {}
    for kind in sorted({o.kind for o in outcomes}):
        mine = [o for o in outcomes if o.kind == kind and o.error is None]
        out[kind] = KindSummary(
            n=len(mine),
            failed_requests=sum(o.failed_requests for o in mine),
            detection=summarize([o.detection_s for o in mine if o.detection_s is not None]),
            failover=summarize([o.failover_s for o in mine if o.failover_s is not None]),
            recovery=summarize([o.recovery_s for o in mine if o.recovery_s is not None]),
        )
    return out


def _outcomes(data: RunData, window_s: float) -> list[FaultOutcome]:
    successes = SuccessIndex(data.requests)
    failures = [r for r in data.requests if not r.ok]
    events = EventIndex(data.events)
    out = []
    for i, fault in enumerate(data.faults):
        until = data.faults[i + 1].t if i + 1 < len(data.faults) else data.t_end + 1.0
        out.append(outcome(fault, data.t0, until, successes, events, data.samples, failures, window_s))
    return out


def merge(windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping [start, end] windows merged, sorted by start."""
    out: list[tuple[float, float]] = []
    for w0, w1 in sorted(windows):
        if out and w0 <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], w1))
        else:
            out.append((w0, w1))
    return out


def inside(t: float, merged: list[tuple[float, float]]) -> bool:
    """Whether t falls in one of the merged windows."""
    i = bisect.bisect_right(merged, (t, math.inf)) - 1
    return i >= 0 and merged[i][0] <= t <= merged[i][1]


def _latency(data: RunData, windows: list[tuple[float, float]], window_s: float) -> Latency:
    steady, around = [], []
    for r in data.requests:
        if r.ok:
            (around if inside(r.t_start, windows) else steady).append(r.latency)
    return Latency(window_s=window_s, steady=summarize(steady), around_failovers=summarize(around))


def _memory(mem: Memory) -> Memory:
    """Growth from start to end, only where both samples were read without error."""
    if mem.start is None or mem.end is None:
        return mem
    start, end = mem.start, mem.end
    if start.error is None and end.error is None:
        mem.rss_growth_pct = growth_pct(start.rss_bytes, end.rss_bytes)
        mem.pss_growth_pct = growth_pct(start.pss_bytes, end.pss_bytes)
    if start.gpu_used_bytes is not None and end.gpu_used_bytes is not None:
        mem.gpu_growth_bytes = [b - a for a, b in zip(start.gpu_used_bytes, end.gpu_used_bytes)]
    return mem


def build_report(data: RunData) -> ChaosReport:
    """Derive every section of the report from the raw observations."""
    window_s = float(data.options.get("failover_window_s", 2.0))
    tol = float(data.options.get("tolerance", 0.10))
    windows = merge([fault_window(f, window_s) for f in data.faults if f.error is None])
    outcomes = _outcomes(data, window_s)
    differing, continued = greedy_differing(data.requests), continued_ids(data.events)
    requests = Requests(
        all=count(data.requests),
        streaming=count([r for r in data.requests if r.stream]),
        non_streaming=count([r for r in data.requests if not r.stream]),
        not_sent_client_busy=data.not_sent,
        cut_streams=sum(1 for r in data.requests if r.stream and r.cut),
        greedy_differ=len(differing),
        greedy_differ_continued=sum(1 for r in differing if r.response_id in continued),
        continued_outputs=sum(1 for r in data.requests if r.ok and r.text is not None and r.response_id in continued),
        migrations=dict(Counter(e.result for e in data.events if isinstance(e, MigrationEvent))),
    )
    client_stall, router_stall = migration_stalls(data.requests, data.events)
    requests.stall_client, requests.stall_router = summarize(client_stall), summarize(router_stall)
    cache = cache_from_status(data.samples, data.events)
    active = active_engines(data.samples, data.events, windows, data.t0, data.t_end)
    unplanned = [o for o in outcomes if o.kind not in PLANNED]
    recoveries = [o for o in unplanned if o.recovery_s is not None and o.target_role in ("primary", "standby")]
    report = ChaosReport(
        started_at=data.t0,
        ended_at=data.t_end,
        duration_s=data.t_end - data.t0,
        completed=data.aborted is None,
        aborted=data.aborted,
        target=data.target,
        options=data.options,
        requests=requests,
        latency=_latency(data, windows, window_s),
        faults=outcomes,
        failover=summarize([o.failover_s for o in outcomes if o.failover_s is not None]),
        recovery=summarize([o.recovery_s for o in recoveries]),  # type: ignore[misc]
        daemon_recovery=summarize([o.recovery_s for o in unplanned
                                   if o.recovery_s is not None and o.target_role == "daemon"]),
        detection=summarize([o.detection_s for o in unplanned
                             if o.detection_s is not None and o.target_role != "daemon"]),
        by_kind=by_kind(outcomes),
        failovers_observed=epoch_changes(data.requests),
        worst_recovery=max(recoveries, key=lambda o: o.recovery_s or 0.0, default=None),
        cache=cache,
        active_engines=active,
        memory=_memory(data.memory),
        honest_metrics=[],
        checks=[],
        events_seen=len(data.events),
        event_errors=data.event_errors[:20],
        notes=list(data.notes),
    )
    if data.metrics_before is not None and data.metrics_after is not None:
        retries = data.metrics_after.increase_since(data.metrics_before, "understudy_router_retries_total")
        report.requests.router_retries = None if retries is None else int(retries)
    report.honest_metrics = honest_metrics(data.metrics_before, data.metrics_after, report, data.events, tol,
                                           float(data.options.get("tolerance_floor_s", 0.010)))
    report.checks = checks(report, unexpected(active, data.samples, windows), data.options)
    return report


def checks(report: ChaosReport, active_problems: list[str], options: dict[str, Any]) -> list[Check]:
    """Pass/fail verdicts against the targets of issue 5 (and the SLOs given as options)."""
    planned = sum(options.get("faults", {}).values())
    injected = sum(1 for f in report.faults if f.error is None)
    out = [
        Check(name="run completed", ok=report.completed, detail=report.aborted or "ran to the end"),
        Check(name="every planned fault injected", ok=injected == planned,
              detail=f"{injected} of {planned} injected"
              + "".join(f"; #{f.index} {f.kind}: {f.error}" for f in report.faults if f.error)[:300]),
        Check(name="no failed non-streaming request", ok=report.requests.non_streaming.failed == 0,
              detail=f"{report.requests.non_streaming.failed} failed of {report.requests.non_streaming.sent}"),
        Check(name="no cut stream", ok=report.requests.cut_streams == 0,
              detail=f"{report.requests.cut_streams} of {report.requests.streaming.sent} streams cut; "
                     f"migrations: {report.requests.migrations or 'none'}"),
        Check(name="every greedy output identical to its uninterrupted run", ok=report.requests.greedy_differ == 0,
              detail=f"{report.requests.greedy_differ} of {report.requests.all.succeeded} outputs differ"),
        Check(name="exactly one active engine outside failovers", ok=not active_problems,
              detail="; ".join(active_problems) or "never more than one; zero only inside fault windows"),
    ]
    limit = float(options.get("max_memory_growth_pct", 10.0))
    growth = report.memory.pss_growth_pct if report.memory.pss_growth_pct is not None else report.memory.rss_growth_pct
    out.append(Check(name=f"memory back to start (growth <= {limit:g}%)", ok=growth is not None and growth <= limit,
                     detail="not measured" if growth is None else f"{growth:+.1f}% of the process tree"))
    for key, dist, label in (("slo_failover_p99_s", report.failover, "failover"),
                             ("slo_recovery_p99_s", report.recovery, "recovery")):
        slo = options.get(key)
        if slo is not None:  # (under 100 samples there is no p99: their max must meet it)
            tail = dist.p99 if dist.p99 is not None else dist.max
            said = f"p99 {tail:.3f} s over {dist.n}" if dist.p99 is not None else f"max of {dist.n} {tail:.3f} s"
            out.append(Check(name=f"{label} p99 <= {slo:g} s", ok=tail is not None and tail <= slo,
                             detail="no samples" if tail is None else said))
    compared = [m for m in report.honest_metrics if m.agree is not None and m.comparable]
    disagree = [m.name for m in compared if not m.agree]
    floor = float(options.get("tolerance_floor_s", 0.010))
    within = f"relative {float(options.get('tolerance', 0.10)):.0%}, time figures also {floor * 1e3:g} ms absolute"
    detail = (("differ: " + ", ".join(disagree)) if disagree else "all compared figures within tolerance") + \
        f" ({within}; each figure's rule in the table)"
    if any(f.kind == "kill-supervisor" and f.error is None for f in report.faults):
        detail += " (kill-supervisor restarted the supervisor: its counters started again at 0, so the " \
                  "supervisor's figures cover only the time since its last restart)"
    out.append(Check(name="supervisor metrics agree with the client", ok=bool(compared) and not disagree,
                     detail=detail if compared else "nothing compared (/metrics not read at both ends)"))
    return out
