"""Compare the supervisor's /metrics deltas over the run with what the client observed."""
from __future__ import annotations

from collections.abc import Sequence

from .events import Event
from harness.prometheus import Histogram, MetricsSnapshot
from .schema import ChaosReport, MetricComparison
from harness.stats import percentile, relative_difference

P = "understudy_"


def compare(name: str, supervisor: float | None, client: float | None, tol: float, note: str = "",
            comparable: bool = True, floor_s: float | None = None) -> MetricComparison:
    """One comparison; agree is None when either side is missing. Within ``tol`` (relative), or for a
    time figure within ``floor_s`` (absolute: a few ms of sampling decide the ratio of two tens of
    ms); ``rule`` says which decided."""
    if supervisor is None or client is None:
        return MetricComparison(name=name, supervisor=supervisor, client=client, comparable=comparable,
                                note=note or "one side missing")
    diff, gap = relative_difference(supervisor, client), abs(supervisor - client)
    if diff <= tol:
        agree, rule = True, f"relative: {diff:.1%} <= {tol:.0%}"
    elif floor_s is not None and gap <= floor_s:
        agree, rule = True, f"absolute: {gap * 1e3:.1f} ms <= the {floor_s * 1e3:g} ms floor ({diff:.1%} > {tol:.0%})"
    else:
        agree = False
        rule = f"relative: {diff:.1%} > {tol:.0%}" + ("" if floor_s is None else
                                                       f"; absolute: {gap * 1e3:.1f} ms > {floor_s * 1e3:g} ms")
    return MetricComparison(name=name, supervisor=supervisor, client=client, relative_diff=diff,
                            agree=agree, comparable=comparable, note=note, rule=rule)


def honest_metrics(before: MetricsSnapshot | None, after: MetricsSnapshot | None, report: ChaosReport,
                   events: Sequence[Event], tol: float, floor_s: float | None = None) -> list[MetricComparison]:
    """Failover, recovery, cache and router figures from both sides (deltas over the run); time
    figures also agree within ``floor_s`` (absolute), counts only within ``tol``."""
    if before is None or after is None:
        return [MetricComparison(name="metrics", supervisor=None, client=None,
                                 note="/metrics was not scraped at both ends of the run")]

    def delta(sample: str, **labels: str) -> float | None:
        return after.increase_since(before, sample, **labels)

    out = [compare("failovers (count)", delta(f"{P}failovers_total"), float(report.failovers_observed), tol,
                   "client: primary changes it was served across (distinct epoch headers - 1); "
                   "back-to-back failovers with no request between them are seen as one")]
    # Both sides time detection -> first success on the new primary: the client subtracts the
    # detection delay it saw (fault -> victim out of READY) from its fault -> first-success span.
    fo = [o.failover_s - o.detection_s for o in report.faults
          if o.failover_s is not None and o.detection_s is not None]
    out += _histogram("failover_seconds", before, after, fo, tol, floor_s,
                      "supervisor: failure detected -> the new primary's first success (router), or -> its "
                      "promotion when no request was in progress (a quiet node's idle time is no failover's); "
                      "client: fault -> first success served by the new primary, minus fault -> detection, "
                      "which counts the wait for its next request too", comparable=False)
    engine = [o for o in report.faults if o.kind not in ("promote", "rollout")
              and o.target_role in ("primary", "standby") and o.recovery_s is not None]
    out.append(compare("recoveries (count)", delta(f"{P}recovery_seconds_count"), float(len(engine)), tol,
                       "client: engine kills/stops followed by a READY replacement"))
    gaps = [o.detection_s for o in engine if o.detection_s is not None]
    gap = sum(gaps) / len(gaps) if gaps else None
    hung = [o for o in engine if o.kind.startswith("stop")]
    note = ("supervisor times failure detected -> replacement READY; the client times the fault -> READY "
            f"event; mean detection {'unknown' if gap is None else f'{gap * 1000:.1f} ms'}")
    if hung:
        note += f"; {len(hung)} SIGSTOP fault(s) are detected by heartbeat timeout, so the spans differ"
    out += _histogram("recovery_seconds", before, after, [o.recovery_s for o in engine],  # type: ignore[misc]
                      tol, floor_s, note, comparable=not hung)
    out.append(compare("weight cache hits", delta(f"{P}weight_cache_requests_total", result="hit"),
                       float(report.cache.hits), tol, "client: engine starts seen in /status polls with cache_hit"))
    out.append(compare("weight cache misses", delta(f"{P}weight_cache_requests_total", result="miss"),
                       float(report.cache.misses), tol, "client: engine starts seen in /status polls with disk:*"))
    out += _stall(before, after, report, tol, floor_s)
    req = report.requests.all
    out.append(compare("router requests", delta(f"{P}router_requests_total"), float(req.sent), tol,
                       "client: requests sent (the router also counts other clients' requests)"))
    out.append(compare("router 200 responses", delta(f"{P}router_requests_total", code="200"), float(req.succeeded),
                       tol, "a 200 whose stream broke later counts as a client failure"))
    out.append(compare("router retries", delta(f"{P}router_retries_total"),
                       None if req.retried is None else float(req.retried), tol,
                       "client: responses with a retries header > 0" if req.retried is not None
                       else "the router sets no retries header: the client cannot count retries"))
    return out


