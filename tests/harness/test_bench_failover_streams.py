"""`understudy bench failover --streams`: what each stream saw across the kills, from the requests'
timelines (harness/load's RequestResult -> Gaps -> summarize), without a node."""
from __future__ import annotations

import argparse

from harness.bench.failover_streams import add_args, summarize
from harness.load.jobs import Gaps, ProcessReport
from harness.load.result import RequestResult
from harness.stats import bench_summary


def stream(sent: float, tokens: list[float], error: str | None = None) -> RequestResult:
    return RequestResult(path="/v1/completions", stream=True, sent=sent, end=tokens[-1] if tokens else sent + 1,
                         content_times=tokens, error=error)


def test_the_gap_across_a_kill_is_the_longest_wait_for_tokens_in_the_window_after_it():
    r = stream(10.0, [10.1, 10.2, 10.9, 11.0, 11.05, 11.5, 13.0])
    assert abs(r.gap_across(10.5) - 0.7) < 1e-9
    assert abs(r.gap_across(10.15) - 0.7) < 1e-9  # tokens on their way at the kill: the stall came after them
    assert abs(r.gap_across(10.05) - 0.7) < 1e-9  # before its first tokens: the wait from the send counts
    assert abs(r.gap_across(10.05, within=0.1) - 0.1) < 1e-9  # a shorter window: up to the first gap begun in it
    assert abs(r.gap_across(11.02) - 1.5) < 1e-9  # the gap begun in the window counts whole
    assert r.gap_across(9.0) is None and r.gap_across(14.0) is None  # not in flight then
    g = Gaps.of(r, [9.0, 10.5])
    assert g.across[0] is None and abs(g.across[1] - 0.7) < 1e-9 and abs(g.longest - 1.5) < 1e-9


def test_summarize_pools_every_stream_in_flight_per_kill_and_keeps_the_others_apart():
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--streams", "3", "--window", "1", "--kill-for", "30"])
    args.runs = 4  # (--kill-for ended them after one)
    kills = [20.0]
    results = [stream(19.5, [19.6, 20.05, 20.75, 20.8]),  # in flight: 0.7 s after a token on its way at the kill
               stream(19.8, [19.9, 20.1]),  # in flight: 0.2 s
               stream(30.0, [30.5, 30.6]),  # far from the kill: its longest gap is an "other" stream's
               stream(31.0, [], error="HTTP 503: no primary")]
    report = ProcessReport(start=19.0, end=32.0, cpu_s=1.3, gaps=[Gaps.of(r, kills) for r in results])
    out = summarize(args, True, [report], kills, [0.012], [1.5], [1, 3, 1])
    assert out["streams_in_flight_per_kill"] == {"min": 2, "max": 2}
    assert out["kills"] == 1 and out["kills_asked"] == 4
    assert out["gap_across_kill_ms"] == bench_summary([700.0, 200.0], 2)
    assert out["longest_gap_other_streams_ms"]["n"] == 1 and out["longest_gap_other_streams_ms"]["max"] == 500.0
    assert out["failover_seconds_ms"]["p50"] == 12.0 and out["recomputed_tokens_per_continuation"]["max"] == 3
    assert out["continuations_recomputing_more_than_one"] == 1
    assert out["requests"] == 4 and out["failed"] == 1 and out["failures"][0]["error"] == "HTTP 503: no primary"
    assert out["client_cpu_share_max"] == 0.1 and out["client_procs"] == 1
    # the longest waits, placed: 0.7 s after 2 token events, begun 50 ms after the kill; then 0.5 s,
    # the first token's wait of a stream sent 10 s after it
    assert out["longest_waits"][:2] == [{"ms": 700.0, "tokens_before": 2, "error": None, "after_kill_ms": 50.0},
                                        {"ms": 500.0, "tokens_before": 0, "error": None, "after_kill_ms": 10000.0}]


def test_a_quiet_moments_gap_ends_by_its_kill():
    """The quiet window from the node whole (10.0) to the kill (11.2): the stall that begins in it
    and ends after the kill is the kill's, not the quiet moment's."""
    r = stream(9.5, [9.6, 10.2, 10.5, 11.15, 11.9, 12.0])
    assert abs(r.gap_across(10.0, 1.0, until=11.2) - 0.65) < 1e-9
    assert abs(r.gap_across(11.2) - 0.75) < 1e-9  # across the kill: 11.15 -> 11.9
    g = Gaps.of(r, [11.2, 10.0], 1.0, [None, 11.2])
    assert [round(a, 2) for a in g.across] == [0.75, 0.65]


