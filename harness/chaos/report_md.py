"""report.md: the ChaosReport for people."""
from __future__ import annotations

from harness.stats import Distribution

from .schema import ChaosReport, RequestCounts, Requests


def _s(x: float | None, unit: str = "s") -> str:
    if x is None:
        return "–"
    return f"{x * 1000:.1f} ms" if unit == "s" and x < 1 else f"{x:.3f} {unit}"


def _dist_row(name: str, d: Distribution) -> str:
    return f"| {name} | {d.n} | {_s(d.min)} | {_s(d.p50)} | {_s(d.p90)} | {_s(d.p99)} | {_s(d.max)} | {_s(d.mean)} |"


def _trio(d: Distribution) -> str:
    return "–" if d.n == 0 else f"{_s(d.p50)} / {_s(d.p99)} / {_s(d.max)}"


def _counts_row(name: str, c: RequestCounts) -> str:
    kinds = ", ".join(f"{k}: {v}" for k, v in c.failed_by_kind.items()) or "–"
    retried = "not reported" if c.retried is None else str(c.retried)
    return f"| {name} | {c.sent} | {c.succeeded} | {c.failed} | {kinds} | {retried} |"


def _mb(b: int | None) -> str:
    return "–" if b is None else f"{b / 2**20:.1f} MiB"