def _stall(before: MetricsSnapshot, after: MetricsSnapshot, report: ChaosReport, tol: float,
           floor_s: float | None) -> list[MetricComparison]:
    """Migration stall: the router's figure for each continued stream vs the client's longest wait."""
    out = []
    c, r = report.requests.stall_client, report.requests.stall_router
    if c is not None and r is not None and c.n:
        out.append(compare("migration stall, continued streams (mean)", r.mean, c.mean, tol,
                           f"{c.n} continuations; router: last chunk sent -> first chunk of the continuation "
                           f"(events); client: the wait for that same chunk", floor_s=floor_s))
    if after.has(f"{P}migration_stall_seconds_count"):
        h = _hist(before, after, "migration_stall_seconds")
        n = after.increase_since(before, f"{P}migrations_total", result="continued")
        out.append(compare("migrations continued (count)", n, float(report.requests.migrations.get("continued", 0)),
                           tol, f"client: `continued` migration events; histogram mean "
                                f"{'–' if h.mean is None else f'{h.mean * 1000:.1f} ms'} (streams and whole responses)"))
    return out


def _hist(before: MetricsSnapshot, after: MetricsSnapshot, name: str) -> Histogram:
    return after.histogram(f"{P}{name}").minus(before.histogram(f"{P}{name}"))


def _histogram(name: str, before: MetricsSnapshot, after: MetricsSnapshot, client: list[float], tol: float,
               floor_s: float | None, note: str, comparable: bool = True) -> list[MetricComparison]:
    if not after.has(f"{P}{name}_count"):
        return [compare(f"{name} (mean)", None, None, tol, f"{P}{name} not exported")]
    h = _hist(before, after, name)
    cmean = sum(client) / len(client) if client else None
    p99 = compare(f"{name} (p99)", h.quantile(0.99), percentile(client, 99), tol, comparable=comparable,
                  floor_s=floor_s)
    bucket = h.bucket_of(0.99)
    if bucket is not None and p99.client is not None:
        lo, hi = bucket
        inside = lo * (1 - tol) <= p99.client <= hi * (1 + tol)
        if inside and not p99.agree:
            p99.rule = f"the supervisor's bucket ({p99.rule})"
        p99.agree = bool(p99.agree) or inside
        p99.note = (f"supervisor p99 lies in the bucket ({lo:g}, {hi:g}] s; the client's p99 is "
                    f"{'inside' if inside else 'OUTSIDE'} it (+-{tol:.0%})")
    return [compare(f"{name} (mean)", h.mean, cmean, tol, note, comparable=comparable, floor_s=floor_s), p99]
