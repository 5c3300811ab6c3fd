"""Percentiles and summaries of plain lists of figures: the one statistics module of the harness
(chaos reports interpolate between ranks; the benchmarks report nearest-rank percentiles)."""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from pydantic import BaseModel


class Distribution(BaseModel):
    """Summary of a list of seconds."""

    n: int
    min: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None
    mean: float | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between closest ranks; None if empty."""
    if not values:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    if lo == hi:
        return ordered[lo]
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def nearest_rank(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list: always one of the values."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


P99_MIN_N = 100  # fewer samples: their max says more, and is what is reported


def summarize(values: Sequence[float]) -> Distribution:
    """n, min, p50, p90, max and mean of `values` (all None when empty); p99 only with at least
    P99_MIN_N values."""
    if not values:
        return Distribution(n=0)
    return Distribution(n=len(values), min=min(values), p50=percentile(values, 50), p90=percentile(values, 90),
                        p99=percentile(values, 99) if len(values) >= P99_MIN_N else None, max=max(values),
                        mean=sum(values) / len(values))


def bench_summary(xs: Sequence[float], ndigits: int = 3) -> dict[str, float]:
    """A benchmark's figures: n, the median (`p50`: the mean of the two middle values for an even
    count), mean, max and min, and the nearest-rank p99 only with at least P99_MIN_N samples
    ({} when empty)."""
    if not xs:
        return {}
    out = {"n": len(xs), "p50": round(statistics.median(xs), ndigits), "mean": round(statistics.fmean(xs), ndigits),
           "max": round(max(xs), ndigits), "min": round(min(xs), ndigits)}
    if len(xs) >= P99_MIN_N:
        out["p99"] = round(nearest_rank(xs, 99), ndigits)
    return out


def tail_text(summary: dict[str, float], unit: str = "ms", fmt: str = ".1f") -> str:
    """'p99 X' with n >= P99_MIN_N samples, else 'max of n X': never a p99 of a few samples."""
    if "p99" in summary:
        return f"p99 {summary['p99']:{fmt}} {unit}"
    return f"max of {summary.get('n', 0)} {summary.get('max', float('nan')):{fmt}} {unit}"


def relative_difference(a: float, b: float) -> float:
    """|a - b| relative to the larger magnitude; 0 when both are 0."""
    scale = max(abs(a), abs(b))
    return 0.0 if scale == 0 else abs(a - b) / scale
