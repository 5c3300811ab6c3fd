"""Chaos analysis and report writing on a hand-made run whose right answers are known."""
from __future__ import annotations

from pathlib import Path

import pytest

from harness.chaos.analysis import RunData, build_report, inside, merge
from harness.chaos.events import FailoverEvent, RecoveredEvent, TransitionEvent
from harness.prometheus import MetricsSnapshot
from harness.chaos.records import EngineView, FaultRecord, RequestRecord, StatusSample
from harness.chaos.schema import ChaosReport, MemorySample
from harness.chaos.writer import write_report
from supervisor.metrics import Metrics

T0 = 1_700_000_000.0


def _tr(t: float, engine: str, frm: str, to: str, role: str | None) -> TransitionEvent:
    return TransitionEvent.model_validate({"type": "transition", "engine": engine, "from": frm, "to": to,
                                           "role": role, "ts": T0 + t})


def _status(t: float, a: tuple[str, str], b: tuple[str, str], daemon_pid: int = 900, a_inc: int = 1) -> StatusSample:
    """a and b as (role, state); a's incarnation 2 (pid 101) has no weights until it is READY."""
    a_src = "cache_hit" if a_inc == 1 or a[1] == "READY" else None
    return StatusSample(t=T0 + t, epoch=1, engines=[
        EngineView("a", "engine", a[0], a[1], 100 if a_inc == 1 else 101, a_inc, a_src),
        EngineView("b", "engine", b[0], b[1], 200, 1, "cache_hit")],
        daemons=[EngineView("daemon-rank0", "daemon", None, "READY", daemon_pid)])


def _requests() -> list[RequestRecord]:
    """Every 0.1 s for 20 s, 20 ms each; a before the kill at 5.0 s, b (epoch 2) from 5.08 s."""
    out = []
    for i in range(200):
        t = T0 + i * 0.1
        after = t >= T0 + 5.0
        r = RequestRecord(id=i, endpoint="chat" if i % 2 else "completion", stream=i % 3 == 0, t_start=t,
                          t_first=t + 0.02, t_end=t + 0.02, ok=True, status=200,
                          engine="b" if after else "a", epoch=2 if after else 1)
        out.append(r)
    out[50].t_first, out[50].t_end = T0 + 5.08, T0 + 5.09  # sent at the kill, retried, served by b
    broken = out[51 if out[51].stream else 54]
    broken.ok, broken.error, broken.t_first = False, "stream_broken", None
    return out


def _run(events: list, metrics: tuple[MetricsSnapshot, MetricsSnapshot] | None = None) -> RunData:
    data = RunData(t0=T0, t_end=T0 + 20.0, target={"data_url": "http://127.0.0.1:1"},
                   options={"failover_window_s": 2.0, "tolerance": 0.1, "faults": {"kill-primary": 1, "kill-daemon": 1},
                            "max_memory_growth_pct": 10.0, "slo_failover_p99_s": 0.15})
    data.requests = _requests()
    data.faults = [
        FaultRecord(0, "kill-primary", T0 + 5.0, "primary", "a", 100, epoch_before=1, primary_before="a"),
        FaultRecord(1, "kill-daemon", T0 + 10.0, "daemon", "daemon-rank0", 900, epoch_before=2, primary_before="b"),
    ]
    data.events = events
    data.samples = [_status(0.0, ("primary", "READY"), ("standby", "READY")),
                    _status(5.02, ("primary", "EXITED"), ("standby", "READY")),
                    _status(5.5, ("standby", "STARTING"), ("primary", "READY"), a_inc=2),
                    _status(10.5, ("standby", "READY"), ("primary", "READY"), daemon_pid=901, a_inc=2)]
    data.memory.start = MemorySample(t=T0, processes=5, rss_bytes=1000, pss_bytes=800)
    data.memory.end = MemorySample(t=T0 + 20, processes=5, rss_bytes=1050, pss_bytes=820)
    if metrics:
        data.metrics_before, data.metrics_after = metrics
    return data


def _failover_events() -> list:
    return [
        _tr(5.01, "a", "READY", "EXITED", "primary"),
        FailoverEvent.model_validate({"type": "failover", "reason": "exit", "from": "a", "to": "b", "epoch": 2,
                                      "seconds": 0.02, "ts": T0 + 5.03}),
        _tr(5.6, "a", "BACKOFF", "STARTING", "standby"),
        _tr(6.5, "a", "WARMING", "READY", "standby"),
        RecoveredEvent(type="recovered", engine="a", seconds=1.49, weights_source="cache_hit", ts=T0 + 6.5),
        _tr(10.01, "daemon-rank0", "READY", "EXITED", None),
        _tr(11.0, "daemon-rank0", "ATTACHING", "READY", None),
    ]


