"""Chaos statistics and Prometheus-text parsing (pure functions, real prometheus_client output)."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from harness.prometheus import MetricsParseError, MetricsSnapshot
from harness.stats import percentile, relative_difference, summarize


def test_percentile_interpolates_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="percentile q"):
        percentile([1.0], 101)


def test_summarize_and_relative_difference() -> None:
    d = summarize([0.1, 0.2, 0.3])
    assert (d.n, d.min, d.max) == (3, 0.1, 0.3)
    assert d.mean == pytest.approx(0.2) and d.p50 == pytest.approx(0.2)
    assert summarize([]).n == 0 and summarize([]).p99 is None
    assert relative_difference(0.0, 0.0) == 0.0
    assert relative_difference(90.0, 100.0) == pytest.approx(0.1)
    assert relative_difference(100.0, 90.0) == pytest.approx(0.1)


def _scrape(observations: list[float], hits: int, misses: int) -> MetricsSnapshot:
    reg = CollectorRegistry()
    h = Histogram("understudy_failover_seconds", "x", buckets=(0.05, 0.1, 0.15, 0.25), registry=reg)
    c = Counter("understudy_weight_cache_requests", "x", ["result", "reason"], registry=reg)
    for v in observations:
        h.observe(v)
    for _ in range(hits):
        c.labels(result="hit", reason="").inc()
    for _ in range(misses):
        c.labels(result="miss", reason="mismatch").inc()
    return MetricsSnapshot.parse(generate_latest(reg).decode())


def test_histogram_delta_mean_and_quantile() -> None:
    before = _scrape([0.01], hits=1, misses=0)
    after = _scrape([0.01, 0.06, 0.07, 0.08, 0.12], hits=3, misses=1)
    h = after.histogram("understudy_failover_seconds").minus(before.histogram("understudy_failover_seconds"))
    assert h.count == 4
    assert h.mean == pytest.approx((0.06 + 0.07 + 0.08 + 0.12) / 4)
    # 3 of 4 in (0.05, 0.1], 1 in (0.1, 0.15]: the median lies in the second bucket, p99 in the third
    assert 0.05 < h.quantile(0.5) <= 0.1
    assert 0.1 < h.quantile(0.99) <= 0.15
    total = "understudy_weight_cache_requests_total"
    assert after.total(total, result="hit") - before.total(total, result="hit") == 2
    assert after.by_label(total, "reason") == {"": 3.0, "mismatch": 1.0}
    assert not after.has("understudy_nothing_total")


def test_metrics_parse_error_is_one_line() -> None:
    with pytest.raises(MetricsParseError, match="not Prometheus text"):
        MetricsSnapshot.parse("understudy_x{le=} nonsense\n")