def render(r: ChaosReport, png_name: str | None) -> str:
    """Markdown for report.md."""
    lines = [
        "# Understudy chaos report",
        "",
        f"- Target: data {r.target.get('data_url')}, admin {r.target.get('admin_url')}, "
        f"events {r.target.get('events_endpoint')}",
        f"- Duration: {r.duration_s:.1f} s; {len(r.faults)} faults; {r.events_seen} events",
        f"- Status: {'completed' if r.completed else 'ABORTED: ' + (r.aborted or '')}",
        "",
        "## Verdict",
        "",
        *[f"- {'PASS' if c.ok else 'FAIL'} {c.name}: {c.detail}" for c in r.checks],
        "",
        "## Requests",
        "",
        "| | sent | succeeded | failed | failed by kind | retried by the router |",
        "|---|---|---|---|---|---|",
        _counts_row("all", r.requests.all),
        _counts_row("non-streaming", r.requests.non_streaming),
        _counts_row("streaming", r.requests.streaming),
        "",
        f"Arrivals not sent because the concurrency limit was reached: {r.requests.not_sent_client_busy}. "
        f"Retries the router counted (/metrics): "
        f"{'–' if r.requests.router_retries is None else r.requests.router_retries}.",
        "",
        f"Cut streams (no finish_reason + [DONE], or an error event): {r.requests.cut_streams}. "
        f"Greedy outputs that differ from their uninterrupted run: {r.requests.greedy_differ} "
        f"({_differ_split(r.requests)}). "
        f"Migrations by result (router events): {r.requests.migrations or 'none'}.",
        "",
        *([f"Migration stall of continued streams (p50 / p99 / max): client {_trio(r.requests.stall_client)}, "
           f"router {_trio(r.requests.stall_router)}.", ""]
          if r.requests.stall_client is not None and r.requests.stall_router is not None else []),
        "## Latency and fault timings",
        "",
        "| | n | min | p50 | p90 | p99 | max | mean |",
        "|---|---|---|---|---|---|---|---|",
        _dist_row("latency, steady", r.latency.steady),
        _dist_row(f"latency, within {r.latency.window_s:g} s of a fault", r.latency.around_failovers),
        _dist_row("failover (fault → first success from the new primary)", r.failover),
        _dist_row("detection (fault → supervisor noticed)", r.detection),
        _dist_row("engine recovery (fault → replacement READY)", r.recovery),
        _dist_row("daemon recovery (fault → daemon READY)", r.daemon_recovery),
        "",
        f"Primary changes the client was served across: {r.failovers_observed}.",
        "",
        "Per fault kind (p50 / p99 / max):",
        "",
        "| kind | n | failed reqs | detection | failover | recovery |",
        "|---|---|---|---|---|---|",
        *[f"| {k} | {v.n} | {v.failed_requests} | {_trio(v.detection)} | {_trio(v.failover)} | {_trio(v.recovery)} |"
          for k, v in r.by_kind.items()],
        "",
    ]
    if r.worst_recovery is not None:
        w = r.worst_recovery
        lines += [f"Worst recovery: fault {w.index} ({w.kind} {w.target}) {_s(w.recovery_s)}, "
                  f"weights from {w.weights_source or 'unknown'}.", ""]
    c = r.cache
    rate = "–" if c.hit_rate is None else f"{100 * c.hit_rate:.1f}%"
    lines += ["## Weight cache", "", f"Hits {c.hits}, misses {c.misses}, hit rate {rate}."]
    if c.miss_reasons:
        lines.append("Miss reasons: " + ", ".join(f"{k}: {v}" for k, v in c.miss_reasons.items()) + ".")
    a = r.active_engines
    lines += [
        "", "## Active engines", "",
        f"Ever other than 1: {'yes' if a.ever_not_one else 'no'}; more than 1: "
        f"{'YES' if a.ever_more_than_one else 'no'}; min {a.min}, max {a.max}; "
        f"{a.status_polls_not_one} of {a.status_polls} /status polls not 1.",
    ]
    for p in a.periods[:20]:
        lines.append(f"- at {p.start:.2f} s for {_s(p.seconds)}: {p.count} active "
                     f"({'during a fault' if p.during_fault else 'OUTSIDE any fault'})")
    m = r.memory
    lines += ["", "## Memory", "", "| | processes | RSS | PSS | GPU used |", "|---|---|---|---|---|"]
    for name, s in (("start", m.start), ("end", m.end)):
        if s is not None:
            gpu = "–" if s.gpu_used_bytes is None else ", ".join(_mb(b) for b in s.gpu_used_bytes)
            lines.append(f"| {name} | {s.processes} | {_mb(s.rss_bytes)} | {_mb(s.pss_bytes)} | {gpu} |")
    lines.append("")
    lines.append(f"Growth: RSS {_pct(m.rss_growth_pct)}, PSS {_pct(m.pss_growth_pct)}"
                 + (f", GPU {', '.join(_mb(b) for b in m.gpu_growth_bytes)}" if m.gpu_growth_bytes else "") + ".")
    lines += ["", "## Honest metrics (supervisor /metrics vs client)", "",
              "| figure | supervisor | client | diff | agree | by | note |", "|---|---|---|---|---|---|---|"]
    for h in r.honest_metrics:
        agree = "–" if h.agree is None else ("yes" if h.agree else ("NO" if h.comparable else "no (differs by design)"))
        diff = "–" if h.relative_diff is None else f"{100 * h.relative_diff:.1f}%"
        lines.append(f"| {h.name} | {_num(h.supervisor)} | {_num(h.client)} | {diff} | {agree} | {h.rule or '–'} "
                     f"| {h.note} |")
    lines += ["", "## Faults", "",
              "| # | t (s) | kind | target | admin call | detection | failover | recovery | weights | failed reqs | error |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in r.faults[:500]:
        lines.append(f"| {f.index} | {f.t:.2f} | {f.kind} | {f.target or '–'} | {_s(f.api_s)} | {_s(f.detection_s)} | {_s(f.failover_s)} | "
                     f"{_s(f.recovery_s)} | {f.weights_source or '–'} | {f.failed_requests} | {f.error or ''} |")
    if png_name:
        lines += ["", f"![latency over time]({png_name})"]
    if r.notes or r.event_errors:
        lines += ["", "## Notes", "", *[f"- {n}" for n in r.notes], *[f"- event: {e}" for e in r.event_errors]]
    return "\n".join(lines) + "\n"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:+.1f}%"


def _num(x: float | None) -> str:
    return "–" if x is None else (f"{x:.0f}" if float(x).is_integer() else f"{x:.4g}")


def _differ_split(q: Requests) -> str:
    """Differing outputs among continued and other requests: at equal rates, the cause is the
    numerics of batching (bf16), not the continuation."""
    rest = q.all.succeeded - q.continued_outputs
    return (f"continued: {q.greedy_differ_continued} of {q.continued_outputs}; "
            f"never continued: {q.greedy_differ - q.greedy_differ_continued} of {rest}")