def _metrics() -> tuple[MetricsSnapshot, MetricsSnapshot]:
    m = Metrics()
    before = MetricsSnapshot.parse(m.render().decode())
    m.failovers.labels(reason="exit").inc()
    m.failover_seconds.observe(0.07)  # detection -> first success: the client's 0.08 minus 0.01 detection
    m.recovery_seconds.observe(1.49)
    m.count_weights_source("cache_hit")
    m.router_requests.labels(code="200").inc(200)
    return before, MetricsSnapshot.parse(m.render().decode())


def test_fault_outcomes_and_sections() -> None:
    report = build_report(_run(_failover_events(), _metrics()))
    kill, daemon = report.faults
    assert kill.failover_s == pytest.approx(0.08) and kill.failover_method == "engine-header"
    assert kill.new_primary == "b" and kill.supervisor_failover_s == 0.02
    assert kill.recovery_s == pytest.approx(1.5) and kill.recovery_method == "events"
    assert kill.weights_source == "cache_hit" and kill.supervisor_recovery_s == 1.49
    assert daemon.failover_s is None and daemon.recovery_s == pytest.approx(1.0)
    assert report.worst_recovery is not None and report.worst_recovery.index == 0
    assert (report.cache.hits, report.cache.misses, report.cache.hit_rate) == (1, 0, 1.0)
    req = report.requests
    assert (req.all.sent, req.all.failed, req.non_streaming.failed) == (200, 1, 0)
    assert req.streaming.failed_by_kind == {"stream_broken": 1}
    assert req.all.retried is None  # no retries header in these records
    # [fault - 1 s, fault + 2 s] around each of the 2 faults: 31 + 31 requests, one of them failed
    assert (report.latency.around_failovers.n, report.latency.steady.n) == (61, 138)
    assert report.latency.around_failovers.max == pytest.approx(0.09)  # the one retried across the kill
    assert report.latency.steady.max == pytest.approx(0.02)
    a = report.active_engines
    assert a.ever_not_one and not a.ever_more_than_one and a.min == 0 and a.max == 1
    assert [round(p.seconds, 3) for p in a.periods] == [0.02] and a.periods[0].during_fault
    assert report.memory.pss_growth_pct == pytest.approx(2.5)
    checks = {c.name: c.ok for c in report.checks}
    assert checks["no failed non-streaming request"] and checks["exactly one active engine outside failovers"]
    assert checks["every planned fault injected"] and checks["failover p99 <= 0.15 s"]


def test_honest_metrics_say_where_they_agree_and_differ() -> None:
    report = build_report(_run(_failover_events(), _metrics()))
    h = {m.name: m for m in report.honest_metrics}
    assert h["failovers (count)"].agree is True
    assert h["recovery_seconds (mean)"].agree is True  # 1.49 vs 1.5
    fo = h["failover_seconds (mean)"]  # (the supervisor's ends at the promotion on a quiet node: no check)
    assert fo.agree is True and not fo.comparable and "minus fault -> detection" in fo.note
    assert h["recovery_seconds (p99)"].agree is True and "inside" in h["recovery_seconds (p99)"].note
    assert h["weight cache hits"].agree is True and h["router requests"].agree is True
    assert h["router retries"].agree is None and "no retries header" in h["router retries"].note
    assert {c.name: c.ok for c in report.checks}["supervisor metrics agree with the client"]


def test_honest_metrics_fail_the_check_when_counts_differ() -> None:
    before, after = _metrics()
    m = Metrics()  # a supervisor that counted two failovers and a miss the client never saw
    m.failovers.labels(reason="exit").inc(2)
    m.count_weights_source("disk:mismatch")
    report = build_report(_run(_failover_events(), (before, MetricsSnapshot.parse(m.render().decode()))))
    h = {x.name: x for x in report.honest_metrics}
    assert h["failovers (count)"].agree is False and h["weight cache misses"].agree is False
    check = next(c for c in report.checks if c.name == "supervisor metrics agree with the client")
    assert not check.ok and "failovers (count)" in check.detail


def test_two_primaries_fail_the_active_check() -> None:
    events = [_tr(3.0, "b", "READY", "READY", "primary")]  # b claims primary while a still is
    report = build_report(_run(events))
    assert report.active_engines.ever_more_than_one and report.active_engines.max == 2
    check = next(c for c in report.checks if c.name == "exactly one active engine outside failovers")
    assert not check.ok and "more than one" in check.detail


