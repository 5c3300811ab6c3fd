"""The figures the status page charts from heartbeats (issue 24): output tokens as a node-wide counter
that survives engine restarts, and a busy engine's mean step time (the gap between two tokens of
each decoding stream, at the engine) as a histogram."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from supervisor.metrics import Metrics


def samples(m: Metrics) -> dict[str, float]:
    return {s.name + ("" if "le" not in s.labels else f'{{le="{s.labels["le"]}"}}'): s.value
            for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}


def beat(steps: int, running: int, generated: int) -> dict:
    return {"steps": steps, "running": running, "waiting": 0, "generated_tokens": generated}


def test_generated_tokens_add_their_growth_and_a_new_incarnation_starts_from_zero():
    m = Metrics()
    prev: dict = {}
    for hb in (beat(10, 2, 40), beat(20, 2, 60), beat(3, 1, 5)):  # the last: a restarted engine
        m.record_heartbeat("a", hb, prev, now=0.0)
        prev = hb
    m.record_heartbeat("b", beat(1, 1, 7), {}, now=0.0)
    assert samples(m)["understudy_generated_tokens_total"] == 40 + 20 + 5 + 7


def test_step_time_is_observed_only_over_an_interval_busy_at_both_ends():
    m = Metrics()
    m.record_heartbeat("a", beat(100, 4, 0), {}, now=10.0)  # first: nothing to compare with
    m.record_heartbeat("a", beat(150, 4, 0), beat(100, 4, 0), now=10.5)  # 50 steps in 0.5 s: 10 ms each
    m.record_heartbeat("a", beat(160, 0, 0), beat(150, 4, 0), now=11.0)  # went idle: not a step time
    m.record_heartbeat("a", beat(160, 3, 0), beat(160, 0, 0), now=11.5)
    m.record_heartbeat("a", beat(2, 3, 0), beat(160, 3, 0), now=12.0)  # a new incarnation: steps restart
    s = samples(m)
    assert s["understudy_engine_step_seconds_count"] == 1
    assert abs(s["understudy_engine_step_seconds_sum"] - 0.01) < 1e-9
    assert s['understudy_engine_step_seconds_bucket{le="0.01"}'] == 1
    assert s['understudy_engine_step_seconds_bucket{le="0.008"}'] == 0


def test_kv_blocks_checked_and_found_changed_are_node_wide_counters():
    m = Metrics()
    m.record_heartbeat("a", {"kv_checked_blocks": 30, "kv_corrupt_blocks": 2}, {}, now=0.0)
    m.record_heartbeat("a", {"kv_checked_blocks": 50, "kv_corrupt_blocks": 2},
                       {"kv_checked_blocks": 30, "kv_corrupt_blocks": 2}, now=1.0)
    m.record_heartbeat("b", {"kv_checked_blocks": 4, "kv_corrupt_blocks": 1}, {}, now=1.0)  # the next primary
    s = samples(m)
    assert s["understudy_kv_checked_blocks_total"] == 54 and s["understudy_kv_corrupt_blocks_total"] == 3


def test_an_engines_heartbeat_gauges_reach_the_nodes_metrics_cuda_graphs_pending_too():
    """A second operator's review: understudy_engine_cuda_graphs_pending was only on the engine's own
    (secret-gated) /metrics, never scraped; the node's carries every heartbeat gauge, per engine."""
    m = Metrics()
    m.record_heartbeat("a", {**beat(5, 2, 0), "kv_blocks_used": 7, "cuda_graphs_pending": 9}, {}, now=0.0)
    m.record_heartbeat("a", {**beat(6, 2, 0), "kv_blocks_used": 8, "cuda_graphs_pending": 0}, {}, now=1.0)
    text = m.render().decode()
    assert 'understudy_engine_cuda_graphs_pending{engine="a"} 0.0' in text
    assert 'understudy_engine_running_seqs{engine="a"} 2.0' in text and 'understudy_engine_kv_blocks_used{engine="a"} 8.0' in text
