"""Prefix-cache counters read from a Prometheus /metrics page before and after a point."""
from __future__ import annotations

import httpx

from harness.prometheus import MetricsParseError, MetricsSnapshot

from .stats import PrefixCache

QUERIED = "understudy_prefix_cache_queried_tokens_total"
HIT = "understudy_prefix_cache_hit_tokens_total"


def parse_counters(text: str, names: tuple[str, ...] = (QUERIED, HIT)) -> dict[str, float]:
    """Each named metric summed over its label sets; a name absent from the page is absent here."""
    try:
        snap = MetricsSnapshot.parse(text)
    except MetricsParseError:
        return {}
    return {name: snap.total(name) for name in names if snap.has(name)}


def scrape(sources: list[tuple[str, dict[str, str]]]) -> tuple[str, dict[str, float]] | None:
    """(url, counters) from the first source that has both counters; None when none has."""
    for url, headers in sources:
        try:
            r = httpx.get(url, headers=headers, timeout=10)
        except httpx.HTTPError:
            continue
        if r.status_code == 200:
            counters = parse_counters(r.text)
            if QUERIED in counters and HIT in counters:
                return url, counters
    return None


def prefix_delta(before: tuple[str, dict[str, float]] | None,
                 after: tuple[str, dict[str, float]] | None) -> PrefixCache | str:
    """The point's hit rate from counter deltas; "n/a" when the counters are not both readable."""
    if before is None or after is None or before[0] != after[0]:
        return "n/a"
    q = after[1][QUERIED] - before[1][QUERIED]
    h = after[1][HIT] - before[1][HIT]
    return PrefixCache(source=after[0], queried_tokens=q, hit_tokens=h, hit_rate=round(h / q, 4) if q > 0 else None)
