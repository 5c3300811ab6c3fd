#!/usr/bin/env bash
# The shared KV pool on one H200 (device tool), the 1b preset in bf16, one call per part:
#   bash bench/gpu_shared_kv.sh ab        # two nodes at once on GPU 0: shared_kv (one 32 GiB pool) on
#                                         # 8000/8001 and shared_kv: false (16 GiB per engine: the same
#                                         # memory) on 8100/8101; GPU memory per process; bench serve
#                                         # chat:32 and nano:256 on each in turn (ABBA), medians last
#   bash bench/gpu_shared_kv.sh failover  # understudy bench failover --streams 256 --runs 20 --compare:
#                                         # the gap of every stream in flight at each SIGKILL of the
#                                         # primary, failover_seconds, recomputed tokens, standby back;
#                                         # shared_kv: false beside it (STREAMS, RUNS change the counts;
#                                         # COMPARE= runs shared_kv only); each node's logs in $OUT/streams
#   bash bench/gpu_shared_kv.sh all       # ab, then failover
# Logs go to $OUT; the last lines printed are the figures.
source bench/gpu_env.sh
config() {  # config NAME PORT SHARED KV_BYTES: the h200 config on $M, its own ports, dirs and KV mode
  sed "s#preset: 1b#path: $M#; s#port: 8000#port: $2#; s#port: 8001#port: $(($2 + 1))#" configs/h200-1b.yaml \
    | sed "s#kv_cache_bytes: .*#kv_cache_bytes: $4\n  shared_kv: $3#" > /tmp/$1.yaml
  printf 'runtime_dir: /tmp/rt-%s\ncache_dir: /tmp/cache-%s\n' "$1" "$1" >> /tmp/$1.yaml
}
ab() {
  config shared 8000 true 34359738368
  config own 8100 false 17179869184
  serve_pair shared own
  for n in shared own; do echo "== $n"; python3 -m supervisor.cli status -c /tmp/$n.yaml; done > "$OUT/memory.txt" 2>&1
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> "$OUT/memory.txt"
  POINTS=${POINTS:-chat:32 nano:256} RUNS=${RUNS:-2} load_in_turn own shared
  kill -TERM $pid_shared $pid_own; wait $pid_shared $pid_own
  cat "$OUT/memory.txt"
}
failover() {
  config streams 8000 true 34359738368
  timeout ${FAILOVER_TIMEOUT:-580} python3 -m supervisor.cli bench failover -c /tmp/streams.yaml --streams ${STREAMS:-256} \
    --runs ${RUNS:-20} ${COMPARE---compare} --out $OUT/streams --json > "$OUT/failover_streams.json" \
    2> "$OUT/failover_streams.log"
  grep -v "^  kill" "$OUT/failover_streams.log" | tail -20
  python3 - "$OUT/failover_streams.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    g, q, f, rc = (r["gap_across_kill_ms"], r["gap_at_quiet_moments_ms"], r["failover_seconds_ms"],
                   r["recomputed_tokens_per_continuation"])
    print(f"shared_kv={r['shared_kv']}: gap across kill p50 {g.get('p50')} p99 {g.get('p99')} max {g.get('max')} ms "
          f"(n={g['n']}); at quiet moments p50 {q.get('p50')} p99 {q.get('p99')} max {q.get('max')} ms (n={q['n']}); "
          f"failover_seconds p50 {f.get('p50')} max {f.get('max')} ms (n={f['n']}); recomputed max "
          f"{rc.get('max')} p50 {rc.get('p50')} (n={rc['n']}); standby back p50 {r['standby_back_s'].get('p50')} "
          f"max {r['standby_back_s'].get('max')} s; failed {r['failed']} of {r['requests']}; client CPU max "
          f"{r['client_cpu_share_max']}; promotion in the engine {r.get('promotion_in_engine_ms')}")
PY
}
case "${1:-}" in
ab) ab ;;
failover) failover ;;
all) ab > "$OUT/ab.txt" 2>&1; failover; tail -8 "$OUT/ab.txt" ;;
*) echo "usage: $0 ab|failover|all" >&2; exit 2 ;;
esac
