"""The short table `bench failover --streams` prints per node: each figure's n, median and tail
(p99 with at least 100 samples, else the max of n: never a p99 of a few)."""
from __future__ import annotations

from typing import Any

ROWS = (  # (the result's key, what the row says)
    ("gap_added_by_kill_ms", "added by a kill to a stream's wait (ms)"),
    ("added_by_kill_between_tokens_ms", "  the same, waits between tokens only"),
    ("gap_across_kill_ms", "a stream's longest wait across a kill (ms)"),
    ("quiet_wait_between_tokens_ms", "quiet: longest wait between tokens (ms)"),
    ("quiet_itl_ms", "quiet: inter-token latency (ms)"),
    ("quiet_first_token_ms", "quiet: time to first token (ms)"),
    ("failover_first_token_ms", "sent within the window after a kill: TTFT (ms)"),
    ("kill_to_detection_ms", "kill -> detection (ms)"),
    ("failover_seconds_ms", "failover_seconds (ms)"),
    ("promotion_in_engine_ms", "the writer role taken, in the engine (ms)"),
    ("pool_adoption_ms", "  the pool read, after the answer (ms)"),
    ("recomputed_tokens_per_continuation", "tokens recomputed per continuation"),
    ("standby_back_s", "standby back (s)"),
)


def _tail(s: dict[str, float]) -> str:
    if not s:
        return "-"
    return f"p99 {s['p99']}" if "p99" in s else f"max of {s['n']} {s['max']}"


def table(r: dict[str, Any]) -> str:
    """The node's figures as lines of a table, the continuations' timeline and the counts after it."""
    asked = f" (of {r['kills_asked']} asked: --kill-for ended them)" if r.get("kills_asked", r["kills"]) != r["kills"] \
        else ""
    head = (f"shared_kv={r['shared_kv']}: {r['streams']} streams, {r['kills']} kills{asked}; quiet windows "
            f"{r['quiet_after_s']:g} s after the standby READY, windows {r['gap_window_s']:g} s")
    lines = [head, f"  {'figure':<48} {'n':>6} {'p50':>9}  tail"]
    for key, label in ROWS:
        s = r.get(key) or {}
        lines.append(f"  {label:<48} {s.get('n', 0):>6} {s.get('p50', '-'):>9}  {_tail(s)}")
    t = r["continuation_timeline_ms"]
    lines.append("  continuations, ms after the kill (median / max): " + ", ".join(
        f"{name} {s.get('p50')} / {s.get('max')}" for name, s in t.items()))
    lines.append(f"  failed {r['failed']} of {r['requests']}; client CPU max {r['client_cpu_share_max']:.0%}; "
                 f"supervisor (router) CPU {r['supervisor_cpu_share']:.0%}; continuations recomputing over one "
                 f"token {r['continuations_recomputing_more_than_one']}")
    return "\n".join(lines)