def test_report_folder_round_trips(tmp_path: Path) -> None:
    data = _run(_failover_events(), _metrics())
    report = build_report(data)
    files = write_report(tmp_path, report, data)
    assert files == ["report.json", "report.md", "latency.png", "raw.jsonl"]
    assert (tmp_path / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = ChaosReport.model_validate_json((tmp_path / "report.json").read_text())
    assert again.faults[0].failover_s == report.faults[0].failover_s
    md = (tmp_path / "report.md").read_text()
    assert "## Honest metrics" in md and "| failover_seconds (mean) |" in md and "![latency" in md
    assert len((tmp_path / "raw.jsonl").read_text().splitlines()) == 200 + 2 + len(data.events)


def test_fault_windows_merge_and_lookup() -> None:
    merged = merge([(5.0, 7.0), (1.0, 2.0), (6.0, 9.0), (9.0, 10.0)])
    assert merged == [(1.0, 2.0), (5.0, 10.0)]
    assert [inside(t, merged) for t in (0.5, 1.0, 2.0, 3.0, 5.0, 9.5, 10.0, 10.5)] == [
        False, True, True, False, True, True, True, False]
    assert not inside(1.0, [])


def test_cache_counts_replacements_seen_only_in_events() -> None:
    """A replacement that came and went between two /status polls still counts, once."""
    from harness.chaos.analysis import cache_from_status
    from harness.chaos.events import RecoveredEvent
    from harness.chaos.records import EngineView, StatusSample

    def sample(t: float, inc: int, source: str) -> StatusSample:
        return StatusSample(t=t, epoch=1, daemons=[], engines=[
            EngineView("a", "engine", "primary", "READY", 10, incarnation=inc, weights_source=source)])

    polls = [sample(0.0, 0, "cache_hit"), sample(1.0, 2, "cache_hit")]  # incarnation 1 was never polled
    events = [RecoveredEvent(type="recovered", ts=0.5, engine="a", incarnation=1, weights_source="disk:mismatch"),
              RecoveredEvent(type="recovered", ts=0.9, engine="a", incarnation=2, weights_source="cache_hit")]
    cache = cache_from_status(polls, events)
    assert (cache.hits, cache.misses, cache.miss_reasons) == (1, 1, {"mismatch": 1})


def test_greedy_differences_are_split_by_continuation() -> None:
    """Outputs unlike their endpoint's most common one, and how many of those were continued."""
    from harness.chaos.analysis import continued_ids, greedy_differing
    from harness.chaos.events import MigrationEvent
    from harness.chaos.report_md import _differ_split
    from harness.chaos.schema import RequestCounts, Requests

    def req(i: int, endpoint: str, text: str) -> RequestRecord:
        return RequestRecord(id=i, endpoint=endpoint, stream=False, t_start=T0, t_end=T0, ok=True,
                             response_id=f"r{i}", text=text)
    reqs = [req(0, "chat", "x"), req(1, "chat", "x"), req(2, "chat", "y"), req(3, "completion", "p"),
            req(4, "completion", "q"), req(5, "completion", "p")]
    events = [MigrationEvent.model_validate({"type": "migration", "result": r, "request_id": rid, "ts": T0})
              for rid, r in (("r2", "continued"), ("r1", "continued"), ("r4", "failed"))]
    assert {r.id for r in greedy_differing(reqs)} == {2, 4}
    assert continued_ids(events) == {"r1", "r2"}
    counts = RequestCounts(sent=6, succeeded=6, failed=0)
    q = Requests(all=counts, streaming=counts, non_streaming=counts, greedy_differ=2,
                 greedy_differ_continued=1, continued_outputs=2)
    assert _differ_split(q) == "continued: 1 of 2; never continued: 1 of 4"


def test_small_time_figures_agree_within_an_absolute_floor_and_say_so() -> None:
    """Issue 23: a healthy run failed --strict on failover_seconds mean 43.3 ms (supervisor) vs 37.8 ms
    (client), 12.6% > 10%: 5.5 ms is sampling, not a lie. Time figures agree within 10 ms absolute;
    the rule that decided is kept with the figure; counts get no floor."""
    from harness.chaos.honest import compare
    fo = compare("failover_seconds (mean)", 0.0433, 0.0378, 0.10, floor_s=0.010)
    assert fo.agree is True and fo.rule == "absolute: 5.5 ms <= the 10 ms floor (12.7% > 10%)"
    far = compare("failover_seconds (mean)", 0.0433, 0.0278, 0.10, floor_s=0.010)
    assert far.agree is False and far.rule == "relative: 35.8% > 10%; absolute: 15.5 ms > 10 ms"
    near = compare("recovery_seconds (mean)", 1.49, 1.5, 0.10, floor_s=0.010)
    assert near.agree is True and near.rule.startswith("relative: 0.7%")
    count = compare("failovers (count)", 3.0, 2.0, 0.10)
    assert count.agree is False and "absolute" not in count.rule
    report = build_report(_run(_failover_events(), _metrics()))
    check = next(c for c in report.checks if c.name == "supervisor metrics agree with the client")
    assert "time figures also 10 ms absolute" in check.detail
    assert all(m.rule for m in report.honest_metrics if m.agree is not None)
