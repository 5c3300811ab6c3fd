import json, sys
for run in sys.argv[1:]:
    d = json.load(open(f"{run}/fo.json"))[0]
    g, q, f, t = d["gap_across_kill_ms"], d["gap_at_quiet_moments_ms"], d["failover_seconds_ms"], d["continuation_timeline_ms"]
    print(f"| {run} | {g['p50']} / {g['p99']} / {g['max']} | {q['p50']} | {f['p50']} / {f['max']} | "
          + " / ".join(str(t[k]['p50']) for k in ("lost", "sent", "answered", "token"))
          + f" | {d['standby_back_s']['max']} | {d['failed']} of {d['requests']} | {d['client_cpu_share_max']} |")