def test_the_supervisors_cpu_share_is_its_cpu_seconds_per_wall_second():
    import os
    import time
    from harness.bench.failover_streams import CpuShare
    t0 = time.monotonic()
    share = CpuShare(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:  # 0.2 s of CPU
        pass
    time.sleep(0.2)  # then idle: the share falls (a loaded machine makes both the CPU's and the wall's longer)
    got, expected = share.share(), 0.2 / (time.monotonic() - t0)
    assert expected * 0.9 <= got <= expected * 1.3 + 0.02, (got, expected)


def test_a_continuations_moments_count_from_the_kill_that_lost_its_primary():
    from harness.bench.failover_streams import timeline_after_kills, timeline_by_kill
    events = [{"type": "migration", "result": "continued",
               "timeline": {"lost": 10.01, "sent": 10.05, "answered": 10.1, "token": 10.2}},
              {"type": "migration", "result": "continued",
               "timeline": {"lost": 20.02, "sent": 20.03, "answered": 20.3, "token": 20.4}},
              {"type": "migration", "result": "continued", "timeline": {"lost": 5.0}},  # before any kill: not counted
              {"type": "migration", "result": "quarantined", "timeline": {"lost": 10.5}},
              {"type": "continuations", "engine": "a", "reused": [16], "recomputed": [3]}]
    t = timeline_after_kills(events, [10.0, 20.0])
    assert t["lost"]["n"] == 2 and abs(t["lost"]["max"] - 20.0) < 1e-6
    assert abs(t["token"]["p50"] - 300.0) < 1e-6 and abs(t["answered"]["min"] - 100.0) < 1e-6
    by_kill = timeline_by_kill(events, [10.0, 20.0, 30.0])
    assert [round(k["lost"][0]) if k["lost"] else None for k in by_kill] == [10, 20, None]
    assert by_kill[1]["answered"] == [300.0, 300.0] and by_kill[2]["token"] == []


def test_the_supervisors_collections_between_two_scrapes_by_generation():
    from harness.bench.failover_streams import gc_pauses_between
    from harness.prometheus import MetricsSnapshot
    from supervisor.metrics import Metrics
    m = Metrics()
    m.observe_gc(0, 0.002)
    before = MetricsSnapshot.parse(m.render().decode())
    for gen, s in ((0, 0.001), (0, 0.003), (1, 0.012), (2, 0.040), (2, 0.008)):
        m.observe_gc(gen, s)
    got = gc_pauses_between(before, MetricsSnapshot.parse(m.render().decode()))
    assert got == {"0": {"count": 2, "total_ms": 4.0, "over_10ms": 0}, "1": {"count": 1, "total_ms": 12.0, "over_10ms": 1},
                   "2": {"count": 2, "total_ms": 48.0, "over_10ms": 1}}


def test_what_a_kill_added_pairs_a_streams_gap_across_it_with_its_own_quiet_gap_before():
    """Node whole at 10.0 (the quiet window 10.0-11.0), kill at 12.0. The first stream waits 0.3 s at
    quiet and 0.5 s across the kill: the kill added 0.2 s. The second began after the quiet window: it
    counts across the kill, not in what the kill added."""
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--streams", "2"])
    args.runs = 1
    kills, whole = [12.0], [10.0]
    results = [stream(9.5, [9.6, 9.9, 10.2, 10.5, 10.8, 11.1, 11.4, 11.7, 11.95, 12.45, 12.5]),
               stream(11.5, [11.6, 11.9, 12.6, 12.7])]
    gaps = [Gaps.of(r, kills + whole, 1.0, [None] + kills) for r in results]
    out = summarize(args, True, [ProcessReport(start=9.0, end=13.0, cpu_s=0.1, gaps=gaps)], kills, [0.01], [1.0], [])
    assert out["gap_across_kill_ms"] == bench_summary([500.0, 700.0], 2)
    assert out["gap_at_quiet_moments_ms"] == bench_summary([300.0], 2)
    assert out["gap_added_by_kill_ms"] == bench_summary([200.0], 2)


def test_a_client_feels_first_token_waits_apart_from_waits_between_tokens():
    """Quiet window 10.0-11.0 before a kill at 12.0. Stream A waits 0.3 s between tokens at quiet and
    0.5 s across the kill: the kill added 0.2 s. Stream B is sent in the quiet window: its 0.4 s wait
    for a first token is a quiet TTFT, not a wait between tokens. Stream C is sent 0.1 s after the
    kill and waits 0.6 s for its first token: a failover's TTFT."""
    from harness.bench.client_feel import client_feel
    from harness.bench.failover_table import table
    kills, quiet = [12.0], [10.0]
    results = [stream(9.5, [9.6, 9.9, 10.2, 10.5, 10.8, 11.1, 11.4, 11.7, 11.95, 12.45, 12.5]),
               stream(10.2, [10.6, 10.7, 10.8]),
               stream(12.1, [12.7, 12.8]),
               stream(10.9, [12.3])]  # (sent in the quiet window, its first token after the kill: not quiet)
    gaps = [Gaps.of(r, kills + quiet, 1.0, [None] + kills, [1]) for r in results]
    out = client_feel(gaps, kills, quiet, 1.0)
    assert out["quiet_wait_between_tokens_ms"] == bench_summary([300.0], 2)  # (B was not in flight as it opened)
    assert out["quiet_first_token_ms"] == bench_summary([400.0], 2)
    assert out["added_by_kill_between_tokens_ms"] == bench_summary([200.0], 2)
    assert out["failover_first_token_ms"] == bench_summary([600.0], 2)
    # every wait between tokens in the quiet window: A's four 0.3 s (9.9-11.1; 11.4 is past it), B's two 0.1 s
    assert sorted(round(w * 1000) for g in gaps for ws in g.itl for w in ws) == [100, 100, 300, 300, 300, 300]
    assert out["quiet_itl_ms"]["n"] == 6 and "p99" not in out["quiet_itl_ms"]  # few samples: no p99, their max
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--streams", "3"])
    args.runs = 1
    r = summarize(args, True, [ProcessReport(start=9.0, end=13.0, cpu_s=0.1, gaps=gaps)], kills, [0.01], [1.0], [],
                  quiet)
    r.update(continuation_timeline_ms={}, supervisor_cpu_share=0.1, kill_to_detection_ms={}, promotion_in_engine_ms={},
             pool_adoption_ms={})
    text = table(r)
    assert "quiet windows 5 s after the standby READY" in text and "max of 1 300.0" in text
