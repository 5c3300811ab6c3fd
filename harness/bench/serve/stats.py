"""Per-point figures from the requests' timings, as pydantic models (they are the JSON report)."""
from __future__ import annotations

import statistics

from pydantic import BaseModel

from harness.load.result import RequestResult
from harness.stats import P99_MIN_N, nearest_rank


class Dist(BaseModel):
    """Milliseconds: the median, mean and max of a sample (absent when the sample is empty), and
    the nearest-rank p99 only with at least P99_MIN_N values."""

    p50: float
    p99: float | None
    max: float
    mean: float
    count: int

    @classmethod
    def of_seconds(cls, xs: list[float]) -> "Dist | None":
        if not xs:
            return None
        ms = [x * 1000 for x in xs]
        return cls(p50=round(statistics.median(ms), 3),
                   p99=round(nearest_rank(ms, 99), 3) if len(ms) >= P99_MIN_N else None,
                   max=round(max(ms), 3), mean=round(statistics.fmean(ms), 3), count=len(ms))

    def tail(self) -> str:
        """The p99, or the max marked '*' where there are too few values for a p99."""
        return f"{self.p99:.2f}" if self.p99 is not None else f"{self.max:.2f}*"


class PrefixCache(BaseModel):
    """Prefix-cache tokens queried and hit during the point (counter deltas) and their ratio."""

    source: str
    queried_tokens: float
    hit_tokens: float
    hit_rate: float | None


class Point(BaseModel):
    """One concurrency of the sweep."""

    concurrency: int
    requests: int  # sent
    ok: int
    errors: int
    error_samples: list[str]
    duration_s: float
    output_tokens: int  # of the requests that succeeded
    prompt_tokens: int
    output_tokens_from: str  # "usage" (the server's count) or "chunks" (content chunks counted)
    content_chunks: int  # ITL is measured between these; fewer than output_tokens where text was held back
    output_tok_s: float
    req_s: float
    ttft_ms: Dist | None
    itl_ms: Dist | None  # gaps between content chunks, all requests pooled
    itl_same_read: int = 0  # of those gaps, the ones of 0 (chunks that arrived in one read of the socket)
    tpot_ms: Dist | None  # per request: (latency - ttft) / (output tokens - 1)
    latency_ms: Dist | None
    prefix_cache: PrefixCache | str = "n/a"  # "n/a": the counters were not found
    static_batch: int | None = None
    static_tok_s: float | None = None
    ratio_to_static: float | None = None
    client_cpu: float | None = None  # the load generator's CPU seconds per wall second (near 1: it is the limit)


def summarize(concurrency: int, results: list[RequestResult], duration_s: float) -> Point:
    good = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    samples: list[str] = []
    for r in errors:
        if r.error not in samples:
            samples.append(r.error or "?")
        if len(samples) == 5:
            break
    out = sum(r.output_tokens for r in good)
    itl = [x for r in good for x in r.itl]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in good if r.ttft is not None and r.output_tokens > 1]
    return Point(
        concurrency=concurrency, requests=len(results), ok=len(good), errors=len(errors), error_samples=samples,
        duration_s=round(duration_s, 4), output_tokens=out, prompt_tokens=sum(r.prompt_tokens for r in good),
        output_tokens_from="usage" if good and all(r.usage_reported for r in good) else "chunks",
        content_chunks=sum(len(r.content_times) for r in good),
        output_tok_s=round(out / duration_s, 2) if duration_s > 0 else 0.0,
        req_s=round(len(good) / duration_s, 3) if duration_s > 0 else 0.0,
        ttft_ms=Dist.of_seconds([r.ttft for r in good if r.ttft is not None]),
        itl_ms=Dist.of_seconds(itl), itl_same_read=sum(1 for x in itl if x == 0.0),
        tpot_ms=Dist.of_seconds(tpot), latency_ms=Dist.of_seconds([r.latency for r in good]))
