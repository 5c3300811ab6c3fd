"""Summarize the A/B runs' JSON (bench failover --json) into one table."""
import json, sys, statistics
rows = []
for name in sys.argv[1:]:
    t = open(f"{name}.txt").read()
    r = json.loads(t[t.index("\n[") + 1:])[0]
    rc, g, q, tl = (r["recomputed_tokens_per_continuation"], r["gap_across_kill_ms"], r["gap_at_quiet_moments_ms"],
                    r["continuation_timeline_ms"])
    print(f"| {name} | {rc['p50']} / {rc['mean']} / {rc['max']} (n {rc['n']}) | {g['p50']} / {g.get('p99')} (n {g['n']}) "
          f"| {q['p50']} | {tl['answered']['p50']} / {tl['token']['p50']} | {r['failover_seconds_ms']['p50']} "
          f"| {r['standby_back_s']['p50']} | {r['failed']} of {r['requests']} | {r['client_cpu_share_max']} |")
