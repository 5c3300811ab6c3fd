"""Prometheus text (an admin or engine /metrics page): snapshots, deltas and histogram quantiles; the
one Prometheus reader of the harness."""
from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]


class MetricsParseError(ValueError):
    """The /metrics body is not Prometheus text."""


@dataclass(frozen=True)
class MetricsSnapshot:
    """Every sample of one scrape: (sample name, labels) -> value."""

    samples: dict[tuple[str, Labels], float]

    @classmethod
    def parse(cls, text: str) -> MetricsSnapshot:
        """Parse Prometheus exposition text; MetricsParseError with the reason if it is not."""
        samples: dict[tuple[str, Labels], float] = {}
        try:
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    samples[(s.name, frozenset(s.labels.items()))] = float(s.value)
        except (ValueError, IndexError, KeyError) as exc:
            raise MetricsParseError(f"/metrics is not Prometheus text: {exc}") from None
        return cls(samples)

    def has(self, name: str) -> bool:
        """Whether any sample is called `name`."""
        return any(n == name for n, _ in self.samples)

    def total(self, name: str, **match: str) -> float:
        """Sum of the samples called `name` whose labels include `match` (0 if none)."""
        want = set(match.items())
        return sum(v for (n, labels), v in self.samples.items() if n == name and want <= labels)

    def increase_since(self, earlier: MetricsSnapshot, name: str, **match: str) -> float | None:
        """How much the samples `name` (labels including `match`) grew since `earlier`; None if not exported."""
        if not self.has(name):
            return None
        return self.total(name, **match) - earlier.total(name, **match)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Samples called `name` summed per value of `label`."""
        out: dict[str, float] = {}
        for (n, labels), v in self.samples.items():
            if n == name:
                key = dict(labels).get(label, "")
                out[key] = out.get(key, 0.0) + v
        return out

    def histogram(self, name: str) -> Histogram:
        """The histogram `name` (all label sets merged)."""
        buckets: dict[float, float] = {}
        for (n, labels), v in self.samples.items():
            if n == f"{name}_bucket":
                le = float(dict(labels)["le"])
                buckets[le] = buckets.get(le, 0.0) + v
        return Histogram(
            buckets=sorted(buckets.items()),
            sum=self.total(f"{name}_sum"),
            count=self.total(f"{name}_count"),
        )


@dataclass(frozen=True)
class Histogram:
    """Cumulative buckets (upper bound, count), plus sum and count."""

    buckets: list[tuple[float, float]]
    sum: float
    count: float

    def minus(self, earlier: Histogram) -> Histogram:
        """The observations made between `earlier` and this scrape."""
        before = dict(earlier.buckets)
        return Histogram(
            buckets=[(le, c - before.get(le, 0.0)) for le, c in self.buckets],
            sum=self.sum - earlier.sum,
            count=self.count - earlier.count,
        )

    @property
    def mean(self) -> float | None:
        """sum / count, None without observations."""
        return self.sum / self.count if self.count > 0 else None

    def bucket_of(self, q: float) -> tuple[float, float] | None:
        """(lower, upper] bounds of the bucket holding the q-quantile; None without observations."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        prev_le = 0.0
        for le, c in self.buckets:
            if c >= rank:
                return prev_le, le
            prev_le = le
        return prev_le, math.inf

    def quantile(self, q: float) -> float | None:
        """Estimate as PromQL histogram_quantile does (linear inside the bucket); q in [0, 1]."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        prev_le, prev_c = 0.0, 0.0
        for le, c in self.buckets:
            if c >= rank:
                if math.isinf(le):
                    return prev_le  # beyond the last finite bucket: its bound is all we know
                if c == prev_c:
                    return le
                return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
            prev_le, prev_c = le, c
        return prev_le
