"""What a client feels around the kills of `bench failover --streams`, with first-token waits apart
from waits between tokens: at quiet moments (windows that open `--quiet-after` s after the previous
failover's standby is READY, so none of its aftermath is counted) and across each kill, and the
time to first token of requests sent during a failover's aftermath."""
from __future__ import annotations

from typing import Any

from harness.load.jobs import Gaps
from harness.stats import bench_summary


def _ms(xs: list[float]) -> dict[str, float]:
    return bench_summary([x * 1000 for x in xs], 2)


def first_token_waits(gaps: list[Gaps], starts: list[float], ends: list[float],
                      by: list[float] | None = None) -> list[float]:
    """The time to first token of every request sent in one of the spans [starts[i], ends[i]) that
    got a token (a failed one is counted as failed elsewhere), and got it by `by[i]` if given (a
    quiet window's request whose wait ran into the kill after it is not a quiet one)."""
    bounds = by or [float("inf")] * len(starts)
    return [g.first_at - g.sent for g in gaps if g.first_at is not None
            and any(s <= g.sent < e and g.first_at <= b for s, e, b in zip(starts, ends, bounds))]


def client_feel(gaps: list[Gaps], kills: list[float], quiet: list[float], within: float) -> dict[str, Any]:
    """The figures, from each request's Gaps over the marks `kills + quiet` (quiet[i]: the start of
    the quiet window before kills[i], which it ends; `itl` taken at the quiet marks)."""
    n = len(kills)
    between_kill = [b for g in gaps for b in g.between[:n] if b is not None]
    between_quiet = [b for g in gaps for b in g.between[n:] if b is not None]
    added = [a - q for g in gaps for a, q in zip(g.between[:n], g.between[n:]) if a is not None and q is not None]
    itl = [w for g in gaps for ws in g.itl for w in ws]
    quiet_ends = [min(q + within, k) for q, k in zip(quiet, kills)]
    return {
        "quiet_wait_between_tokens_ms": _ms(between_quiet),
        "quiet_itl_ms": _ms(itl),
        "quiet_first_token_ms": _ms(first_token_waits(gaps, quiet, quiet_ends, kills)),
        "kill_wait_between_tokens_ms": _ms(between_kill),
        "added_by_kill_between_tokens_ms": _ms(added),
        "failover_first_token_ms": _ms(first_token_waits(gaps, kills, [k + within for k in kills])),
    }
